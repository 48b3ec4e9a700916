"""python -m measure.collective_speed: the engine's all-gather on gloo, as gloo's own collective
and as point-to-point sends ([Note: all-gather on gloo] in zero/collectives.py), side by side.

    python -m measure.collective_speed --world-sizes 2 4 --mib 1 3 12 --repeats 25

A micro-benchmark, not a test: for each N and size (the gathered buffer, fp32) it prints the
median milliseconds per call of the slowest rank, both ways alternating, the ratio, and whether
both gave the same bytes. Timings on a shared machine are noisy: run it on a quiet one.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist

from zero import collectives as C
from zero.ranks.local import spawn

WAYS = ("backend", "p2p")
TAG = dict(phase="bench", kind="model", unit=0)


def _rank(rank: int, n: int, sizes: list[int], repeats: int) -> dict:
    import time

    out = {}
    for mib in sizes:
        numel = mib * (1 << 18) // n * n
        shard = torch.randn(numel // n, generator=torch.Generator().manual_seed(rank))
        got, times = {}, {w: [] for w in WAYS}
        for r in range(repeats + 1):  # alternating; round 0 is a warm-up
            for way in WAYS:
                C.GLOO_ALL_GATHER = way
                buf = torch.empty(numel)
                dist.barrier()
                t0 = time.perf_counter()
                C.all_gather(buf, shard, group=None, counter=C.CommCounter(), padding=0, tag=TAG)
                if r:
                    times[way].append(time.perf_counter() - t0)
                got[way] = buf
        C.GLOO_ALL_GATHER = "p2p"
        med = torch.tensor([float(np.median(times[w])) for w in WAYS], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's median
        same = torch.equal(got["backend"].view(torch.int32), got["p2p"].view(torch.int32))
        out[mib] = (*(1e3 * med).tolist(), same)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser("python -m measure.collective_speed", description=__doc__)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 3, 12], help="gathered MiB")
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args(argv)
    for name in ("world_sizes", "mib"):
        for v in getattr(args, name):
            if v < 1:
                raise SystemExit(f"{name}={v!r}: allowed are integers >= 1")
    if args.repeats < 1:
        raise SystemExit(f"repeats={args.repeats!r}: allowed are integers >= 1")
    print("N  MiB  gloo all_gather  point-to-point  ×gloo  same bytes")
    for n in args.world_sizes:
        res = spawn(_rank, n, args.mib, args.repeats, timeout_s=300)[0]
        for mib, (gloo, p2p, same) in res.items():
            print(f"{n}  {mib:3d}  {gloo:12.2f} ms  {p2p:11.2f} ms  {p2p / gloo:5.2f}  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
