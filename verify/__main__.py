"""python -m verify: run the engine against the reference over a matrix of cells.

    python -m verify --stages 0 1 2 --world-sizes 1 2 4 --precisions fp32 bf16 fp16 \\
                     --optimizers sgd adam adamw --mode deterministic --steps 3 --json out.json

Launched plainly, it starts one long-lived pool of local gloo ranks per world size and runs all
of that world size's cells on it. Under torchrun (`torchrun --nproc-per-node 8 -m verify ...`)
it uses the world it was given and runs the cells of that world size only. One row per cell;
the exit status is non-zero if any cell fails. Deterministic cells must be bitwise equal on every
rank. Fast cells run in lock-step (verify/lockstep.py): each step starts from the reference's
state and the reduced gradient, master, optimizer states and working copy must each lie within
their derived bound; the row prints the worst ratio observed/bound (a cell passes at <= 1).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from zero.results import provenance, write_json

from .harness import Cell, run_cells

MODES = ("deterministic", "fast")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "bf16", "fp16"],
        choices=["fp32", "bf16", "fp16"],
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=["sgd", "adam", "adamw"],
        choices=["sgd", "adam", "adamw"],
    )
    p.add_argument("--mode", default="deterministic", choices=["deterministic", "fast", "both"])
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulation", type=int, default=2, help="M/N micro-steps per step")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=900, help="seconds per world size")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.world_sizes):
        p.error(f"--world-sizes {args.world_sizes}: each must be >= 1")
    return args


def cells_for(args) -> list[Cell]:
    modes = MODES if args.mode == "both" else (args.mode,)
    grid = itertools.product(
        args.world_sizes, args.stages, args.precisions, args.optimizers, modes, args.models
    )
    return [
        Cell(
            stage=s,
            world_size=n,
            precision=p,
            optimizer=o,
            mode=m,
            model=mdl,
            steps=args.steps,
            accumulation=args.accumulation,
        )
        for n, s, p, o, m, mdl in grid
    ]


def merge(cell: Cell, per_rank: list[dict]) -> dict:
    """One row from every rank's verdict: a cell passes only if it passed on every rank."""
    return {
        "stage": cell.stage,
        "world_size": cell.world_size,
        "precision": cell.precision,
        "optimizer": cell.optimizer,
        "mode": cell.mode,
        "steps": cell.steps,
        # fast cells are checked against bounds, not bits
        "bitwise": all(r["bitwise"] for r in per_rank) if cell.mode == "deterministic" else None,
        "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
        "max_ulp": max(r["max_ulp"] for r in per_rank),
        "tolerance": 0 if cell.mode == "deterministic" else "derived bound (verify/lockstep.py)",
        "bound_ratio": {
            k: max(r["ratios"].get(k, 0.0) for r in per_rank) for k in per_rank[0]["ratios"]
        },
        "passed": all(r["passed"] for r in per_rank),
        "first_mismatch": next(
            (f"rank {r['rank']}: {r['first']}" for r in per_rank if r["first"]), ""
        ),
        "skipped_steps": per_rank[0]["skipped_steps"],
        "config": cell.as_dict(),
    }


def run_world(n: int, cells: list[Cell], timeout_s: float) -> list[list[dict]]:
    """Per-rank results for every cell of world size n, here or under torchrun."""
    from zero import launch

    if launch.under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            launch.init_from_env()
        if dist.get_world_size() != n:
            return []
        mine = run_cells(dist.get_rank(), n, cells)
        every: list = [None] * n
        dist.all_gather_object(every, mine)
        return every
    return launch.get_pool(n).run(run_cells, cells, timeout_s=timeout_s)


def main(argv=None) -> int:
    args = parse(argv)
    # under torchrun every rank computes; rank 0 alone prints and writes
    lead = os.environ.get("RANK", "0") == "0"

    def say(*a):
        if lead:
            print(*a, flush=True)

    cells = cells_for(args)
    rows, started = [], time.time()
    header = (
        f"{'stage':>5} {'N':>3} {'prec':>5} {'optim':>6} {'model':>5} {'mode':>13} "
        f"{'bitwise':>7} {'max_ulp':>8} {'skipped':>7} {'worst/bound':>11}  result"
    )
    say(header)
    for n in args.world_sizes:
        mine = [c for c in cells if c.world_size == n]
        per_rank = run_world(n, mine, args.timeout)
        if not per_rank:
            say(f"(world size {n} skipped: this torchrun world has another size)")
            continue
        for i, cell in enumerate(mine):
            row = merge(cell, [r[i] for r in per_rank])
            rows.append(row)
            worst = max(row["bound_ratio"].values(), default=0.0)
            bitwise = "-" if row["bitwise"] is None else str(row["bitwise"])
            say(
                f"{cell.stage:>5} {n:>3} {cell.precision:>5} {cell.optimizer:>6} "
                f"{cell.model:>5} {cell.mode:>13} {bitwise:>7} {row['max_ulp']:>8} "
                f"{row['skipped_steps']:>7} {worst:>11.3f}  "
                f"{'PASS' if row['passed'] else 'FAIL ' + row['first_mismatch']}"
            )
    failed = [r for r in rows if not r["passed"]]
    say(f"{len(rows) - len(failed)}/{len(rows)} cells passed in {time.time() - started:.1f} s")
    if args.json and lead:
        write_json(args.json, {"cells": rows, "provenance": provenance()})
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
