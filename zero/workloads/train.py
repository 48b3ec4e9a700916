"""`python -m zero.workloads.train`: a GPT trained on text with ZeRO stages 0-3.

It trains a byte-level GPT on the Python standard library's own source (no download;
zero/workloads/data.py) or on `--data PATH`, with the loop every entry point shares
(`train_steps`, zero/loop.py). Rank 0 shows a progress bar (tqdm when installed, plain lines
otherwise) with the loss, tokens/s and each rank's resident model-state bytes; every
`--eval-every` steps all ranks evaluate the validation loss (forward only, averaged over ranks),
and every `--ckpt-every` steps (and at the end) the run is checkpointed to OUT/ckpt. Rank 0 writes
OUT/train_log.json (a zero.common.results record, atomically) and OUT/loss_curve.png, and appends
the loss history to OUT/ckpt/history.jsonl (zero/workloads/history.py).
`--resume` continues from OUT/ckpt/latest up to `--steps` in total; in deterministic mode
(the default) the result is bitwise that of an uninterrupted run, at any stage and world size.
Without a valid checkpoint there, `--resume` is refused (nothing runs, nothing is removed);
`--resume-if-present` starts afresh when OUT/ckpt is absent or empty. One run at a time per
OUT: OUT/run.lock (zero/checkpoint/lock.py) refuses a second one before it does any work, and a
stale lock (its holder killed) is cleared; temp files a killed run left are removed then too
([Note: leftover temp files] and [Note: crash leftovers] in zero/checkpoint/commit.py). A checkpoint records the run's
identity (train_config.RUN_IDENTITY: seed, data, model, M, precision, ...), and a resume that
changes any of it is refused by name unless --allow-changed-run.

Faults give one line, `python -m zero.workloads.train: error: ...`: a diverged loss or a full
disk mid-run, a rank that stopped (named within seconds, at any --timeout) or died (its signal,
and "out of memory" where the kernel's OOM killer is the likely cause) (exit 1, naming the step,
the cause or the rank, the file, and the checkpoint left), a checkpoint --resume cannot load
(exit 2, naming the file). `--debug` shows the full traceback
above it. A failed run leaves what its last checkpoint recorded: OUT/ckpt/history.jsonl is cut
back to that checkpoint's mark, and a fresh run that committed none leaves no history file at all
(nor an OUT it created, if empty).

Launching (the loop is the same in every case; only the process group differs):
  * one process:
        python -m zero.workloads.train --nproc 1
  * local ranks on this machine (forked gloo ranks, one thread each):
        python -m zero.workloads.train --stage 2 --nproc 4
  * one node with several GPUs (NCCL; the world torchrun gives, one GPU per rank):
        torchrun --standalone --nproc-per-node 8 -m zero.workloads.train --stage 3
  * several nodes (run on every node; HOST is the first node's address):
        torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d \\
                 --rdzv-endpoint HOST:29500 --rdzv-id JOB -m zero.workloads.train --stage 3
From a script: zero.ranks.local.spawn(fn, N) for local ranks, or
zero.ranks.launch.init_from_env() under torchrun, then `train_steps(engine, microbatch, steps)`.

Legend: N world size, M micro-batches per step (over all ranks), B sequences per micro-batch, T
tokens per sequence; a step consumes M·B·T tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..checkpoint import CheckpointError, lock
from ..collectives import launch
from ..common import cli
from ..common.results import make_record, write_json
from ..engine import StepResult, ZeroEngine
from ..loop import train_steps
from ..ranks.launch import RankError, init_from_env, leave_world, under_torchrun
from ..ranks.local import spawn
from ..ranks.watchdog import BLAME, CollectiveError, gather_objects, stranded
from .data import Corpus, load_corpus
from .history import FILE as HISTORY_FILE
from .history import HistoryLog, Progress, after_failure, plot_losses
from .models import GPT
from .train_config import (
    MODELS,
    TrainConfig,
    check_identity,
    claim,
    parse,
    resume_point,
    run_changes,
    run_identity,
)

KIND = "train.run"
"""The results-record kind of a training run's log."""
PROG = "python -m zero.workloads.train"


class RunFault(RuntimeError):
    """A fault mid-run (a diverged loss, a full disk) in one line naming the step, the cause and
    the checkpoint left; exit status 1. `detail`: the full traceback (--debug shows it)."""

    def __init__(self, line: str, detail: str = ""):
        super().__init__(cli.error_line(line))
        self.detail = detail


class ResumeRefused(ValueError):
    """The checkpoint --resume loads is refused (a damaged file, another model) in one line
    naming the file; a ValueError, so exit status 2 as for other bad input."""

    def __init__(self, line: str, detail: str = ""):
        super().__init__(cli.error_line(line))
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Inside a rank


@torch.no_grad()
def evaluate(engine: ZeroEngine, corpus: Corpus, *, seed: int, batches: int, batch_size: int):
    """Mean validation loss over `batches` fixed micro-batches, split over the ranks (forward
    only); the same float on every rank. Every rank runs the same number of forwards (a
    forward is collective at stage 3): where `batches` is not a multiple of N, the last round's
    spare ranks run batch 0 again and leave it out of the mean."""
    T = engine.module.cfg.block_size
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    engine.eval()
    rounds = -(-batches // engine.world_size)
    for i in range(engine.rank, rounds * engine.world_size, engine.world_size):
        idx, tgt = corpus.batch(
            split="val",
            seed=seed,
            index=(i if i < batches else 0,),
            batch_size=batch_size,
            seq_len=T,
        )
        _, loss = engine(idx.to(engine.device), tgt.to(engine.device))
        if i < batches:
            total += torch.tensor([float(loss), 1.0], dtype=torch.float64, device=engine.device)
    engine.train()
    if engine.world_size > 1:  # a failure, or a stopped peer, names whom to blame (watchdog)
        launch(dist.all_reduce, total, group=engine.group, async_op=False, rec=None)
    return float(total[0] / total[1])


def build_model(cfg: TrainConfig, world_size: int, device):
    """(model, data-parallel group, MPContext) of this rank: the GPT and the whole world, or
    with mp > 1 this rank's tensor-parallel slice (drawn as the plain GPT's values and cut) and
    its mesh groups."""
    gpt, _ = MODELS[cfg.model]
    if cfg.mp == 1:
        return GPT(gpt, device=device, seed=cfg.seed), None, None
    from ..collectives import CommCounter
    from ..mp import TPGPT, Mesh, MPContext

    g = Mesh(dp=world_size // cfg.mp, mp=cfg.mp).groups()
    ctx = MPContext.of(g.mp_group, counter=CommCounter(), deterministic=cfg.zero.deterministic)
    return TPGPT.build(gpt, ctx, seed=cfg.seed, device=device), g.dp_group, ctx


def master_sha256(engine: ZeroEngine) -> str:
    """sha256 of the full fp32 master, parameters in name order (a collective: every rank);
    with model parallelism the MP slices are joined into the plain GPT's master first."""
    master, _ = engine.gather_state()
    if engine.mp is not None:
        from ..mp import join_states

        ctx = engine.mp.ctx
        parts = gather_objects({k: v.cpu() for k, v in master.items()}, ctx.group)
        master = join_states(parts, engine.module.cfg)
    return hashlib.sha256(
        b"".join(master[k].cpu().numpy().tobytes() for k in sorted(master))
    ).hexdigest()


def run_rank(rank: int, world_size: int, cfg: TrainConfig, corpus: Corpus, device=None):
    """One rank's whole run; rank 0 returns the log record (the others None). A fault loading
    the checkpoint raises ResumeRefused, one mid-run RunFault: one line each (_fault)."""
    at: dict = {"step": None, "saved": None}  # the step running, the last checkpoint (_run's)
    try:
        return _run(rank, world_size, cfg, corpus, device, at)
    except (FloatingPointError, OSError, CheckpointError, ValueError, CollectiveError) as exc:
        fault = _fault(exc, cfg, at, traceback.format_exc())
        if fault is None:
            raise
        raise fault from exc


def _fault(exc: Exception, cfg: TrainConfig, at: dict, detail: str) -> Exception | None:
    """The one-line error of a fault `at` a point of the run, None for one that is no fault of
    the run's (a bug keeps its traceback)."""
    saved, n = at["saved"], at["step"]
    if n is None:  # building the engine, loading the checkpoint
        if saved is None or not isinstance(exc, (CheckpointError, ValueError, OSError)):
            return None
        return ResumeRefused(f"resume from {saved}: {exc}; nothing was run or removed", detail)
    left = f"the last checkpoint, {saved}, is intact" if saved else "no checkpoint was made"
    if isinstance(exc, CollectiveError):  # a rank stopped, died or diverged: the blame line
        return RunFault(f"step {n} of {cfg.steps}: {str(exc).splitlines()[0]}; {left}", detail)
    if isinstance(exc, FloatingPointError):
        return RunFault(
            f"step {n} of {cfg.steps}: non-finite gradient (the loss diverged) with --lr "
            f"{cfg.lr:g}, precision {cfg.zero.precision!r}; {left}; lower --lr, or pass "
            "--nonfinite skip to skip such steps",
            detail,
        )
    if isinstance(exc, (OSError, CheckpointError)):
        return RunFault(f"step {n} of {cfg.steps}: {exc}; {left}", detail)
    return None


def _run(rank: int, world_size: int, cfg: TrainConfig, corpus: Corpus, device, at: dict):
    device = torch.device("cpu") if device is None else device
    gpt, batch_size = MODELS[cfg.model]
    T = gpt.block_size
    model, group, mp = build_model(cfg, world_size, device)
    engine = ZeroEngine(model, cfg.zero_config(world_size), group=group, mp=mp)
    out, lead = Path(cfg.out), rank == 0
    ckpt = out / "ckpt"
    # [Note: bounded manifests] in zero/workloads/history.py: rank 0 keeps the history in an
    # append-only file; a checkpoint holds a constant-size mark of it, not the history itself
    log = HistoryLog(ckpt / HISTORY_FILE) if lead else None
    history: dict = {"train": [], "val": []}
    step_dir = resume_point(cfg)  # checked before the ranks started (claim, check_identity)
    saved: dict = {}
    if step_dir is not None:
        at["saved"] = step_dir
        extra = engine.load(step_dir).extra  # the history's mark travels with the checkpoint
        if lead:
            history = log.restore(extra)
        saved = extra if isinstance(extra, dict) else {}
    elif lead:
        log.start()
        history = log.history
    at["step"] = engine.data_step + 1

    def add(split: str, entry: dict) -> None:
        if lead:
            log.append(split, entry)  # appends to `history` too
        else:
            history[split].append(entry)

    start = engine.data_step
    identity = run_identity(cfg, world_size, corpus.fingerprint)  # RUN_IDENTITY's values
    changes = [*saved.get("run_changes", []), *(
        {"step": start, **c} for c in run_changes(saved.get("run"), identity))]  # fmt: skip
    M = engine.config.micro_batches
    tokens_per_step = M * batch_size * T
    config = {
        **asdict(cfg),
        "world_size": world_size,
        "micro_batches": M,
        "batch_size": batch_size,
        "seq_len": T,
        "gpt": asdict(gpt),
        "num_params": GPT(gpt, device="meta").num_params(),  # the whole model's, at any mp
        "backend": dist.get_backend(engine.group),
        "launcher": "torchrun" if under_torchrun() else "spawn",
        "corpus": corpus.fingerprint,
        "run_changes": changes,  # --allow-changed-run: each resume's changes, at its step
    }
    if lead:
        print(
            f"GPT {cfg.model}: Ψ = {config['num_params']:,}; stage {cfg.zero.stage}, "
            f"N = {world_size}{f' (N_d = {engine.world_size}, N_m = {cfg.mp})' if mp else ''}, "
            f"M = {M}, {cfg.zero.precision}; corpus {corpus.source}: "
            f"{corpus.fingerprint['files']} files, {corpus.fingerprint['bytes']:,} bytes; "
            f"steps {start}..{cfg.steps}",
            flush=True,
        )
    progress = Progress(total=cfg.steps, initial=start, show=lead, every=cfg.log_every)
    memory: list[int] = []
    clock = [time.perf_counter()]

    def microbatch(step: int, j: int):
        x, y = corpus.batch(
            split="train", seed=cfg.seed, index=(step, j), batch_size=batch_size, seq_len=T
        )
        return x.to(device), y.to(device)

    def record(final_hash=None) -> dict:
        result = {"history": history, "data_step": engine.data_step, "memory_bytes": memory}
        if final_hash is not None:
            result["final_master_sha256"] = final_hash
        return make_record(config=config, result=result, kind=KIND)

    def save_log(final_hash=None) -> dict:
        rec = record(final_hash)
        if lead:
            write_json(out / "train_log.json", rec)
            title = f"GPT {cfg.model} on {Path(corpus.source).name}, stage {cfg.zero.stage}, "
            title += f"N={world_size}"
            plot_losses(history, out / "loss_curve.png", title=title)
        return rec

    def on_step(step: int, res: StepResult) -> None:
        seconds = time.perf_counter() - clock[0]
        done = at["step"] = step + 1
        add(
            "train",
            {
                "step": done,
                "loss": res.loss,
                "norm": res.norm,
                "skipped": res.skipped,
                "tokens_per_s": tokens_per_step / seconds,
            },
        )
        if done % cfg.log_every == 0 or done == start + 1:
            memory[:] = [0] * world_size
            mine = sum(engine.memory_report().values())
            memory[:] = gather_objects(mine, dist.group.WORLD)  # every rank, MP ones too
        mem = "/".join(f"{b / 2**20:.1f}" for b in memory)
        progress.step(
            step,
            {
                "loss": f"{res.loss:.3f}",
                "tok/s": f"{tokens_per_step / seconds:,.0f}",
                "MiB/rank": mem,
            },
        )
        last = done == cfg.steps
        if last or (cfg.eval_every and done % cfg.eval_every == 0):
            val = evaluate(
                engine, corpus, seed=cfg.seed, batches=cfg.eval_batches, batch_size=batch_size
            )
            add("val", {"step": done, "loss": val})
            progress.say(f"step {done}: train loss {res.loss:.4f}, validation loss {val:.4f}")
            save_log()
        if last or (cfg.ckpt_every and done % cfg.ckpt_every == 0):
            mark = log.mark() if lead else None
            extra = {"history_log": mark, "run": identity, "run_changes": changes}
            at["saved"] = engine.save(ckpt, keep_last=2, extra=extra)
        at["step"] = min(done + 1, cfg.steps)  # after the last: its final writes
        clock[0] = time.perf_counter()

    if start == 0 and not history["val"]:  # where the curve starts: about ln 256 nats
        val = evaluate(
            engine, corpus, seed=cfg.seed, batches=cfg.eval_batches, batch_size=batch_size
        )
        add("val", {"step": 0, "loss": val})
    if start < cfg.steps:
        train_steps(engine, microbatch, cfg.steps - start, start_step=start, on_step=on_step)
    progress.close()
    if lead:
        log.close()
    final = save_log(master_sha256(engine))
    return final if lead else None


# ---------------------------------------------------------------------------------------------
# The command line


FAULT_LINE = re.compile(r"^(?:[\w.]+\.)?(RunFault|ResumeRefused): (.*)$", re.M)
"""The last line of a rank's traceback that carries a fault (a spawned rank sends only text)."""


def _latest(cfg: TrainConfig) -> Path | None:
    try:
        return checkpoint.resolve(Path(cfg.out) / "ckpt")
    except CheckpointError:
        return None


def _tidy(cfg: TrainConfig, step_dir: Path | None, before: Path | None) -> None:
    """After a failed run, its ranks stopped: the loss history agrees with the checkpoint left
    (history.after_failure: removed if this fresh run committed none), and OUT/ckpt goes if that
    leaves it empty."""
    ckpt, now = Path(cfg.out) / "ckpt", _latest(cfg)
    with contextlib.suppress(OSError, CheckpointError):
        extra = checkpoint.read_manifest(now)["extra"] if now is not None else None
        after_failure(ckpt / HISTORY_FILE, extra, fresh=step_dir is None and now == before)
        ckpt.rmdir()  # only if empty


def _left(cfg: TrainConfig) -> str:
    now = _latest(cfg)
    return f"the last checkpoint, {now}, is intact" if now else "no checkpoint was made"


def _spawn(cfg: TrainConfig, step_dir: Path | None, corpus: Corpus):
    before = _latest(cfg)
    try:
        return spawn(run_rank, cfg.nproc, cfg, corpus, timeout_s=cfg.timeout_s, deadline_s=None)
    except Exception as exc:
        found = FAULT_LINE.findall(exc.child_traceback) if isinstance(exc, RankError) else []
        if not found or found[-1][0] != "ResumeRefused":  # that one ran nothing: nothing to tidy
            _tidy(cfg, step_dir, before)
        if not found:
            line = next((x.strip() for x in str(exc).splitlines() if BLAME in x), None)
            if line is None:  # a bug in a rank: its traceback
                raise
            raise RunFault(f"{line}; {_left(cfg)}", str(exc)) from None  # a rank that died
        kind, line = found[-1]
        raise (RunFault if kind == "RunFault" else ResumeRefused)(line, str(exc)) from None


def _under_torchrun(cfg: TrainConfig):
    rank, world, device = init_from_env(timeout_s=cfg.timeout_s)
    if cfg.nproc not in (None, world):
        raise ValueError(f"nproc={cfg.nproc} is not allowed: torchrun launched {world} ranks")
    if world % cfg.mp or (cfg.micro_batches or world) % (world // cfg.mp):
        raise ValueError(
            f"micro_batches={cfg.micro_batches}, mp={cfg.mp} are not allowed: expected mp "
            f"dividing the launched world size {world} and a positive multiple of N_d"
        )
    held, step_dir, before, corpus, left = None, None, None, None, False
    try:
        error = None
        if rank == 0:  # one lock per run: the first rank's
            try:
                held, step_dir = claim(cfg)
                before = _latest(cfg)
                corpus = load_corpus(cfg.data, val_fraction=cfg.val_fraction)
                check_identity(cfg, step_dir, corpus.fingerprint, world)
            except ValueError as exc:
                error = str(exc)
        box = [error]
        dist.broadcast_object_list(box, src=0)  # every rank stops if rank 0 was refused
        if box[0] is not None:
            raise ValueError(box[0])
        if corpus is None:  # rank 0 loaded it already
            corpus = load_corpus(cfg.data, val_fraction=cfg.val_fraction)
        try:
            record = run_rank(rank, world, cfg, corpus, device)
        except Exception as exc:
            if held is not None and not isinstance(exc, ResumeRefused):
                _tidy(cfg, step_dir, before)
            raise
        left = leave_world()  # a barrier, then the group goes: no SIGABRT at exit
        return record
    finally:
        if held is not None:
            lock.release(held)
        if not left and dist.is_initialized() and not stranded():  # else it would wait
            dist.destroy_process_group()


def main(argv=None) -> dict | None:
    """Run the CLI; returns rank 0's log record (None on the other torchrun ranks). A fault
    raises RunFault or ResumeRefused, one line (the traceback in .detail: shown with --debug)."""
    cfg = parse(argv)
    # before any work: an unwritable --out would otherwise be found after training
    cli.check_writable("out", cfg.out)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ValueError(
            f"data={cfg.data!r}: no such file or folder; allowed is a text file or folder"
        )
    made = not os.path.lexists(cfg.out) and os.environ.get("RANK", "0") == "0"
    try:
        if under_torchrun():
            return _under_torchrun(cfg)
        cfg = replace(cfg, nproc=cfg.nproc or 2)  # validates micro_batches against it
        held, step_dir = claim(cfg)
        try:
            corpus = load_corpus(cfg.data, val_fraction=cfg.val_fraction)  # the ranks share it
            check_identity(cfg, step_dir, corpus.fingerprint, cfg.nproc)
            return _spawn(cfg, step_dir, corpus)[0]
        finally:
            lock.release(held)
    except (RunFault, ResumeRefused) as exc:
        if cfg.debug:
            print(exc.detail, file=sys.stderr, flush=True)
        raise
    finally:
        if made:  # an OUT this run made and left empty (a failure before any output) goes
            with contextlib.suppress(OSError):
                os.rmdir(cfg.out)


def cli_main(argv=None) -> int:
    """The command line: main, a RunFault as one line and exit status 1 (bad input and a
    refused resume: cli.run's one line and exit status 2)."""
    try:
        main(argv)
    except RunFault as exc:
        # on a line of its own: rank 0's progress bar may have left one unfinished
        print(f"\n{PROG}: error: {exc}", file=sys.stderr)
        cli.record_for_torchrun(exc)  # torchrun's summary names the rank the watchdog blames
        return 1
    return 0


if __name__ == "__main__":
    cli.run(cli_main, "python -m zero.workloads.train")
