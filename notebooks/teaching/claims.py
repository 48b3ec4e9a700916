"""The measurements behind the claims of notebook 04 (each claim about ZeRO tested against a
measurement): model-state volume per stage on gloo ranks, the memory reduction on simulated
ranks against zero.common.memory's formula, and bitwise invariance of a run under the world size.

Legend: see the package docstring; a volume factor is elements sent per rank over
(N-1)/N·Ψ_pad, so 2 for baseline DP at M = N and 3 for stage 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zero.common.memory import asymptotic_reduction, reduction_factor

from .common import (
    STAGE_NAMES,
    differing_elements,
    markdown_table,
    stage_label,
    volume_in_psi,
)
from .gloo import Job, RankRun, run_on_gloo
from .simulation import simulate, toy_problem


def volume_factors(run: RankRun) -> dict[str, float]:
    """Per unit, the model-state elements this rank sent per micro-step of the last step,
    divided by (N-1)·L_u, i.e. by (N-1)/N·Ψ_u(padded): 3 for a stage-3 unit (two all-gathers
    and a reduce-scatter per micro-step); 2 for the stage-3 root, which stays gathered; and
    (M/N + 1)/(M/N) at stages 0-2 in deterministic mode (reduce-scatter every micro-step, one
    all-gather per step)."""
    n = run.world_size
    if n < 2:
        raise ValueError(f"world_size={n}: a volume in Ψ needs N >= 2")
    sent = [0] * len(run.shards)
    for r in run.records:
        if r["kind"] == "model":
            sent[r["unit"]] += r["elements"]
    per_rank = run.micro_batches // n
    return {
        name: sent[u] / ((n - 1) * run.shards[u] * per_rank)
        for u, name in enumerate(run.unit_names)
    }


def total_volume_factor(run: RankRun) -> float:
    """The last step's model-state elements sent by this rank over (N-1)/N·Ψ_pad."""
    return volume_in_psi(run.volume[-1][0], run.world_size, run.psi_padded)


def simulated_reduction(world_sizes: Sequence[int], stage: int) -> list[float]:
    """Baseline bytes over the stage's bytes per rank, both counted from the simulated ranks'
    buffers after one step of the toy problem (the paper's configuration, K = 12)."""
    out = []
    for n in world_sizes:
        problem = toy_problem(world_size=n, d=16, layers=1)
        base = sum(simulate(problem, 0).world.resident_bytes(0).values())
        mine = sum(simulate(problem, stage).world.resident_bytes(0).values())
        out.append(base / mine)
    return out


def reduction_table(world_sizes: Sequence[int], measured: dict[int, Sequence[float]]) -> str:
    """Markdown: per stage, the simulated reduction at each N beside zero.common.memory's formula,
    and the formula and the paper's asymptote at N_d = 1024."""
    header = ["stage", "", *(f"N = {n}" for n in world_sizes), "N_d = 1024", "asymptote"]
    rows = []
    for stage, values in measured.items():
        formula = [reduction_factor(n, stage) for n in world_sizes]
        far = f"{reduction_factor(1024, stage):.2f}×"
        limit = f"{asymptotic_reduction(stage, world_size=1024):g}×"
        rows.append([STAGE_NAMES[stage], "simulated", *(f"{v:.3f}" for v in values), far, limit])
        rows.append(["", "formula", *(f"{v:.3f}" for v in formula), "", ""])
    return markdown_table(header, rows)


@dataclass(frozen=True, kw_only=True)
class VolumeMeasurement:
    """Model-state volume per step in units of (N-1)/N·Ψ_pad, from engine.counter on rank 0."""

    series: dict[str, dict[int, float]]  # "N = 2, M = N, fast" -> stage -> factor
    stage3_units: dict[str, dict[str, float]]  # the same labels -> unit -> factor per micro-step

    def at(self, m: str) -> dict[str, dict[int, float]]:
        """The series measured at `m` ("M = N", "M = 4N", ...)."""
        return {k: v for k, v in self.series.items() if f", {m}, " in k}


def measure_volumes(
    world_sizes: Sequence[int], *, accumulation: int = 4, accumulation_world_size: int = 2
) -> VolumeMeasurement:
    """Every stage in both modes at M = N for each N, and at M = accumulation·N for
    accumulation_world_size, on gloo (one forked world per N)."""
    series: dict[str, dict[int, float]] = {}
    units: dict[str, dict[str, float]] = {}
    sizes = sorted(set(world_sizes) | {accumulation_world_size})
    for n in sizes:
        ms = ([1] if n in world_sizes else []) + (
            [accumulation] if n == accumulation_world_size else []
        )
        jobs = [
            Job(stage=s, deterministic=d, micro_batches=k * n)
            for k in ms
            for d in (True, False)
            for s in range(4)
        ]
        for job, runs in zip(jobs, run_on_gloo(jobs, n)):
            mode = "deterministic" if job.deterministic else "fast"
            m = "M = N" if job.micro_batches == n else f"M = {job.micro_batches // n}N"
            label = f"N = {n}, {m}, {mode}"
            series.setdefault(label, {})[job.stage] = total_volume_factor(runs[0])
            if job.stage == 3:
                units[label] = volume_factors(runs[0])
    return VolumeMeasurement(series=series, stage3_units=units)


def format_series(series: dict[str, dict[int, float]], *, digits: int = 3) -> str:
    """Markdown: one row per series, one column per stage."""
    stages = sorted({s for row in series.values() for s in row})
    return markdown_table(
        ["", *(f"stage {stage_label(s)}" for s in stages)],
        [
            [label, *(f"{row[s]:.{digits}f}" if s in row else "—" for s in stages)]
            for label, row in series.items()
        ],
    )


def format_units(per_unit: dict[str, dict[str, float]], *, digits: int = 3) -> str:
    """Markdown: one row per series, one column per unit."""
    names = list(next(iter(per_unit.values())))
    return markdown_table(
        ["", *names],
        [[label, *(f"{row[u]:.{digits}f}" for u in names)] for label, row in per_unit.items()],
    )


def measure_invariance(
    world_sizes: Sequence[int], variants: dict[str, dict], *, micro_batches: int, steps: int = 2
) -> tuple[dict[str, dict[int, int]], int]:
    """Train the same run (Job(**variant), M = micro_batches) at each world size; return, per
    variant and N, how many fp32 master parameters differ in their bits from the run at the
    first world size, and the number of parameters."""
    masters: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for n in world_sizes:
        jobs = [Job(micro_batches=micro_batches, steps=steps, **v) for v in variants.values()]
        for label, runs in zip(variants, run_on_gloo(jobs, n)):
            masters[(label, n)] = runs[0].master
    first = world_sizes[0]
    differing = {
        label: {
            n: differing_elements(masters[(label, n)], masters[(label, first)]) for n in world_sizes
        }
        for label in variants
    }
    some = masters[(next(iter(variants)), first)]
    return differing, int(sum(a.size for a in some.values()))
