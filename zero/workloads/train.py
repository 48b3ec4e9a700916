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
([Note: leftover temp files] and [Note: crash leftovers] in zero/checkpoint/commit.py). A
checkpoint records the run's identity (train_config.RUN_IDENTITY: seed, data, model, M,
precision, ...), and a resume that changes any of it is refused by name unless
--allow-changed-run.

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
from .history import HistoryLog, Progress, latest_checkpoint, plot_losses, tidy_after_failure
from .models import GPT
from .train_config import (
    MODELS,
    TrainConfig,
    build_model,
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
    at: dict = {"step": None, "saved": None}  # the step running, the last checkpoint (_Run's)
    try:
        return _Run(rank, world_size, cfg, corpus, device, at).run()
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
    left = _left(saved)
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


def _left(saved: Path | None) -> str:
    """What a failed run leaves, for its line: `saved`, the last checkpoint, or none."""
    return f"the last checkpoint, {saved}, is intact" if saved else "no checkpoint was made"


class _Run:
    """One rank's run, in named steps: the engine built and the checkpoint --resume names
    restored (__init__, _restore), then `run`: the step-0 validation loss, the steps (on_step:
    _log_step, _validate, a checkpoint where due) and the final record (_save_log). `at` is
    run_rank's: the step running and the last checkpoint, which a fault's line names."""

    def __init__(self, rank: int, world_size: int, cfg: TrainConfig, corpus: Corpus, device, at):
        self.cfg, self.corpus, self.world_size, self.at = cfg, corpus, world_size, at
        self.device = torch.device("cpu") if device is None else device
        self.gpt, self.batch_size = MODELS[cfg.model]
        self.T = self.gpt.block_size
        model, group, self.mp = build_model(cfg, world_size, self.device)
        self.engine = ZeroEngine(model, cfg.zero_config(world_size), group=group, mp=self.mp)
        self.out, self.lead = Path(cfg.out), rank == 0
        self.ckpt = self.out / "ckpt"
        # [Note: bounded manifests] in zero/workloads/history.py: rank 0 keeps the history in an
        # append-only file; a checkpoint holds a constant-size mark of it, not the history itself
        self.log = HistoryLog(self.ckpt / HISTORY_FILE) if self.lead else None
        saved = self._restore()
        self.start = self.engine.data_step
        self.identity = run_identity(cfg, world_size, corpus.fingerprint)  # RUN_IDENTITY's
        new = run_changes(saved.get("run"), self.identity)
        self.changes = [*saved.get("run_changes", []), *({"step": self.start, **c} for c in new)]
        self.M = self.engine.config.micro_batches
        self.tokens_per_step = self.M * self.batch_size * self.T
        self.config = self._config()
        self.memory: list[int] = []  # each rank's resident model-state bytes, as last gathered
        self.clock = 0.0  # when the step running began

    def _restore(self) -> dict:
        """The history so far and the checkpoint's extra ({} for a fresh run): the checkpoint
        --resume names is loaded (the history's mark travels with it), or the history starts."""
        self.history: dict = {"train": [], "val": []}
        step_dir = resume_point(self.cfg)  # checked before the ranks started (claim, ...)
        saved: dict = {}
        if step_dir is not None:
            self.at["saved"] = step_dir
            extra = self.engine.load(step_dir).extra
            if self.lead:
                self.history = self.log.restore(extra)
            saved = extra if isinstance(extra, dict) else {}
        elif self.lead:
            self.log.start()
            self.history = self.log.history
        self.at["step"] = self.engine.data_step + 1
        return saved

    def _config(self) -> dict:
        """The log record's configuration: the command line's, and what the run derived."""
        return {
            **asdict(self.cfg),
            "world_size": self.world_size,
            "micro_batches": self.M,
            "batch_size": self.batch_size,
            "seq_len": self.T,
            "gpt": asdict(self.gpt),
            "num_params": GPT(self.gpt, device="meta").num_params(),  # the whole model's
            "backend": dist.get_backend(self.engine.group),
            "launcher": "torchrun" if under_torchrun() else "spawn",
            "corpus": self.corpus.fingerprint,
            "run_changes": self.changes,  # --allow-changed-run: each resume's, at its step
        }

    def run(self) -> dict | None:
        """Train from the step restored to --steps; rank 0's final log record (else None)."""
        cfg, fp = self.cfg, self.corpus.fingerprint
        mesh = f" (N_d = {self.engine.world_size}, N_m = {cfg.mp})" if self.mp else ""
        if self.lead:
            print(
                f"GPT {cfg.model}: Ψ = {self.config['num_params']:,}; stage {cfg.zero.stage}, "
                f"N = {self.world_size}{mesh}, M = {self.M}, {cfg.zero.precision}; corpus "
                f"{self.corpus.source}: {fp['files']} files, {fp['bytes']:,} bytes; "
                f"steps {self.start}..{cfg.steps}",
                flush=True,
            )
        show, every = self.lead, cfg.log_every
        self.progress = Progress(total=cfg.steps, initial=self.start, show=show, every=every)
        self.clock = time.perf_counter()
        if self.start == 0 and not self.history["val"]:  # the curve starts about ln 256 nats
            self._add("val", {"step": 0, "loss": self._validation_loss()})
        if self.start < cfg.steps:
            left = cfg.steps - self.start
            train_steps(self.engine, self._microbatch, left, start_step=self.start,
                        on_step=self.on_step)  # fmt: skip
        self.progress.close()
        if self.lead:
            self.log.close()
        final = self._save_log(master_sha256(self.engine))
        return final if self.lead else None

    def _microbatch(self, step: int, j: int):
        x, y = self.corpus.batch(split="train", seed=self.cfg.seed, index=(step, j),
                                 batch_size=self.batch_size, seq_len=self.T)  # fmt: skip
        return x.to(self.device), y.to(self.device)

    def on_step(self, step: int, res: StepResult) -> None:
        """After step `step`: its entry and progress line, then the validation loss and a
        checkpoint where they fall due (and after the last step)."""
        cfg = self.cfg
        seconds = time.perf_counter() - self.clock
        done = self.at["step"] = step + 1
        self._log_step(step, res, seconds)
        last = done == cfg.steps
        if last or (cfg.eval_every and done % cfg.eval_every == 0):
            self._validate(done, res.loss)
        if last or (cfg.ckpt_every and done % cfg.ckpt_every == 0):
            mark = self.log.mark() if self.lead else None
            extra = {"history_log": mark, "run": self.identity, "run_changes": self.changes}
            self.at["saved"] = self.engine.save(self.ckpt, keep_last=2, extra=extra)
        self.at["step"] = min(done + 1, cfg.steps)  # after the last: its final writes
        self.clock = time.perf_counter()

    def _log_step(self, step: int, res: StepResult, seconds: float) -> None:
        """The step's history entry and progress line; every --log-every steps (and after the
        first) each rank's resident model-state bytes are gathered, a collective."""
        done, rate = step + 1, self.tokens_per_step / seconds
        entry = {"step": done, "loss": res.loss, "norm": res.norm, "skipped": res.skipped}
        self._add("train", {**entry, "tokens_per_s": rate})
        if done % self.cfg.log_every == 0 or done == self.start + 1:
            self.memory[:] = [0] * self.world_size
            mine = sum(self.engine.memory_report().values())
            self.memory[:] = gather_objects(mine, dist.group.WORLD)  # every rank, MP ones too
        mem = "/".join(f"{b / 2**20:.1f}" for b in self.memory)
        shown = {"loss": f"{res.loss:.3f}", "tok/s": f"{rate:,.0f}", "MiB/rank": mem}
        self.progress.step(step, shown)

    def _validate(self, done: int, loss: float) -> None:
        val = self._validation_loss()
        self._add("val", {"step": done, "loss": val})
        self.progress.say(f"step {done}: train loss {loss:.4f}, validation loss {val:.4f}")
        self._save_log()

    @torch.no_grad()
    def _validation_loss(self) -> float:
        """Mean validation loss over --eval-batches fixed micro-batches, split over the ranks
        (forward only); the same float on every rank. Every rank runs the same number of
        forwards (a forward is collective at stage 3): where the batches are not a multiple of
        N, the last round's spare ranks run batch 0 again and leave it out of the mean."""
        engine, batches = self.engine, self.cfg.eval_batches
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        engine.eval()
        rounds = -(-batches // engine.world_size)
        for i in range(engine.rank, rounds * engine.world_size, engine.world_size):
            idx, tgt = self.corpus.batch(split="val", seed=self.cfg.seed,
                                         index=(i if i < batches else 0,),
                                         batch_size=self.batch_size, seq_len=self.T)  # fmt: skip
            _, loss = engine(idx.to(engine.device), tgt.to(engine.device))
            if i < batches:
                total += torch.tensor([float(loss), 1.0], dtype=torch.float64, device=engine.device)
        engine.train()
        if engine.world_size > 1:  # a failure, or a stopped peer, names whom to blame (watchdog)
            launch(dist.all_reduce, total, group=engine.group, async_op=False, rec=None)
        return float(total[0] / total[1])

    def _add(self, split: str, entry: dict) -> None:
        if self.lead:
            self.log.append(split, entry)  # appends to self.history too
        else:
            self.history[split].append(entry)

    def _save_log(self, final_hash: str | None = None) -> dict:
        """The log record; rank 0 writes it to OUT/train_log.json and draws OUT/loss_curve.png."""
        result = {"history": self.history, "data_step": self.engine.data_step}
        result["memory_bytes"] = self.memory
        if final_hash is not None:
            result["final_master_sha256"] = final_hash
        rec = make_record(config=self.config, result=result, kind=KIND)
        if self.lead:
            write_json(self.out / "train_log.json", rec)
            title = f"GPT {self.cfg.model} on {Path(self.corpus.source).name}, stage "
            title += f"{self.cfg.zero.stage}, N={self.world_size}"
            plot_losses(self.history, self.out / "loss_curve.png", title=title)
        return rec


# ---------------------------------------------------------------------------------------------
# The command line


FAULT_LINE = re.compile(r"^(?:[\w.]+\.)?(RunFault|ResumeRefused): (.*)$", re.M)
"""The last line of a rank's traceback that carries a fault (a spawned rank sends only text)."""
BAD_INPUT = re.compile(r"(?:^|\n)(?:[\w.]+\.)?ValueError: ([^\n]*)$")
"""A rank's traceback that ends in a ValueError: input the rank refused (the project's rule)."""


def _spawn(cfg: TrainConfig, step_dir: Path | None, corpus: Corpus):
    ckpt = Path(cfg.out) / "ckpt"
    before = latest_checkpoint(ckpt)
    try:
        return spawn(run_rank, cfg.nproc, cfg, corpus, timeout_s=cfg.timeout_s, deadline_s=None)
    except Exception as exc:
        found = FAULT_LINE.findall(exc.child_traceback) if isinstance(exc, RankError) else []
        if not found or found[-1][0] != "ResumeRefused":  # that one ran nothing: nothing to tidy
            tidy_after_failure(ckpt, step_dir, before)
        if not found:
            bad = (
                BAD_INPUT.search(exc.child_traceback.strip())
                if isinstance(exc, RankError)
                else None
            )
            if bad:  # a rank refused its input (an offload_dir without room): one line, exit 2
                raise ValueError(bad.group(1)) from None
            line = next((x.strip() for x in str(exc).splitlines() if BLAME in x), None)
            if line is None:  # a bug in a rank: its traceback
                raise
            left = _left(latest_checkpoint(ckpt))
            raise RunFault(f"{line}; {left}", str(exc)) from None  # a rank that died
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
                before = latest_checkpoint(Path(cfg.out) / "ckpt")
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
                tidy_after_failure(Path(cfg.out) / "ckpt", step_dir, before)
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
