"""The verification matrix: its dimensions, the --quick and --complete presets, and where each
planted bug is observable.

Dimensions (DIMENSIONS): stage 0-3; N ∈ {1, 2, 3, 4, 8}; fp32 / bf16 / fp16 (loss scaling);
SGD / Adam / AdamW; clipping on/off; M ∈ {N, 4N}; unit size tiny/huge
(verify.cells.cell.Cell.units);
parameter counts even/uneven (numel % N != 0); overlap off / on / on with injected delays;
deterministic / fast mode; gradients from backward or injected (random, extreme, non-finite).
The product is 4·5·3·3·2·2·2·2·3·2·4 = 69,120 cells. The presets cover it instead
(verify/cells/covering.py):

  quick     every *pair* of values (about 25 cells), the slice stage × N × precision with
            injected gradients (60 cells), the cells of TEETH, three of extras(), and the
            world-size-invariance table at every stage × precision for N ∈ {1, 2, 4, 8}
            (AdamW), and zero_r_cells() (activation checkpointing, optimizer offload, both,
            and contiguous memory, at every stage, N = 2), and BRANCHES (clipping on some steps
            only at every stage, C_B pieces, fast mode with offload and with persistent units,
            a loss scale below 1/M, the GPT), and UNUSED (a branch whole steps skip, one cell
            per stage). The CI preset: about a minute on 2 cores.
  complete  every *4-tuple* of values (about 350 cells; so every triple and pair too), the
            slices stage × N × precision for each kind of injected gradients, for backward and
            in fast mode, the GPT at every stage × precision, TEETH and extras() (persistent
            stage-3 units, reduction in the compute dtype), zero_r_cells() at N ∈ {2, 3, 4},
            and world-size invariance for every stage × precision × optimizer.

N = 3 is compared with the reference at N = 3 (its own tree); world-size invariance is claimed
for powers of two only (docs/design.md §2).

[Note: observable] A planted bug can only fail a cell that exercises it: a different summation
order needs N >= 3 (at N = 2, a + b = b + a), and sums that round: a few bf16 or fp16 values of
similar size add up exactly in the fp32 reduction (8 or 11 significant bits each, 24 in the
sum), so an order shows in fp32 cells or with widely spread ("extreme") gradients; 1/N in
place of 1/M needs M > N; a scale error hides under clipping (and mostly under Adam's scale
invariance, though not from bitwise checks); a bias correction off by a step needs Adam and two
optimizer steps; a stale prefetched unit needs stage 3, overlap, a real forward and a second
step. verify.cells.observable.OBSERVABLE states these conditions
as predicates on cells; verify/planted/suite.py (python -m verify.planted) runs each bug on them and
the harness must report every one failing. A bug that no --quick cell can show is a gap in the
preset: PLANTED_GAPS holds the cells added for that reason, part of --quick and --complete.
"""

from __future__ import annotations

import dataclasses
import itertools

from .. import features
from . import interactions
from .cell import Cell
from .covering import covering_array
from .inject import GradientDraw

DIMENSIONS: dict[str, tuple] = {
    "stage": (0, 1, 2, 3),
    "world_size": (1, 2, 3, 4, 8),
    "precision": ("fp32", "bf16", "fp16"),
    "optimizer": ("sgd", "adam", "adamw"),
    "clip": ("on", "off"),
    "accumulation": (1, 4),  # M = N or M = 4N
    "units": ("tiny", "huge"),
    "sizes": ("even", "uneven"),
    "overlap": ("off", "on", "delays"),
    "mode": ("deterministic", "fast"),
    "gradients": ("backward", "random", "extreme", "nonfinite"),
}
STAGES, PRECISIONS, OPTIMIZERS = (DIMENSIONS[k] for k in ("stage", "precision", "optimizer"))
CLIP_NORM = 0.5  # below the norms of these workloads' gradients, so "on" really clips
INVARIANT_WORLD_SIZES = (1, 2, 4, 8)


def cells(*, cls: type[Cell] = Cell, **axes) -> list[Cell]:
    """The product of `axes` as cells (`cls`: Cell or a subclass), the first axis outermost.
    Each axis is a Cell field with one value or a list, tuple or range of values; an axis of
    dicts (any name) sets several fields together, e.g. numerics=({"precision": "bf16",
    "optimizer": "sgd"}, ...), a later axis winning. A tuple value goes in a list of one."""
    grid = [v if isinstance(v, (list, tuple, range)) else (v,) for v in axes.values()]
    out = []
    for combo in itertools.product(*grid):
        fields: dict = {}
        for name, value in zip(axes, combo):
            fields.update(value if isinstance(value, dict) else {name: value})
        out.append(cls(**fields))
    return out


def cell_of(row: dict, *, seed: int = 0, steps: int = 3) -> Cell:
    """The Cell of one matrix row (a dict over DIMENSIONS)."""
    injected = row["gradients"] != "backward"
    if injected:
        model = f"params-{row['sizes']}"
    else:
        model = "mlp" if row["sizes"] == "even" else "mlp-uneven"
    return Cell(
        stage=row["stage"],
        world_size=row["world_size"],
        precision=row["precision"],
        optimizer=row["optimizer"],
        mode=row["mode"],
        # non-finite draws skip steps 0 and 2 (verify.cells.inject.draw_for): 4 steps leave 2 real
        # ones
        steps=4 if row["gradients"] == "nonfinite" else steps,
        model=model,
        accumulation=row["accumulation"],
        clip_norm=CLIP_NORM if row["clip"] == "on" else None,
        overlap=row["overlap"] != "off",
        delays=row["overlap"] == "delays",
        units=row["units"],
        gradients=row["gradients"],
        nonfinite="skip" if injected else "raise",
        seed=seed,
    )


def covering_cells(strength: int, *, seed: int = 0) -> list[Cell]:
    """Every strength-tuple of DIMENSIONS' values, as cells (verify/cells/covering.py)."""
    rows = covering_array(DIMENSIONS, strength=strength, seed=seed)
    return [cell_of(r, seed=i) for i, r in enumerate(rows)]


def slice_cells(**fixed) -> list[Cell]:
    """The full slice stage × N × precision, the other dimensions fixed (DEFAULT_ROW, then
    `fixed`)."""
    out = []
    for s in DIMENSIONS["stage"]:
        for n in DIMENSIONS["world_size"]:
            for p in DIMENSIONS["precision"]:
                row = {**DEFAULT_ROW, **fixed, "stage": s, "world_size": n, "precision": p}
                out.append(cell_of(row, seed=1000 + len(out)))
    return out


DEFAULT_ROW = {
    "optimizer": "adamw",
    "clip": "on",
    "accumulation": 1,
    "units": "tiny",
    "sizes": "uneven",
    "overlap": "on",
    "mode": "deterministic",
    "gradients": "random",
}

# Cells that --quick holds whatever the covering array happens to contain, one per line of
# [Note: observable]; each comment says which planted bugs it exposes.
TEETH = (
    # stale prefetch (stage 3, overlap, real forward, 3 steps); ring order (N = 4); 1/N for
    # 1/M (M = 4N, no clipping); bias correction (AdamW); one ULP and shard offsets (N > 1)
    cell_of(
        {
            **DEFAULT_ROW,
            "stage": 3,
            "world_size": 4,
            "precision": "bf16",
            "clip": "off",
            "accumulation": 4,
            "gradients": "backward",
        },
        seed=2000,
    ),
    # overflow skip on one rank only (stage 0, inf on rank N-1); ring order at N = 3; 1/N for
    # 1/M under SGD without clipping
    cell_of(
        {
            **DEFAULT_ROW,
            "stage": 0,
            "world_size": 3,
            "precision": "fp16",
            "optimizer": "sgd",
            "clip": "off",
            "accumulation": 4,
            "gradients": "nonfinite",
        },
        seed=2001,
    ),
    # N = 3 at stage 2 with extremes, uneven sizes and delays; Adam's bias correction
    cell_of(
        {
            **DEFAULT_ROW,
            "stage": 2,
            "world_size": 3,
            "precision": "fp32",
            "optimizer": "adam",
            "overlap": "delays",
            "gradients": "extreme",
        },
        seed=2002,
    ),
)


def _branch(**fields) -> Cell:
    base = {"world_size": 2, "accumulation": 2, "steps": 3, "mode": "deterministic"}
    return Cell(**{**base, **fields})


# Branches the covering array cannot reach, each in --quick (verify --list shows who covers
# what). clip_norm is chosen per cell between the reference's norms of its steps
# (verify.checks.harness.reference_trajectory), so that some steps clip and others do not
# (tests/unit/test_verify_branches.py checks it): with CLIP_NORM every step clips, and the
# branch where the norm is below the limit (coefficient capped at 1) would never run.
BRANCHES = (
    # stage 0: C_B pieces; clips steps 1-2, not step 0
    _branch(stage=0, precision="fp32", optimizer="adamw", clip_norm=1.6,
            features=("bucket_elements=256",), seed=6000),
    # fast mode with optimizer offload; clips step 1 only
    _branch(stage=1, precision="bf16", optimizer="adam", mode="fast", features=("offload",),
            clip_norm=1.8, seed=6001),
    # C_B pieces at stage 2 (injected, uneven sizes); clips steps 0 and 2
    _branch(stage=2, precision="fp32", optimizer="adamw", model="params-uneven",
            gradients="random", features=("bucket_elements=512",), clip_norm=58.0, seed=6002),
    # fast mode with persistent stage-3 units; clips steps 0-1
    _branch(stage=3, precision="bf16", optimizer="adamw", mode="fast", persist_below=1000,
            clip_norm=1.5, seed=6003),
    # the GPT (tied embedding and head in the root unit); clips steps 0 and 2
    _branch(stage=3, precision="bf16", optimizer="adamw", model="gpt", clip_norm=0.65,
            seed=6004),
    # a loss scale below 1/M (S = 2^-4, M = 8): R is checked itself; in step 0 every
    # micro-batch holds a finite 30000 at one element, and their fp16 sum overflows in R only
    _branch(stage=1, precision="fp16", optimizer="sgd", accumulation=4, reduce_dtype="fp16",
            loss_scale=2.0**-4, model="params-even", gradients="drawn", nonfinite="skip",
            clip_norm=None, seed=6005,
            draw=GradientDraw(seed=6005, exponents=(-6, 2),
                              specials=tuple((0, j, 0, 5, (30000.0).hex()) for j in range(8)))),
)  # fmt: skip
VARIED_CLIP = frozenset(c.clip_norm for c in BRANCHES if c.clip_norm is not None)

# Unused parameters (reference/step.py's [Note: unused parameters]), one cell per stage: a side
# branch (verify/cells/branch.py) used by some ranks on step 0, by none on step 1 (the optimizer
# skips it; its step count falls behind t), again on step 2; at stage 3 the ranks agree.
UNUSED = tuple(
    _branch(stage=s, precision=p, optimizer=o, mode=mode, seed=6100 + s,
            model="mlp-skip" if s == 3 else "mlp-branch")
    for s, p, o, mode in ((0, "fp32", "adamw", "deterministic"),
                          (1, "bf16", "sgd", "deterministic"),
                          (2, "fp32", "adam", "fast"), (3, "bf16", "adamw", "deterministic"))
) + (  # one unit holding used and unused parameters: the optimizer's runs cut inside a unit
    _branch(stage=1, precision="fp32", optimizer="adam", model="mlp-branch", units="huge",
            seed=6104),
)  # fmt: skip


def clips_on_some_steps(c: Cell) -> bool:
    """A cell whose clip_norm was chosen to clip some steps and not others (BRANCHES)."""
    return c.clip_norm is not None and c.clip_norm in VARIED_CLIP


# stage 3, an MLP unit ("layers.0": 16·48 + 48 = 816 parameters) exactly at persist_below: the
# extras' persist_below = 1000 falls between unit sizes, so "<" and "<=" never differed there
PLANTED_GAPS = (
    _branch(stage=3, precision="fp32", optimizer="adam", model="mlp", persist_below=816,
            seed=6100),
)  # fmt: skip


def invariance_runs(*, full: bool) -> list[dict]:
    """World-size-invariance runs (verify/cells/invariance.py): the same run at N = 1, 2, 4, 8."""
    precisions = DIMENSIONS["precision"]
    optimizers = DIMENSIONS["optimizer"] if full else ("adamw",)
    return [
        {"stage": s, "precision": p, "optimizer": o}
        for s in DIMENSIONS["stage"]
        for p in precisions
        for o in optimizers
    ]


def zero_r_cells(world_sizes=(2,)) -> list[Cell]:
    """ZeRO-R and offload at every stage: activation checkpointing, optimizer offload, and both
    (checkpoints then kept on the host), with the model's own gradients (recomputation needs a
    forward); and one cell per stage with contiguous memory (M_D) and checkpointing, offload on
    at stages 1 and 3, so that the device and host arenas of gradients and checkpoints all run
    (the MLP's units have inputs of two sizes: the checkpoint arena also grows once); the
    checkpointing cell releases its gradient buffers between steps (release_grads, which a
    CPU does not do by default). They change memory, never the bits: deterministic cells must
    stay bitwise."""
    precisions = DIMENSIONS["precision"]
    out = []
    for n in world_sizes:
        for s in DIMENSIONS["stage"]:
            options = ((True, False, False), (False, True, False), (True, True, False))
            options += ((True, s % 2 == 1, True),)
            for i, (ckpt, off, contiguous) in enumerate(options):
                named = {
                    "checkpointing": ckpt,
                    "offload": off,
                    "contiguous": contiguous,
                    "offload_activations": ckpt and off,
                    "release_grads": i == 0,
                }
                out.append(
                    Cell(
                        stage=s,
                        world_size=n,
                        precision=precisions[(s + i) % len(precisions)],
                        optimizer="adam",
                        mode="deterministic",
                        model="mlp",
                        features=tuple(k for k, on in named.items() if on),
                        seed=5000 + s,
                    )
                )
    return out


# ---------------------------------------------------------------------------------------------
# Cells for library lines the cells above leave unrun (python -m verify.linecoverage lists
# what is still unrun, and why, in verify/uncovered.toml). Each checks a path of the engine
# that the other cells never take.
COVERAGE_CELLS = (
    # units="auto": the engine's own block detection must find the GPT's declared blocks
    _branch(stage=1, precision="bf16", optimizer="adamw", model="gpt", units="auto", steps=2,
            seed=7000),
    # a model built on the meta device, materialised unit by unit from init_seed: the same
    # bits as the CPU-built model the reference starts from
    _branch(stage=3, precision="fp32", optimizer="adam", meta=True, steps=2, seed=7001),
    # the model's own initialisation on meta (reset_parameters per unit under its seed)
    _branch(stage=2, precision="bf16", optimizer="adamw", meta=True, init="own", steps=2,
            seed=7004),
    # a model with buffers (BatchNorm statistics), broadcast from rank 0 before every forward
    _branch(stage=2, precision="fp32", optimizer="sgd", model="mlp-bn", steps=2, seed=7003),
    # fast mode + offload at stage 2: the running sum of reduced shards kept on the host
    _branch(stage=2, precision="bf16", optimizer="adamw", mode="fast", features=("offload",),
            steps=2, seed=7002),
)  # fmt: skip


def quick() -> tuple[list[Cell], list[dict]]:
    """The CI preset: (cells, invariance runs)."""
    cells = covering_cells(2) + slice_cells() + list(TEETH) + extras()[::3] + zero_r_cells()
    extra = list(BRANCHES) + list(PLANTED_GAPS) + list(COVERAGE_CELLS) + list(UNUSED)
    extra += list(interactions.CELLS) + feature_cells("quick")
    return cells + extra, invariance_runs(full=False)


def small() -> tuple[list[Cell], list[dict]]:
    """A part of --quick that runs in well under a minute (the notebook's small profile): the
    injected slice stage × N × precision at N ∈ {1, 2, 4}, its fast-mode twin at N = 2, the
    first TEETH cell, and the invariance table of bf16 at N ∈ {1, 2, 4}."""
    cells = [c for c in slice_cells() if c.world_size in (1, 2, 4)] + [TEETH[0]]
    cells += [c for c in slice_cells(mode="fast") if c.world_size == 2]
    runs = [{**r, "micro_batches": 4} for r in invariance_runs(full=False)]
    return cells, [r for r in runs if r["precision"] == "bf16"]


def extras() -> list[Cell]:
    """Options outside DIMENSIONS, each at a few points: stage 3's persistent small units
    (persist_below) and gradients reduced in the compute dtype (the paper's configuration)."""
    out = cells(
        stage=3,
        at=[
            {"world_size": 2, "precision": "bf16", "mode": "deterministic"},
            {"world_size": 3, "precision": "fp32", "mode": "deterministic"},
            {"world_size": 4, "precision": "fp16", "mode": "fast"},
        ],
        optimizer="adam",
        model="mlp",
        persist_below=1000,
        seed=4000,
    )
    # fp16 sums of injected fp16 values overflow at once (every step skipped, nothing tested);
    # the model's own gradients let the loss scaler find its level, over 5 steps
    for s, n, p, g in (
        (0, 2, "bf16", "random"),
        (1, 3, "fp16", "backward"),
        (2, 4, "bf16", "random"),
        (3, 8, "fp16", "backward"),
    ):
        row = {**DEFAULT_ROW, "stage": s, "world_size": n, "precision": p, "gradients": g}
        cell = cell_of(row, seed=4100 + s, steps=5 if g == "backward" else 3)
        out.append(dataclasses.replace(cell, reduce_dtype=p))
    return out


def complete() -> tuple[list[Cell], list[dict]]:
    """The release preset: (cells, invariance runs). Every 4-tuple of values (which holds
    every triple and pair), the slices stage × N × precision for each gradient source and for
    fast mode, the GPT (tied embedding and head) at every stage × precision for N ∈ {2, 3, 4},
    the extras, TEETH; invariance for every stage × precision × optimizer."""
    gpt_cells = cells(
        stage=STAGES, precision=PRECISIONS, world_size=(2, 3, 4), optimizer="adamw",
        mode="deterministic", model="gpt", accumulation=2, seed=3000,
    )  # fmt: skip
    out = covering_cells(4)
    for kind in ("random", "extreme", "nonfinite", "backward"):
        out += slice_cells(gradients=kind, accumulation=4 if kind == "random" else 1)
    out += slice_cells(mode="fast", sizes="even") + gpt_cells
    out += extras() + list(TEETH) + zero_r_cells((2, 3, 4)) + list(BRANCHES)
    out += list(PLANTED_GAPS) + list(COVERAGE_CELLS) + list(UNUSED)
    return out + list(interactions.CELLS) + feature_cells("complete"), invariance_runs(full=True)


def feature_cells(preset: str) -> list[Cell]:
    """The cells the feature registry adds to a preset (verify/features/), over _branch's
    defaults."""
    return [_branch(**fields) for fields in features.cells_for(preset)]
