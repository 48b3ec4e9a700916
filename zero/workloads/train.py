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
OUT: OUT/run.lock (zero/checkpoint/lock.py) refuses a second one before it does any work.

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

import hashlib
import io
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..checkpoint import lock
from ..common import cli
from ..common.results import make_record, write_atomic, write_json
from ..engine import StepResult, ZeroEngine
from ..loop import train_steps
from ..ranks.launch import init_from_env, leave_world, under_torchrun
from ..ranks.local import spawn
from ..ranks.watchdog import guard
from .data import Corpus, load_corpus
from .history import FILE as HISTORY_FILE
from .history import HistoryLog
from .models import GPT
from .train_config import MODELS, TrainConfig, parse

KIND = "train.run"
"""The results-record kind of a training run's log."""


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
    with guard(None, engine.group):  # a failure names whom to blame (zero/ranks/watchdog.py)
        dist.all_reduce(total, group=engine.group)
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
        parts: list = [None] * ctx.size
        with guard(None, ctx.group):
            dist.all_gather_object(parts, {k: v.cpu() for k, v in master.items()}, group=ctx.group)
        master = join_states(parts, engine.module.cfg)
    return hashlib.sha256(
        b"".join(master[k].cpu().numpy().tobytes() for k in sorted(master))
    ).hexdigest()


class _Progress:
    """Rank 0's display: a tqdm bar when tqdm is installed (it is optional), else plain lines."""

    def __init__(self, *, total: int, initial: int, show: bool, every: int):
        self.show, self.every, self.bar = show, every, None
        if show:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def step(self, step: int, fields: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif self.show and (step + 1) % self.every == 0:
            self.say(f"step {step + 1}: " + ", ".join(f"{k} {v}" for k, v in fields.items()))

    def say(self, text: str) -> None:
        if self.show:
            (self.bar.write if self.bar is not None else print)(text)
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(history: dict, path: Path, *, title: str) -> None:
    """The loss curve (train per step, validation at each evaluation) as a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(
        [h["step"] for h in history["train"]],
        [h["loss"] for h in history["train"]],
        lw=0.8,
        label="train (mean over the step's micro-batches)",
    )
    ax.plot(
        [h["step"] for h in history["val"]],
        [h["loss"] for h in history["val"]],
        "o-",
        label="validation",
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    write_atomic(path, buf.getvalue())


def resume_point(cfg: TrainConfig) -> Path | None:
    """The step directory the run continues from, None for a fresh start. With --resume (or
    --resume-if-present and a non-empty OUT/ckpt) a checkpoint that is missing, incomplete or
    invalid is a ValueError naming the directory and what is wrong: never a silent restart."""
    ckpt = Path(cfg.out) / "ckpt"
    if not cfg.resume and not cfg.resume_if_present:
        return None
    # the loss history (zero/workloads/history.py) is no checkpoint: rank 0 may have started it
    # already
    saved = [p for p in ckpt.iterdir() if p.name != HISTORY_FILE] if ckpt.is_dir() else []
    if cfg.resume_if_present and not saved:
        return None
    field = "resume" if cfg.resume else "resume_if_present"
    try:
        step_dir = checkpoint.resolve(ckpt)
        checkpoint.read_manifest(step_dir)
    except checkpoint.CheckpointError as exc:
        raise ValueError(
            f"{field}=True: no valid checkpoint to continue from in {ckpt} ({exc}); nothing was "
            "run or removed (without --resume a run starts afresh and keeps these files)"
        ) from None
    return step_dir


def _claim(cfg: TrainConfig) -> Path:
    """Before any work: lock OUT, check what --resume would load. Returns the lock's path."""
    held = lock.acquire(cfg.out)
    latest = Path(cfg.out) / "ckpt" / "latest"
    try:
        resuming = resume_point(cfg) is not None
        if os.path.lexists(latest) and (latest.is_symlink() or not latest.is_file()):
            raise ValueError(  # else the run would fail at its first checkpoint, work lost
                f"out={cfg.out!r}: {latest} is not a regular file, so no checkpoint could be "
                "committed there; remove it, or give another --out"
            )
        if not resuming and latest.exists():
            print(
                f"note: {Path(cfg.out) / 'ckpt'} holds an earlier run's checkpoints; they are "
                "kept (a run prunes only its own), and `latest` will name this run's",
                file=sys.stderr,
            )
    except BaseException:
        lock.release(held)
        raise
    return held


def run_rank(rank: int, world_size: int, cfg: TrainConfig, corpus: Corpus, device=None):
    """One rank's whole run; rank 0 returns the log record (the others None)."""
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
    step_dir = resume_point(cfg)  # checked before the ranks started (_claim)
    if step_dir is not None:
        extra = engine.load(step_dir).extra  # the history's mark travels with the checkpoint
        if lead:
            history = log.restore(extra)
    elif lead:
        log.start()
        history = log.history

    def add(split: str, entry: dict) -> None:
        if lead:
            log.append(split, entry)  # appends to `history` too
        else:
            history[split].append(entry)

    start = engine.data_step
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
    progress = _Progress(total=cfg.steps, initial=start, show=lead, every=cfg.log_every)
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
        done = step + 1
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
            every: list = [None] * world_size
            with guard(None, dist.group.WORLD):  # every rank of the world, MP ones too
                dist.all_gather_object(every, mine)
            memory[:] = every
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
            engine.save(ckpt, keep_last=2, extra={"history_log": log.mark() if lead else None})
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


def main(argv=None) -> dict | None:
    """Run the CLI; returns rank 0's log record (None on the other torchrun ranks)."""
    cfg = parse(argv)
    # before any work: an unwritable --out would otherwise be found after training
    cli.check_writable("out", cfg.out)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ValueError(
            f"data={cfg.data!r}: no such file or folder; allowed is a text file or folder"
        )
    if under_torchrun():
        rank, world, device = init_from_env(timeout_s=cfg.timeout_s)
        if cfg.nproc not in (None, world):
            raise ValueError(f"nproc={cfg.nproc} is not allowed: torchrun launched {world} ranks")
        if world % cfg.mp or (cfg.micro_batches or world) % (world // cfg.mp):
            raise ValueError(
                f"micro_batches={cfg.micro_batches}, mp={cfg.mp} are not allowed: expected mp "
                f"dividing the launched world size {world} and a positive multiple of N_d"
            )
        held, left = None, False
        try:
            error = None
            if rank == 0:  # one lock per run: the first rank's
                try:
                    held = _claim(cfg)
                except ValueError as exc:
                    error = str(exc)
            box = [error]
            dist.broadcast_object_list(box, src=0)  # every rank stops if rank 0 was refused
            if box[0] is not None:
                raise ValueError(box[0])
            record = run_rank(
                rank, world, cfg, load_corpus(cfg.data, val_fraction=cfg.val_fraction), device
            )
            left = leave_world()  # a barrier, then the group goes: no SIGABRT at exit
            return record
        finally:
            if held is not None:
                lock.release(held)
            if not left and dist.is_initialized():
                dist.destroy_process_group()
    cfg = replace(cfg, nproc=cfg.nproc or 2)  # validates micro_batches against it
    held = _claim(cfg)
    try:
        corpus = load_corpus(cfg.data, val_fraction=cfg.val_fraction)  # forked ranks share it
        return spawn(run_rank, cfg.nproc, cfg, corpus, timeout_s=cfg.timeout_s, deadline_s=None)[0]
    finally:
        lock.release(held)


if __name__ == "__main__":
    cli.run(main, "python -m zero.workloads.train")
