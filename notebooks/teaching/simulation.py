"""ZeRO step by step on simulated ranks (reference/simulate.py): the toy problem of notebook 02,
a run of N simulated ranks beside the single-process reference, and what each stage's step
holds and sends against the analytic model (zero.common.memory).

Legend: see the package docstring; Ψ_pad = N·ΣL is the padded parameter count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from reference import Hyper, ModelSpec, StepConfig, cast, init_state, train_step
from reference.optim import state_names
from reference.precision import DTYPES
from reference.simulate import World
from zero.common.memory import model_state_breakdown

from .common import CATEGORIES, markdown_table, same_bits, stage_label, volume_in_psi
from .pictures import format_memory, format_messages, message_table

# ---------------------------------------------------------------------------------------------
# A toy problem for the simulation


@dataclass(frozen=True, kw_only=True)
class ToyProblem:
    """A small model's layout, its start values and the step's configuration; gradients are
    drawn per step from (seed, step), so every stage sees the same micro-batch gradients."""

    spec: ModelSpec
    cfg: StepConfig
    master: dict[str, np.ndarray]
    seed: int

    def grads(self, step: int) -> list[dict[str, np.ndarray]]:
        """The M micro-batch gradients of `step`, in the compute dtype (micro-batch j runs on
        rank j mod N)."""
        rng = np.random.default_rng([self.seed, 1, step])
        shapes = {s.name: s.shape for lay in self.spec.layouts for s in lay.slots}
        return [
            {
                n: cast(rng.standard_normal(sh) * 1e-2, self.cfg.precision)
                for n, sh in shapes.items()
            }
            for _ in range(self.cfg.micro_batches)
        ]


def toy_units(d: int = 32, layers: int = 2) -> list[list[tuple[str, tuple[int, ...]]]]:
    """GPT-shaped units: a root (embedding, final norm) and one unit per block."""
    root = [("wte", (2 * d, d)), ("ln_f", (d,))]
    blocks = [
        [(f"h{i}.attn", (d, 3 * d)), (f"h{i}.mlp", (d, 2 * d)), (f"h{i}.ln", (d,))]
        for i in range(layers)
    ]
    return [root, *blocks]


def toy_problem(
    *,
    world_size: int,
    micro_batches: int | None = None,
    precision: str = "bf16",
    reduce_dtype: str | None = "bf16",
    d: int = 32,
    layers: int = 2,
    seed: int = 0,
) -> ToyProblem:
    """The paper's configuration by default: bf16 working copy and gradients, AdamW (K = 12),
    M = N; chunks of 128 elements so that shards stay small enough to draw."""
    units = toy_units(d, layers)
    groups = (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=1e-2))
    group_of = {n: int(len(s) == 1) for u in units for n, s in u}  # no decay on 1-D params
    spec = ModelSpec.build(units, group_of, chunk=128)
    cfg = StepConfig(
        optimizer="adamw",
        groups=groups,
        precision=precision,
        reduce_dtype=reduce_dtype,
        world_size=world_size,
        micro_batches=world_size if micro_batches is None else micro_batches,
        clip_norm=1.0,
    )
    rng = np.random.default_rng([seed, 0])
    master = {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for u in units for n, s in u}
    return ToyProblem(spec=spec, cfg=cfg, master=master, seed=seed)


# ---------------------------------------------------------------------------------------------
# Simulated runs


@dataclass(kw_only=True)
class SimRun:
    """A World after some steps, the single-process reference beside it, and the verdict."""

    world: World
    reference: object  # reference.step.TrainState after the same steps
    master_equal: bool  # World.full_master() == reference master, bit for bit
    opt_equal: bool  # World.full_opt() == reference optimizer states, bit for bit


def simulate_steps(
    master: dict[str, np.ndarray],
    spec: ModelSpec,
    cfg: StepConfig,
    grads_per_step: Iterable[list[dict[str, np.ndarray]]],
    *,
    stage: int,
    mode: str,
) -> SimRun:
    """One step per item of `grads_per_step` (the M micro-batch gradients), on N simulated
    ranks and on the single-process reference, from the same start values."""
    world = World(master, spec, cfg, stage=stage, mode=mode)
    ref = init_state(master, spec, cfg)
    for grads in grads_per_step:
        world.step(grads)
        ref, _ = train_step(ref, grads, spec, cfg)
    opt = world.full_opt()
    return SimRun(
        world=world,
        reference=ref,
        master_equal=same_bits(world.full_master(), ref.master),
        opt_equal=all(same_bits(opt[n], ref.opt[n]) for n in ref.opt),
    )


def simulate(problem: ToyProblem, stage: int, *, mode: str = "deterministic", steps: int = 1):
    """Run `steps` steps on N simulated ranks and on the single-process reference.

    The World keeps the last step's message log (World.log) for message_table."""
    grads = (problem.grads(step) for step in range(steps))
    return simulate_steps(problem.master, problem.spec, problem.cfg, grads, stage=stage, mode=mode)


# ---------------------------------------------------------------------------------------------
# What a step holds and sends, against the analytic model


def padded_numel(world: World) -> int:
    """Ψ_pad: the padded parameter count, N·ΣL."""
    return world.n * sum(world.shard)


def analytic_bytes(world: World) -> dict[str, int]:
    """zero.common.memory.model_state_breakdown for this World's configuration at Ψ_pad: what each
    rank should hold, by category (exact for the simulation, tests/unit/test_simulate.py)."""
    cfg = world.cfg
    counts = {len(state_names(cfg.optimizer, hp)) for hp in cfg.groups}
    if len(counts) != 1:
        raise ValueError(
            f"cfg.groups: the groups keep {sorted(counts)} optimizer states per element; the "
            "analytic model takes one count (e.g. SGD with momentum in every group or in none)"
        )
    (states,) = counts
    b = model_state_breakdown(
        num_params=padded_numel(world),
        world_size=world.n,
        stage=world.stage,
        param_bytes=DTYPES[cfg.precision].itemsize,
        grad_bytes=world.red.itemsize,
        master_bytes=0 if cfg.precision == "fp32" else 4,
        optimizer_states=states,
        accumulation=cfg.micro_batches // world.n,
        deterministic=world.mode == "deterministic",
    )
    return {c: int(getattr(b, c)) for c in CATEGORIES}


def stage_report(w: World, *, rank: int = 0) -> str:
    """Markdown tables for one simulated step of notebook 02: the messages `rank` sent, and
    every rank's bytes with the analytic model beside them. (The bitwise check against the
    reference is written out in the notebook's own cells.)"""
    held = {r: w.resident_bytes(r) for r in range(w.n)}
    want = analytic_bytes(w)
    total, expected = sum(held[rank].values()), sum(want.values())
    return "\n\n".join(
        [
            f"**Messages rank {rank} sent in the last step** (Ψ_pad = {padded_numel(w):,}, "
            f"N = {w.n}):",
            format_messages(message_table(w, rank), world_size=w.n, psi_padded=padded_numel(w)),
            "**Bytes each rank holds** (counted from its buffers):",
            format_memory(held),
            f"Analytic model (zero.common.memory.model_state_breakdown at Ψ_pad): {want} = "
            f"{expected:,} bytes; measured/expected = {total / expected:.4f}.",
        ]
    )


@dataclass(frozen=True, kw_only=True)
class StageSummary:
    """One simulated step of every stage on the same problem, as rank 0 sees it."""

    held: dict[int, dict[str, int]]  # stage -> bytes by category, counted from the buffers
    expected: dict[int, int]  # stage -> analytic total (zero.common.memory)
    volume: dict[int, float]  # stage -> model-state elements sent / ((N-1)/N·Ψ_pad)

    def table(self) -> str:
        """Markdown: per stage, bytes held, measured/expected and the volume."""
        header = ["stage", "bytes rank 0 holds", "measured/expected", "volume ×(N-1)/N·Ψ_pad"]
        rows = []
        for s, held in self.held.items():
            total = sum(held.values())
            rows.append(
                [
                    stage_label(s),
                    f"{total:,}",
                    f"{total / self.expected[s]:.4f}",
                    f"{self.volume[s]:.3f}",
                ]
            )
        return markdown_table(header, rows)


def summarize_stages(problem: ToyProblem) -> StageSummary:
    """One step of stages 0-3 on `problem` (N >= 2), each checked bitwise against the reference."""
    held, expected, volume = {}, {}, {}
    for stage in range(4):
        run = simulate(problem, stage)
        if not (run.master_equal and run.opt_equal):
            raise AssertionError(f"stage {stage}: the simulation differs from the reference")
        w = run.world
        held[stage] = w.resident_bytes(0)
        expected[stage] = sum(analytic_bytes(w).values())
        volume[stage] = volume_in_psi(w.traffic(0)[0], w.n, padded_numel(w))
    return StageSummary(held=held, expected=expected, volume=volume)
