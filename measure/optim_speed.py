"""python -m measure.optim_speed: time one deterministic AdamW step on one fp32 shard, the kernel
before [Note: in-place blocks] (zero/optim/update.py) beside the torch ops in blocks, the compiled
loop (zero/optim/native.py, used where it builds), and fast mode.

    python -m measure.optim_speed --numel 3716608 --repeats 20 --threads 1

A micro-benchmark, not a test: it prints milliseconds per step (the median over repeats, and the
spread) and checks that every deterministic variant leaves the same bits. "previous" is the kernel
as it was before: blocks of 64K elements whose temporaries are allocated per block and whose sqrt
allocates two more. "blocks 2^k" is the torch-op kernel with BLOCK = 2^k (the one used without a C
compiler is marked); "compiled loop" the one-pass loop. "fused" is fast mode (torch's fused AdamW,
not bitwise) for scale. Timings on a shared machine are noisy: run it on a quiet one."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from reference.optim import Hyper
from zero.optim import native as optim_native
from zero.optim import update as optim


def _previous(hp: Hyper, t: int, p, g, m, v) -> None:
    """The deterministic AdamW as it was: 64K blocks, temporaries allocated per block."""
    s = optim._scalars("adamw", hp, t)
    for lo in range(0, p.numel(), 1 << 16):
        sl = slice(lo, lo + (1 << 16))
        pb, gb, mb, vb = p[sl], g[sl], m[sl], v[sl]
        pb.mul_(s["decay"])
        tmp = gb * s["one_minus_b1"]
        mb.mul_(s["b1"]).add_(tmp)
        torch.mul(gb, gb, out=tmp)
        vb.mul_(s["b2"]).add_(tmp.mul_(s["one_minus_b2"]))
        d = vb.double().sqrt_().float().mul_(s["inv_sqrt_bc2"]).add_(s["eps"])
        pb.sub_(torch.div(mb, d, out=d).mul_(s["step_size"]))


def _current(block: int, native: bool = False):
    def step(hp, t, p, g, m, v):
        saved = optim.BLOCK, optim_native.ENABLED
        optim.BLOCK, optim_native.ENABLED = block, native
        try:
            optim.deterministic_step("adamw", hp, t, p, g, {"exp_avg": m, "exp_avg_sq": v})
        finally:
            optim.BLOCK, optim_native.ENABLED = saved

    return step


def _fused(hp, t, p, g, m, v):
    optim.fast_step("adamw", hp, t, [p], [g], [{"exp_avg": m, "exp_avg_sq": v}])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        "python -m measure.optim_speed", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--numel", type=int, default=3_716_608, help="shard elements (anchor's Ψ)")
    ap.add_argument("--repeats", type=int, default=20, help="timed steps per variant, interleaved")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the bench's: 1)")
    args = ap.parse_args(argv)
    for name in ("numel", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"{name}={getattr(args, name)!r}: allowed are integers >= 1")
    torch.set_num_threads(args.threads)
    hp = Hyper(lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(args.numel, generator=gen) for _ in range(2)]
    start += [torch.randn(args.numel, generator=gen), torch.rand(args.numel, generator=gen)]
    variants = {"previous (64K, allocating)": _previous}
    for k in (14, 15, 16, 17, 18, 19, 20, 22):
        mark = " (torch ops)" if 1 << k == optim.BLOCK else ""
        variants[f"blocks 2^{k}{mark}"] = _current(1 << k)
    if optim_native.available():
        variants["compiled loop (current)"] = _current(optim.BLOCK, native=True)
    variants["fused (fast mode)"] = _fused
    times: dict[str, list[float]] = {k: [] for k in variants}
    results = {}
    for r in range(args.repeats + 1):  # round-robin; round 0 is a warm-up
        for name, fn in variants.items():
            p, g, m, v = (x.clone() for x in start)
            t0 = time.perf_counter()
            fn(hp, 3, p, g, m, v)
            if r:
                times[name].append(time.perf_counter() - t0)
            results[name] = (p, m, v)
    base = results["previous (64K, allocating)"]
    prev = float(np.median(times["previous (64K, allocating)"]))
    for name, ts in times.items():
        same = all(
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(results[name], base)
        )
        med, lo, hi = (1e3 * x for x in np.percentile(ts, [50, 25, 75]))
        bits = "same bits" if same else "DIFFERENT BITS" if "fused" not in name else "not bitwise"
        print(f"{name:28s} {med:7.2f} ms (IQR {lo:.2f}-{hi:.2f})  ×previous {med / 1e3 / prev:.2f}"
              f"  {bits}")  # fmt: skip
        if not same and "fused" not in name:
            return 1
    print(f"{args.numel:,} fp32 elements, AdamW, {args.threads} thread(s), {args.repeats} repeats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
