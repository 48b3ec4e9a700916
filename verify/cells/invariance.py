"""World-size invariance: the same run at N = 1, 2, 4 and 8 gives the same bits after every step.

docs/design.md §2: for N and M powers of two with N | M, the reduction tree over micro-batches is
the
same for every N, the norm's chunks do not depend on N, and the optimizer is elementwise; so in
deterministic mode a run with the same data, seed and M must give bitwise-identical parameters
and optimizer states at every world size, and at every stage (each stage computes the same step).
This module checks exactly that, without the reference: each rank all-gathers the full state
after every step (ZeroEngine.gather_state: fp32 master and optimizer states by name; the working
copy through gathered_params(), which stage 3 needs) and hashes its bits; only the digests
travel. Every rank must compute the same digest, every N the digest of N = 1, and every stage
the digest of stage 0 at the same N.

A run: {"stage", "precision", "optimizer"} plus the shared defaults of RUN_DEFAULTS (the uneven
MLP, M = 8 micro-batches, 3 steps, clipping on, overlap on, tiny units).
"""

from __future__ import annotations

import torch

from ..checks.harness import cell_device, state_digest
from .cell import MODELS, Cell
from .matrix import CLIP_NORM, INVARIANT_WORLD_SIZES

RUN_DEFAULTS = {
    "model": "mlp-uneven",
    "micro_batches": 8,
    "steps": 3,
    "clip_norm": CLIP_NORM,
    "overlap": True,
    "units": "tiny",
    "seed": 0,
}


def run_config(run: dict) -> dict:
    return {**RUN_DEFAULTS, **run}


def cell_for(run: dict, n: int) -> Cell:
    r = run_config(run)
    if r["micro_batches"] % n:
        raise ValueError(f"micro_batches={r['micro_batches']}: not a multiple of N={n}")
    return Cell(
        stage=r["stage"],
        world_size=n,
        precision=r["precision"],
        optimizer=r["optimizer"],
        mode="deterministic",
        steps=r["steps"],
        model=r["model"],
        accumulation=r["micro_batches"] // n,
        clip_norm=r["clip_norm"],
        overlap=r["overlap"],
        units=r["units"],
        seed=r["seed"],
    )


def run_digests(rank: int, world_size: int, runs: list[dict]) -> list[list[str]]:
    """Per run, the digest after each step, on this rank, computed on the rank's device
    (verify.checks.harness.cell_device): the bits are compared across N on one kind of device."""
    from zero.engine import ZeroEngine
    from zero.loop import train_steps

    torch.set_num_threads(1)
    device = cell_device()
    out = []
    for run in runs:
        cell = cell_for(run, world_size)
        build, data = MODELS[cell.model]
        model = build()
        eng = ZeroEngine(model.to(device), cell.zero_config(model.unit_names()))

        def microbatch(step, j, model=model, cell=cell, data=data):
            batch = data(
                model.cfg, seed=cell.seed, data_step=step, count=j + 1, batch_size=cell.batch_size
            )[j]
            return tuple(x.to(device) for x in batch)

        digests = []
        for step in range(cell.steps):
            (res,) = train_steps(eng, microbatch, 1, start_step=step)
            digests.append(state_digest(eng, res))
        out.append(digests)
    return out


def _without_stage(run: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in run_config(run).items() if k != "stage"))


def table(runs: list[dict], per_n: dict[int, list[list[list[str]]]]) -> list[dict]:
    """Rows of the invariance table from every world size's per-rank digests.

    per_n[N][rank][run][step]. A row (run, N) passes when all its ranks agree, every step
    matches N = 1 (the first world size given) and matches stage 0's run at the same N and
    precision/optimizer (when that run is in the table).
    """
    sizes = sorted(per_n)
    base = sizes[0]
    stage0 = {_without_stage(r): j for j, r in enumerate(runs) if run_config(r)["stage"] == 0}
    rows = []
    for i, run in enumerate(runs):
        ref = per_n[base][0][i]
        for n in sizes:
            ranks = [r[i] for r in per_n[n]]
            agree = all(d == ranks[0] for d in ranks)
            mine = ranks[0]
            diff = next((s for s, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
            twin = stage0.get(_without_stage(run))
            stages_agree = twin is None or per_n[n][0][twin] == mine
            rows.append(
                {
                    **{k: run_config(run)[k] for k in ("stage", "precision", "optimizer")},
                    "world_size": n,
                    "steps": len(mine),
                    "ranks_agree": agree,
                    "same_as_n": base,
                    "first_difference": diff,
                    "same_as_stage0": stages_agree,
                    "digest": mine[-1],
                    "passed": agree and diff is None and stages_agree,
                    "config": {**run_config(run), "world_size": n},
                }
            )
    return rows


def world_sizes_for(runs: list[dict], available=INVARIANT_WORLD_SIZES) -> list[int]:
    m = min(run_config(r)["micro_batches"] for r in runs) if runs else 1
    return [n for n in available if m % n == 0]
