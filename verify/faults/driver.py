"""A small training run that can make one rank diverge, stall, leak or run long.

    python -m verify.faults.driver --diverge extra_backward --rank 1 --at-step 3 --stage 2

Local ranks (zero.ranks.local.spawn; --nproc, 2 by default) train the GPT of the README through the
public API (ZeroEngine, forward, backward, step) for --steps steps; at --at-step, rank --rank
does what --diverge says and the other ranks go on as normal:

    extra_backward  one forward and backward more than the step's micro-batches
    skipped_step    step() not called (its forwards and backwards run): the next forward
                    is one the step does not allow
    skipped_iteration  a whole iteration skipped (no forward, backward or step): the rank then
                    trains on later data and ends one step early; at N = 2 that is symmetric
                    with the other rank training one step more, so the suite runs it at N = 3
    save_alone      engine.save(...) by this rank alone
    load_alone      engine.load(...) by this rank alone (of a checkpoint all saved at step 0)
    early_exit      return from the run
    unit_order      (from the start) the engine built with its units in reverse order
    micro_batches   (from the start) twice the micro-batches per step
    slow            no divergence: the rank computes for --slow-s seconds before the step's
                    forwards (matrix products, its heartbeat thread beating on), then goes on
    none            nothing: the undisturbed run

The right outcome of every divergence is an error naming the diverging rank within --timeout
(zero.ranks.watchdog's blame line); of a slow rank, the undisturbed run's bits and no blame. On
success it prints one line, `ok SHA` (the master's sha256 on rank 0), `slow {...}` after it with
the seconds the slow rank computed, and with --rss each rank's resident set size after every step
as JSON (`rss [...]`).
--leak-bytes keeps that many bytes per step alive on every rank: a planted leak, so that the
suite's leak check is shown to fail on one."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tempfile
from pathlib import Path

DIVERGENCES = ("none", "extra_backward", "skipped_step", "skipped_iteration", "save_alone",
               "load_alone",
               "early_exit", "unit_order", "micro_batches", "slow")  # fmt: skip
AT_START = ("unit_order", "micro_batches")


def compute_for(seconds: float) -> float:
    """Matrix products for `seconds` (no random numbers drawn: the run's bits stay its own);
    returns the seconds spent."""
    import time

    import torch

    start = time.monotonic()
    a = torch.full((256, 256), 1 / 256)
    while time.monotonic() - start < seconds:
        a = torch.mm(a, a).clamp_(-1, 1)
    return time.monotonic() - start


def _rss_kib() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1))


def worker(rank: int, n: int, args) -> dict:
    import torch

    from reference import Hyper
    from zero import ZeroConfig, ZeroEngine
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=32), seed=0)
    me = rank == args.rank
    units = tuple(model.unit_names())
    m = 2 * n
    if me and args.diverge == "unit_order":
        units = units[::-1]
    if me and args.diverge == "micro_batches":
        m = 4 * n
    config = ZeroConfig(
        stage=args.stage, deterministic=True, optimizer="adamw", groups=(Hyper(lr=3e-3),),
        micro_batches=m, units=units,
    )  # fmt: skip
    engine = ZeroEngine(model, config)

    def forward_backward(step, j):
        x, y = gpt_microbatches(model.cfg, seed=0, data_step=step, count=j + 1, batch_size=4)[j]
        _, loss = engine(x, y)
        engine.backward(loss)

    ckpt = Path(args.dir) / "ckpt"
    if args.diverge == "load_alone":
        engine.save(ckpt)  # every rank: a checkpoint for the lone load to read
    keep, rss, slow = [], [], None
    per_rank = m // n
    for step in range(args.steps):
        if me and step == args.at_step:
            if args.diverge == "slow":
                slow = {"rank": rank, "step": step, "seconds": round(compute_for(args.slow_s), 2)}
            if args.diverge == "early_exit":
                return {"rank": rank, "exited": step}
            if args.diverge == "skipped_iteration":
                continue
            if args.diverge == "save_alone":
                engine.save(Path(args.dir) / "alone")
            if args.diverge == "load_alone":
                engine.load(ckpt)
        for k in range(per_rank):
            forward_backward(step, k * n + rank)
        if me and step == args.at_step and args.diverge == "extra_backward":
            forward_backward(step, rank)
        if not (me and step == args.at_step and args.diverge == "skipped_step"):
            engine.step()
        if args.leak_bytes:
            keep.append(bytearray(b"x" * args.leak_bytes))  # touched: resident
        if args.rss:
            rss.append(_rss_kib())
    master, _ = engine.gather_state()
    sha = hashlib.sha256(b"".join(master[k].numpy().tobytes() for k in sorted(master)))
    del torch
    return {"rank": rank, "sha": sha.hexdigest(), "rss": rss, "slow": slow}


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m verify.faults.driver", description=__doc__)
    p.add_argument("--diverge", choices=DIVERGENCES, default="none")
    p.add_argument("--rank", type=int, default=1, help="the rank that diverges")
    p.add_argument("--at-step", type=int, default=2, help="the step at which it diverges")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=15.0, help="seconds (--timeout of a run)")
    p.add_argument("--rss", action="store_true", help="report each rank's RSS after each step")
    p.add_argument("--leak-bytes", type=int, default=0, help="a planted leak per step and rank")
    p.add_argument("--slow-s", type=float, default=0.0, help="seconds a slow rank computes")
    args = p.parse_args(argv)
    if not 0 <= args.slow_s < args.timeout:  # nan fails too
        raise ValueError(f"slow_s={args.slow_s} is not allowed: expected 0 <= slow_s < timeout")
    for name, low in (("steps", 1), ("nproc", 1), ("at_step", 0), ("leak_bytes", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"{name}={getattr(args, name)} is not allowed: expected >= {low}")
    if not 0 <= args.rank < args.nproc:
        raise ValueError(f"rank={args.rank} is not allowed: expected 0..{args.nproc - 1}")
    return args


def main(argv=None) -> int:
    from zero.ranks.local import spawn

    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="fault-driver-") as tmp:
        args.dir = tmp
        # --timeout is each collective's (the watchdog then names the rank); the whole run's
        # limit sits well above it, so that the watchdog, not the launcher's limit, ends it
        results = spawn(
            worker, args.nproc, args, timeout_s=args.timeout, deadline_s=2 * args.timeout + 60
        )
    shas = {r.get("sha") for r in results}
    if len(shas) != 1:  # ranks that disagree and still finished: the worst outcome
        print(f"ranks disagree: {[r.get('sha', r) for r in results]}")
        return 3
    print(f"ok {results[0]['sha']}")
    for r in results:
        if r.get("slow"):
            print("slow " + json.dumps(r["slow"]))
    if args.rss:
        print("rss " + json.dumps([r["rss"] for r in results]))
    return 0


if __name__ == "__main__":
    from zero.common import cli

    cli.run(main, "python -m verify.faults.driver")
