"""zero/ on gloo against the NumPy simulation (notebook 02's last section): the same steps, from
the same start values and the same single-process micro-batch gradients, must give the
reference's bits, the simulation's traffic and the simulation's bytes on every rank.

Legend: see the package docstring; L is a unit's shard length, M/N micro-steps per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reference.simulate import World

from .common import CATEGORIES, markdown_table, same_bits, stage_label
from .figures import grouped_bars
from .gloo import RankRun
from .pictures import Block
from .simulation import SimRun, simulate_steps


def simulate_engine_run(run: RankRun, mode: str = "deterministic") -> SimRun:
    """The NumPy simulation of the same steps: rank 0's spec, start values and single-process
    gradients (a Job with reference_grads=True), on N simulated ranks."""
    if run.grads is None:
        raise ValueError("run: has no gradients; run its Job with reference_grads=True on rank 0")
    return simulate_steps(
        run.init, run.spec, run.step_config, run.grads, stage=run.stage, mode=mode
    )


def root_gather_saving(world: World, rank: int) -> tuple[int, int]:
    """(elements, padding) of one all-gather of the root unit (unit 0) by `rank`: what the
    engine saves per micro-step at stage 3 by keeping the root gathered from its first use in
    forward to its last in backward, where the simulation gathers it twice."""
    n, L = world.n, world.shard[0]
    return (n - 1) * L, (n - 1) * world.padding[0][rank]


def all_blocks(runs: Sequence[RankRun]) -> list[Block]:
    """The blocks of every rank of one Job, for draw_rank_bytes."""
    return [b for run in runs for b in run.blocks]


@dataclass(frozen=True, kw_only=True)
class EngineCheck:
    """One stage of notebook 02's last section: zero/ on gloo against the simulation."""

    stage: int
    engine_equals_reference: bool  # every rank's full master, bit for bit
    simulation_equals_reference: bool
    engine_sent: tuple[int, int]  # rank 0, last step: (elements, padding)
    simulation_sent: tuple[int, int]
    root_saving: tuple[int, int]  # what the engine does not send at stage 3 (else (0, 0))
    traffic_matches: bool  # engine == simulation - root_saving, exactly, on every rank
    engine_bytes: dict[str, int]  # rank 0, memory_report() without the transient comm buffers
    simulation_bytes: dict[str, int]
    memory_matches: bool  # equal per category on every rank

    @property
    def ok(self) -> bool:
        """Bits, traffic and memory all agree."""
        return (
            self.engine_equals_reference
            and self.simulation_equals_reference
            and self.traffic_matches
            and self.memory_matches
        )


def check_engine_against_simulation(runs: Sequence[RankRun]) -> EngineCheck:
    """Compare one Job's ranks (reference_grads=True) with the simulation of the same steps."""
    sim = simulate_engine_run(runs[0])
    w = sim.world
    per_microstep = w.cfg.micro_batches // w.n
    traffic_ok, memory_ok, saving0 = True, True, (0, 0)
    for r in runs:
        el, pad = w.traffic(r.rank)
        save = (0, 0)
        if r.stage == 3:
            one = root_gather_saving(w, r.rank)
            save = (one[0] * per_microstep, one[1] * per_microstep)
        if r.rank == 0:
            saving0 = save
        traffic_ok &= tuple(r.volume[-1]) == (el - save[0], pad - save[1])
        memory_ok &= {c: r.memory[c] for c in CATEGORIES} == w.resident_bytes(r.rank)
    return EngineCheck(
        stage=runs[0].stage,
        engine_equals_reference=all(same_bits(r.master, sim.reference.master) for r in runs),
        simulation_equals_reference=sim.master_equal and sim.opt_equal,
        engine_sent=tuple(runs[0].volume[-1]),
        simulation_sent=w.traffic(0),
        root_saving=saving0,
        traffic_matches=traffic_ok,
        engine_bytes={c: runs[0].memory[c] for c in CATEGORIES},
        simulation_bytes=w.resident_bytes(0),
        memory_matches=memory_ok,
    )


def format_engine_checks(checks: Sequence[EngineCheck]) -> str:
    """A Markdown table of check_engine_against_simulation results."""
    yes = {True: "yes", False: "**NO**"}
    header = [
        "stage",
        "engine = reference (bits, every rank)",
        "simulation = reference",
        "rank 0 sent: engine",
        "simulation",
        "root gathers saved",
        "traffic equal (every rank)",
        "rank 0 bytes: engine",
        "simulation",
        "memory equal (every rank)",
    ]
    rows = [
        [
            stage_label(c.stage),
            yes[c.engine_equals_reference],
            yes[c.simulation_equals_reference],
            f"{c.engine_sent[0]:,}",
            f"{c.simulation_sent[0]:,}",
            f"{c.root_saving[0]:,}",
            yes[c.traffic_matches],
            f"{sum(c.engine_bytes.values()):,}",
            f"{sum(c.simulation_bytes.values()):,}",
            yes[c.memory_matches],
        ]
        for c in checks
    ]
    return markdown_table(header, rows)


def draw_engine_vs_simulation(checks: Sequence[EngineCheck], *, title: str, axes=None):
    """Two panels, per stage: the model-state bytes rank 0 holds and the elements it sent in
    the last step, zero/ on gloo beside the NumPy simulation (check_engine_against_simulation)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(checks))
    panels = (
        (
            "resident model-state bytes",
            [sum(c.engine_bytes.values()) for c in checks],
            [sum(c.simulation_bytes.values()) for c in checks],
        ),
        (
            "elements sent",
            [c.engine_sent[0] for c in checks],
            [c.simulation_sent[0] for c in checks],
        ),
    )
    for ax, (what, engine, sim) in zip(axes, panels):
        columns = {"zero/ on gloo": engine, "NumPy simulation": sim}
        grouped_bars(ax, x, columns, fontsize=6, fmt="%d")
        ax.set_xticks(x + 0.2, [stage_label(c.stage) for c in checks], fontsize=8)
        ax.set_xlabel("ZeRO stage")
        ax.set_ylabel(f"{what}, rank 0")
        ax.set_title(f"{title}: {what}")
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    return axes
