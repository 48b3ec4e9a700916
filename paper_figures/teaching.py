"""The logic of the teaching notebooks: pictures of who holds which bytes, message tables,
exercise checkers, real gloo runs with timelines, and the measurements behind the claims.

Used by ``notebooks/03_zero_from_scratch.ipynb`` (ZeRO built step by step on the NumPy
simulation, reference/simulate.py, then the same steps on real gloo ranks) and by
``notebooks/00_claims_vs_measurements.ipynb`` (popular claims about ZeRO, each tested with a
measurement). The notebooks hold narrative, calls and plots; everything they compute is here, so
tests/test_teaching.py can test it.

Legend (ZeRO paper §5, DESIGN.md §2-§3):
    N       world size, the data-parallel degree N_d; ranks 0..N-1
    M       micro-batches per step over all ranks
    Ψ       parameters; Ψ_pad the padded count, N·ΣL, where L is a unit's shard length
    stage   0 baseline DP, 1 P_os, 2 P_os+g, 3 P_os+g+p
    block   a contiguous piece of one rank's buffers: (category, unit, shard), where `shard` is
            the rank whose 1/N slice of the unit it is. A replicated buffer is N blocks, one per
            shard; a partitioned one is the rank's own shard only.

[Note: counted bytes] Resident bytes are counted as reference/simulate.py and
ZeroEngine.memory_report count them: each buffer once (a view, such as the fp32 master inside an
fp32 working copy, owns nothing new), padding included, and the deterministic mode's extra
streaming-tree partial sums (shards) counted as gradients. The block pictures are built from the
buffers themselves and tests/test_teaching.py checks that their per-rank totals equal
World.resident_bytes and memory_report exactly.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from reference import Hyper, ModelSpec, StepConfig, bits, cast, init_state, train_step
from reference.optim import state_names
from reference.precision import DTYPES
from reference.simulate import World, reduce_scatter
from zero.memory import asymptotic_reduction, model_state_breakdown, reduction_factor

CATEGORIES = ("params", "grads", "master", "optimizer")
"""The model-state categories of DESIGN.md §3, in the order the pictures draw them."""

STAGE_NAMES = {0: "baseline DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


# ---------------------------------------------------------------------------------------------
# Bits


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """True when two name -> array dicts hold the same names and the same bits everywhere.

    Bits, not values: fp32 arrays are compared as .view(np.uint32), bf16/fp16 as uint16
    (reference.bits), so -0.0 != +0.0 and NaN payloads count."""
    if a.keys() != b.keys():
        return False
    return all(
        a[k].dtype == b[k].dtype and np.array_equal(bits(a[k]), bits(b[k])) for k in a.keys()
    )


def differing_elements(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> int:
    """How many elements differ in their bits (same names and shapes required)."""
    if a.keys() != b.keys():
        raise ValueError(f"names differ: {sorted(a)} vs {sorted(b)}")
    return int(sum(np.count_nonzero(bits(a[k]) != bits(b[k])) for k in a))


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


@dataclass(kw_only=True)
class SimRun:
    """A World after some steps, the single-process reference beside it, and the verdict."""

    world: World
    reference: object  # reference.step.TrainState after the same steps
    master_equal: bool  # World.full_master() == reference master, bit for bit
    opt_equal: bool  # World.full_opt() == reference optimizer states, bit for bit


def simulate(problem: ToyProblem, stage: int, *, mode: str = "deterministic", steps: int = 1):
    """Run `steps` steps on N simulated ranks and on the single-process reference.

    The World keeps the last step's message log (World.log) for message_table."""
    world = World(problem.master, problem.spec, problem.cfg, stage=stage, mode=mode)
    ref = init_state(problem.master, problem.spec, problem.cfg)
    for step in range(steps):
        grads = problem.grads(step)
        world.step(grads)
        ref, _ = train_step(ref, grads, problem.spec, problem.cfg)
    opt = world.full_opt()
    return SimRun(
        world=world,
        reference=ref,
        master_equal=same_bits(world.full_master(), ref.master),
        opt_equal=all(same_bits(opt[n], ref.opt[n]) for n in ref.opt),
    )


# ---------------------------------------------------------------------------------------------
# Who holds which bytes


@dataclass(frozen=True, kw_only=True)
class Block:
    """A contiguous piece of one rank's model states (see the module legend)."""

    rank: int
    category: str  # one of CATEGORIES
    unit: int
    shard: int  # whose 1/N slice of the unit this is
    nbytes: int
    partial: bool = False  # an extra streaming-tree partial sum (deterministic, M > N)


def _blocks_of(rank, category, unit, nbytes_full, size, full_size, n, rank_index) -> list[Block]:
    """A buffer of `size` elements out of a padded unit of `full_size`: all N shards if it is
    the whole unit, else this rank's own shard."""
    if size == full_size:
        per = nbytes_full // n
        return [
            Block(rank=rank, category=category, unit=unit, shard=s, nbytes=per) for s in range(n)
        ]
    if size * n != full_size:
        raise ValueError(
            f"unit {unit} {category}: {size} elements is neither the unit ({full_size}) nor a "
            f"1/{n} shard of it"
        )
    return [Block(rank=rank, category=category, unit=unit, shard=rank_index, nbytes=nbytes_full)]


def world_blocks(world: World) -> list[Block]:
    """Every block every simulated rank owns ([Note: counted bytes])."""
    out: list[Block] = []
    n = world.n
    for rk in world.ranks:
        seen: set[int] = set()  # ids of the arrays this rank already counted
        for u, L in enumerate(world.shard):
            full = n * L
            pieces = {
                "params": [rk.working[u]],
                "grads": [rk.grad[u]],
                "master": [rk.master[u]],
                "optimizer": list(rk.opt[u].values()),
            }
            for cat in CATEGORIES:
                for a in pieces[cat]:
                    # a view, or an array already counted in another role, owns nothing new
                    if a.base is None and id(a) not in seen:
                        seen.add(id(a))
                        out += _blocks_of(rk.rank, cat, u, a.nbytes, a.size, full, n, rk.rank)
            extra = rk.peak_partials[u] * L * world.red.itemsize
            if extra:
                out.append(
                    Block(
                        rank=rk.rank,
                        category="grads",
                        unit=u,
                        shard=rk.rank,
                        nbytes=extra,
                        partial=True,
                    )
                )
    return out


def engine_blocks(engine) -> list[Block]:
    """This rank's blocks in a ZeroEngine, counted as memory_report counts them (each storage
    once). Runs inside a rank; comm_buffers (transient) are not model states and not drawn."""
    out: list[Block] = []
    seen: set[int] = set()
    n, r = engine.world_size, engine.rank
    for u in engine.units:
        full = u.part.padded_numel
        pieces = {
            "params": [engine.impl.working_extent(u)[0]],
            "grads": [u.grad],
            "master": [u.master],
            "optimizer": list(u.opt.values()),
        }
        for cat in CATEGORIES:
            for t in pieces[cat]:
                ptr = t.untyped_storage().data_ptr()
                if ptr in seen:
                    continue
                seen.add(ptr)
                nbytes = t.untyped_storage().nbytes()
                out += _blocks_of(r, cat, u.index, nbytes, nbytes // t.element_size(), full, n, r)
        extra = engine.extra_partials[u.index] * u.part.shard_numel * u.grad.element_size()
        if extra:
            out.append(
                Block(rank=r, category="grads", unit=u.index, shard=r, nbytes=extra, partial=True)
            )
    return out


def bytes_by_rank(blocks: Sequence[Block]) -> dict[int, dict[str, int]]:
    """Per rank, per category, the bytes of its blocks (comparable with resident_bytes)."""
    out: dict[int, dict[str, int]] = {}
    for b in blocks:
        row = out.setdefault(b.rank, dict.fromkeys(CATEGORIES, 0))
        row[b.category] += b.nbytes
    return dict(sorted(out.items()))


def shard_colors(n: int):
    """One colour per shard owner: tab10 up to 10 ranks, then a continuous map."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if n <= 10 else "viridis")
    return [cmap(i if n <= 10 else i / max(1, n - 1)) for i in range(n)]


def draw_rank_bytes(blocks: Sequence[Block], *, title: str, ax=None):
    """Horizontal bars, one per (rank, category), made of coloured blocks: the colour says whose
    shard a block is, the white gaps separate units, hatching marks streaming partial sums.
    The bar's end is labelled with its bytes. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not blocks:
        raise ValueError("blocks: empty; nothing to draw")
    ranks = sorted({b.rank for b in blocks})
    n = max(max(b.shard for b in blocks), max(ranks)) + 1
    colors = shard_colors(n)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.32 * len(ranks) * len(CATEGORIES) + 1.6))
    rows, y = [], 0
    gap = 0.004 * max(sum(b.nbytes for b in blocks if b.rank == r) for r in ranks)
    for r in ranks:
        for cat in CATEGORIES:
            x = 0.0
            mine = [b for b in blocks if b.rank == r and b.category == cat]
            last_unit = None
            for b in sorted(mine, key=lambda b: (b.unit, b.partial, b.shard)):
                if last_unit is not None and b.unit != last_unit:
                    x += gap
                ax.barh(
                    -y,
                    b.nbytes,
                    left=x,
                    height=0.8,
                    color=colors[b.shard],
                    edgecolor="black",
                    linewidth=0.4,
                    hatch="//" if b.partial else None,
                )
                x += b.nbytes
                last_unit = b.unit
            total = sum(b.nbytes for b in mine)
            ax.text(x + gap, -y, f"{total / 1024:.1f} KiB", va="center", fontsize=7)
            rows.append(f"rank {r} · {cat}")
            y += 1
        y += 0.5
    ticks = [-(i + 0.5 * (i // len(CATEGORIES))) for i in range(len(rows))]
    ax.set_yticks(ticks, rows, fontsize=8)
    ax.set_xlabel("bytes held (padding included)")
    ax.set_title(title)
    handles = [Patch(color=colors[s], label=f"shard {s}") for s in range(n)]
    if any(b.partial for b in blocks):
        handles.append(
            Patch(facecolor="white", edgecolor="black", hatch="//", label="partial sums")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.margins(x=0.12)
    return ax


# ---------------------------------------------------------------------------------------------
# Messages


PHASE_DTYPE = {
    "grad": "reduction",
    "grad_gather": "reduction",
    "param_update": "compute",
    "param_fwd": "compute",
    "param_bwd": "compute",
    "norm": "float64",
    "overflow": "float32",
}
"""What each simulated message carries: gradients in the reduction dtype, parameters in the
compute dtype, norm partials in float64, the overflow flag as one float32."""


def _itemsize(world: World, phase: str) -> int:
    kind = PHASE_DTYPE[phase]
    if kind == "reduction":
        return world.red.itemsize
    if kind == "compute":
        return DTYPES[world.cfg.precision].itemsize
    return np.dtype(kind).itemsize


@dataclass(frozen=True, kw_only=True)
class MessageRow:
    """One kind of message a rank sent in a step, summed over units."""

    op: str
    phase: str
    kind: str  # "model" or "control"
    calls: int
    elements: int  # sent by this rank, padding included
    padding: int
    nbytes: int


def message_table(world: World, rank: int = 0) -> list[MessageRow]:
    """What `rank` sent in the World's last step, grouped by (op, phase), in first-sent order."""
    rows: dict[tuple[str, str, str], list[int]] = {}
    for s in world.log[rank]:
        key = (s.op, s.phase, s.kind)
        row = rows.setdefault(key, [0, 0, 0, 0])
        row[0] += 1
        row[1] += s.elements
        row[2] += s.padding
        row[3] += s.elements * _itemsize(world, s.phase)
    return [
        MessageRow(op=op, phase=ph, kind=k, calls=c, elements=e, padding=p, nbytes=b)
        for (op, ph, k), (c, e, p, b) in rows.items()
    ]


def padded_numel(world: World) -> int:
    """Ψ_pad: the padded parameter count, N·ΣL."""
    return world.n * sum(world.shard)


def volume_in_psi(elements: int, world_size: int, psi_padded: int) -> float:
    """Elements sent per rank in units of (N-1)/N·Ψ_pad: 2 for baseline DP at M = N."""
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: a volume in Ψ needs N >= 2 (N = 1 sends 0)")
    return elements * world_size / ((world_size - 1) * psi_padded)


def format_messages(rows: Sequence[MessageRow], *, world_size: int, psi_padded: int) -> str:
    """A Markdown table of message rows, with the model-state volume in units of (N-1)/N·Ψ."""
    lines = [
        "| collective | for | kind | calls | elements sent | of which padding | bytes "
        "| ×(N-1)/N·Ψ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        psi = (
            f"{volume_in_psi(r.elements, world_size, psi_padded):.3g}"
            if r.kind == "model" and world_size > 1
            else "—"
        )
        lines.append(
            f"| {r.op} | {r.phase} | {r.kind} | {r.calls} | {r.elements:,} | {r.padding:,} | "
            f"{r.nbytes:,} | {psi} |"
        )
    model = [r for r in rows if r.kind == "model"]
    total = sum(r.elements for r in model)
    if world_size > 1:
        lines.append(
            f"| **model states, total** | | | {sum(r.calls for r in model)} | {total:,} | "
            f"{sum(r.padding for r in model):,} | {sum(r.nbytes for r in model):,} | "
            f"**{volume_in_psi(total, world_size, psi_padded):.3g}** |"
        )
    return "\n".join(lines)


def format_memory(per_rank: dict[int, dict[str, int]]) -> str:
    """A Markdown table of resident bytes per rank and category, with the total."""
    lines = [
        "| rank | " + " | ".join(CATEGORIES) + " | total |",
        "|---" * (len(CATEGORIES) + 2) + "|",
    ]
    for r, row in per_rank.items():
        cells = [f"{row[c]:,}" for c in CATEGORIES]
        lines.append(f"| {r} | " + " | ".join(cells) + f" | {sum(row[c] for c in CATEGORIES):,} |")
    return "\n".join(lines)


def analytic_bytes(world: World) -> dict[str, int]:
    """zero.memory.model_state_breakdown for this World's configuration at Ψ_pad: what each
    rank should hold, by category (exact for the simulation, tests/test_simulate.py)."""
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


# ---------------------------------------------------------------------------------------------
# Exercise 1: the tree-ordered reduce-scatter


def reduce_scatter_cases(
    *, world_sizes: Sequence[int] = (2, 3, 4, 5, 6, 8), shard: int = 128, seed: int = 0
) -> list[list[np.ndarray]]:
    """For each N, the N ranks' padded bf16 gradient buffers (N·shard elements each) of one
    unit, with values spread over many magnitudes so that the summation order shows in the bits."""
    rng = np.random.default_rng([seed, 2])
    cases = []
    for n in world_sizes:
        scale = 10.0 ** rng.integers(-3, 3, size=(n, n * shard))
        cases.append([cast(rng.standard_normal(n * shard) * s, "bf16") for s in scale])
    return cases


def expected_reduce_scatter(bufs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The simulation's reduce-scatter (reference/simulate.py), the answer to exercise 1."""
    n = len(bufs)
    shard = bufs[0].size // n
    log: list[list] = [[] for _ in range(n)]
    return reduce_scatter(list(bufs), shard, [0] * n, log, phase="grad", unit=0, kind="model")


def left_to_right_reduce_scatter(bufs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """A plausible wrong answer: ((x_0 + x_1) + x_2) + ... in rank order, not the tree T."""
    n = len(bufs)
    shard = bufs[0].size // n
    out = []
    for r in range(n):
        acc = bufs[0][r * shard : (r + 1) * shard]
        for b in bufs[1:]:
            acc = acc + b[r * shard : (r + 1) * shard]
        out.append(acc)
    return out


@dataclass(frozen=True, kw_only=True)
class ExerciseResult:
    """The verdict of an exercise checker."""

    attempted: bool  # False: the student's function raised NotImplementedError
    passed: bool  # the checked function (the student's, or the fallback) gave the exact answer
    lines: tuple[str, ...]  # what was checked, one line per case

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _run_exercise(candidate, fallback, check_one, cases, what: str) -> ExerciseResult:
    """Shared driver: try the student's function on every case; if it is not written yet
    (NotImplementedError), check the fallback (the solution) instead and say so, so that the
    notebook still runs headless. A failing fallback raises: the solution itself is broken."""
    lines: list[str] = []
    fn, attempted = candidate, True
    try:
        first = check_one(candidate, cases[0][0])
    except NotImplementedError:
        if fallback is None:
            return ExerciseResult(attempted=False, passed=False, lines=(f"{what}: not attempted",))
        fn, attempted = fallback, False
        lines.append(f"{what}: not attempted yet (NotImplementedError); checking the solution")
        first = check_one(fn, cases[0][0])
    passed = True
    for i, (args, label) in enumerate(cases):
        ok, detail = first if i == 0 else check_one(fn, args)
        passed &= ok
        lines.append(f"  {'PASS' if ok else 'FAIL'} {label}: {detail}")
    lines.append(f"{what}: {'every case passes' if passed else 'some cases fail'}")
    result = ExerciseResult(attempted=attempted, passed=passed, lines=tuple(lines))
    if not attempted and not passed:
        raise AssertionError("the solution fails its own checks:\n" + str(result))
    return result


def check_reduce_scatter(candidate: Callable, *, fallback: Callable | None = None, cases=None):
    """Exercise 1: candidate(bufs) -> list of N shards; rank r's must be the tree T over ranks
    0..N-1 of slice r, bit for bit (compared as unsigned integers)."""
    cases = reduce_scatter_cases() if cases is None else cases

    def check_one(fn, args):
        (bufs,) = args
        want = expected_reduce_scatter(bufs)
        got = fn([b.copy() for b in bufs])
        if len(got) != len(want):
            return False, f"returned {len(got)} shards, expected {len(want)}"
        bad = 0
        for g, w in zip(got, want):
            g = np.asarray(g)
            if g.dtype != w.dtype or g.shape != w.shape:
                return (
                    False,
                    f"a shard has dtype {g.dtype} shape {g.shape}, want {w.dtype} {w.shape}",
                )
            bad += int(np.count_nonzero(bits(g) != bits(w)))
        naive = left_to_right_reduce_scatter(bufs)
        naive_bad = sum(int(np.count_nonzero(bits(a) != bits(w))) for a, w in zip(naive, want))
        return bad == 0, (
            f"{bad} of {bufs[0].size} elements differ (a left-to-right sum: {naive_bad} differ)"
        )

    labelled = [((c,), f"N = {len(c)}") for c in cases]
    return _run_exercise(candidate, fallback, check_one, labelled, "reduce-scatter")


# ---------------------------------------------------------------------------------------------
# Exercise 2: per-rank memory


def check_resident_bytes(
    candidate: Callable, *, fallback: Callable | None = None, world_sizes=(1, 2, 4, 8)
):
    """Exercise 2: candidate(stage, world_size, padded_numel) -> {category: bytes} for the
    toy problem's configuration (bf16 parameters and gradients, fp32 master, AdamW, M = N),
    compared exactly with what every simulated rank holds after one step."""
    cases = []
    for n in world_sizes:
        problem = toy_problem(world_size=n)
        for stage in range(4):
            cases.append(((stage, n, problem), f"stage {stage}, N = {n}"))

    def check_one(fn, args):
        stage, n, problem = args
        world = simulate(problem, stage).world
        got = dict(fn(stage, n, padded_numel(world)))
        for r in range(n):
            want = world.resident_bytes(r)
            if got != want:
                return False, f"rank {r} holds {want}, you said {got}"
        return True, f"every rank holds {got}"

    return _run_exercise(candidate, fallback, check_one, cases, "resident bytes")


# ---------------------------------------------------------------------------------------------
# Real ranks: zero/ on gloo


@dataclass(frozen=True, kw_only=True)
class Job:
    """One engine run inside a gloo world: what to train and what to record."""

    stage: int
    deterministic: bool = True
    micro_batches: int | None = None  # M; None means M = N
    steps: int = 1
    overlap: bool = True
    precision: str = "bf16"
    reduce_dtype: str | None = "bf16"
    n_layer: int = 2
    n_embd: int = 32
    block_size: int = 16
    batch_size: int = 4
    trace: bool = False  # FLOPs per micro-step (step 0), compute intervals (last step)
    reference_grads: bool = False  # rank 0 returns the single-process micro-batch gradients

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r}: allowed are 0, 1, 2, 3")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps!r}: must be >= 1")
        if self.trace and self.steps < 2:
            raise ValueError(
                f"steps={self.steps} with trace=True: tracing needs >= 2 steps (FLOPs are "
                "counted in the first, the timeline is taken in the last)"
            )


@dataclass(kw_only=True)
class RankRun:
    """What one rank measured in one Job (plain data: it crosses the process boundary)."""

    rank: int
    world_size: int
    stage: int
    volume: list[tuple[int, int]]  # per step: model-state (elements, padding) sent
    control: list[tuple[int, int]]  # per step: control traffic
    counts: list[dict[str, int]]  # per step: calls per op (model states)
    memory: dict[str, int]  # memory_report() after the last step
    blocks: list[Block]
    master: dict[str, np.ndarray]  # full fp32 master after the last step, by name
    losses: list[float]
    records: list[dict] = field(default_factory=list)  # CommRecords of the last step
    events: list[dict] = field(default_factory=list)  # compute intervals of the last step
    flops: list[int] = field(default_factory=list)  # per micro-step of step 0 (trace)
    unit_names: list[str] = field(default_factory=list)  # by unit index; "root" for the root
    shards: list[int] = field(default_factory=list)  # L per unit
    numel: int = 0  # Ψ, real parameters
    deterministic: bool = True
    micro_batches: int = 0  # M
    # rank 0 with reference_grads only:
    grads: list[list[dict[str, np.ndarray]]] | None = None  # per step, per micro-batch
    spec: ModelSpec | None = None
    step_config: StepConfig | None = None
    init: dict[str, np.ndarray] | None = None
    single_process_flops: int | None = None  # one micro-batch, forward + backward, plain model

    @property
    def psi_padded(self) -> int:
        """Ψ_pad = N·ΣL, the padded parameter count the volumes are measured against."""
        return self.world_size * sum(self.shards)


def _gpt_config(job: Job):
    from zero.models import GPTConfig

    return GPTConfig(
        vocab_size=64, block_size=job.block_size, n_layer=job.n_layer, n_head=2, n_embd=job.n_embd
    )


def _zero_config(job: Job, units, world_size: int):
    from zero.config import ZeroConfig, decay_matrices_only

    return ZeroConfig(
        stage=job.stage,
        precision=job.precision,
        reduce_dtype=job.reduce_dtype,
        deterministic=job.deterministic,
        optimizer="adamw",
        groups=(Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=2e-2)),
        group_of=decay_matrices_only,
        micro_batches=world_size if job.micro_batches is None else job.micro_batches,
        clip_norm=1.0,
        units=tuple(units),
        overlap=job.overlap,
        chunk=128,
    )


def _attach_tracer(model, unit_names, events: list):
    """Forward and backward hooks on each unit that append compute intervals to `events`.
    Registered after the engine's own hooks, so a stage-3 gather happens before the clock starts."""
    mods = dict(model.named_modules())
    now = time.perf_counter
    for name in unit_names:
        m = mods[name]
        m.register_forward_pre_hook(
            lambda _m, _a, n=name: events.append(["forward", n, now(), None])
        )
        m.register_forward_hook(lambda _m, _a, _o, n=name: _close(events, "forward", n, now()))
        m.register_full_backward_pre_hook(
            lambda _m, _g, n=name: events.append(["backward", n, now(), None])
        )
        m.register_full_backward_hook(
            lambda _m, _gi, _go, n=name: _close(events, "backward", n, now())
        )


def _close(events: list, phase: str, name: str, t: float) -> None:
    for e in reversed(events):
        if e[0] == phase and e[1] == name and e[3] is None:
            e[3] = t
            return


def _run_job(rank: int, world_size: int, job: Job) -> RankRun:
    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from reference import working_copy
    from verify.compare import to_numpy
    from verify.harness import microbatch_grads
    from zero.engine import ZeroEngine
    from zero.models import GPT, gpt_microbatches

    torch.set_num_threads(1)
    gcfg = _gpt_config(job)
    model = GPT(gcfg, seed=0)
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    cfg = _zero_config(job, model.unit_names(), world_size)
    eng = ZeroEngine(model, cfg)
    m, per_rank = cfg.micro_batches, cfg.micro_batches // world_size
    names = {u.index: (u.name or "root") for u in eng.units}
    events: list = []
    if job.trace:
        _attach_tracer(model, model.unit_names(), events)
    want_grads = job.reference_grads and rank == 0
    run = RankRun(
        rank=rank,
        world_size=world_size,
        stage=job.stage,
        volume=[],
        control=[],
        counts=[],
        memory={},
        blocks=[],
        master={},
        losses=[],
        unit_names=[names[i] for i in sorted(names)],
        shards=[u.part.shard_numel for u in eng.units],
        numel=sum(u.numel for u in eng.units),
        deterministic=job.deterministic,
        micro_batches=m,
    )
    if want_grads:
        spec = ModelSpec.build(eng.unit_specs(), eng.group_index, chunk=cfg.chunk)
        rcfg = cfg.step_config(world_size)
        ref, ref_model = init_state(init, spec, rcfg), GPT(gcfg, seed=0)
        run.grads, run.spec, run.step_config, run.init = [], spec, rcfg, init
    for step in range(job.steps):
        batches = gpt_microbatches(gcfg, seed=0, data_step=step, count=m, batch_size=job.batch_size)
        if want_grads:
            work = working_copy(ref, rcfg)
            grads = [microbatch_grads(ref_model, work, b, cfg.compute_dtype, None) for b in batches]
            run.grads.append(grads)
            ref, _ = train_step(ref, grads, spec, rcfg)
        # Tracing: FLOPs are counted in step 0 and the timeline is taken in the last step, so
        # the counter's dispatch overhead (and first-use costs) stay out of the timeline.
        count_flops, last = job.trace and step == 0, step == job.steps - 1
        if last:
            if world_size > 1:
                dist.barrier()  # the ranks start the timed step together (not counted traffic)
            events.clear()
            t0 = time.perf_counter()
        for k in range(per_rank):
            batch = batches[k * world_size + rank]
            with FlopCounterMode(display=False) if count_flops else nullcontext() as fc:
                _, loss = eng(*batch)
                eng.backward(loss)
            if count_flops:
                run.flops.append(int(fc.get_total_flops()))
        t_step = time.perf_counter()
        result = eng.step()
        if last:
            events.append(["step", "optimizer step", t_step, time.perf_counter()])
        run.losses.append(result.loss)
        s = eng.counter.step - 1
        run.volume.append(eng.counter.volume(s))
        run.control.append(eng.counter.volume(s, kind="control"))
        run.counts.append(eng.counter.counts(s))
    s = eng.counter.step - 1
    run.records = [
        {
            "op": r.op,
            "phase": r.phase,
            "kind": r.kind,
            "unit": r.unit,
            "unit_name": None if r.unit is None else names[r.unit],
            "elements": r.elements,
            "nbytes": r.nbytes,
            "start": r.start - t0,
            "end": None if r.end is None else r.end - t0,
        }
        for r in eng.counter.records
        if r.step == s
    ]
    run.events = [
        {"phase": p, "name": nm, "start": a - t0, "end": b - t0}
        for p, nm, a, b in events
        if b is not None
    ]
    run.memory = eng.memory_report()
    run.blocks = engine_blocks(eng)
    master, _ = eng.gather_state()
    run.master = {k: to_numpy(v).copy() for k, v in master.items()}
    if job.trace and rank == 0:
        plain = GPT(gcfg, seed=0)
        batch = gpt_microbatches(gcfg, seed=0, data_step=0, count=1, batch_size=job.batch_size)[0]
        with FlopCounterMode(display=False) as fc:
            _, loss = plain(*batch)
            loss.backward()
        run.single_process_flops = int(fc.get_total_flops())
    return run


def _run_jobs(rank: int, world_size: int, jobs: Sequence[Job]) -> list[RankRun]:
    return [_run_job(rank, world_size, job) for job in jobs]


def _warm_up(job: Job) -> None:
    """Import, in this process, what every rank would otherwise import for itself after the
    fork: building a module on the meta device imports torch._dynamo (about 3 s), and forked
    ranks inherit what the parent has imported."""
    import torch.utils.flop_counter  # noqa: F401

    import verify.harness  # noqa: F401
    from zero.models import GPT

    GPT(_gpt_config(job), seed=0)


def run_on_gloo(jobs: Sequence[Job], world_size: int, *, timeout_s: float = 300):
    """Run every job, in order, on `world_size` local gloo ranks (one forked world for all
    of them, zero.launch.spawn). Returns runs[job][rank] of RankRun."""
    from zero.launch import spawn

    jobs = list(jobs)
    for j in jobs:
        if not isinstance(j, Job):
            raise ValueError(f"jobs: {j!r} is not a Job")
    _warm_up(jobs[0])
    per_rank = spawn(_run_jobs, world_size, jobs, timeout_s=timeout_s)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(jobs))]


def simulate_engine_run(run: RankRun, mode: str = "deterministic") -> SimRun:
    """The NumPy simulation of the same steps: rank 0's spec, start values and single-process
    gradients (a Job with reference_grads=True), on N simulated ranks."""
    if run.grads is None:
        raise ValueError("run: has no gradients; run its Job with reference_grads=True on rank 0")
    world = World(run.init, run.spec, run.step_config, stage=run.stage, mode=mode)
    ref = init_state(run.init, run.spec, run.step_config)
    for grads in run.grads:
        world.step(grads)
        ref, _ = train_step(ref, grads, run.spec, run.step_config)
    opt = world.full_opt()
    return SimRun(
        world=world,
        reference=ref,
        master_equal=same_bits(world.full_master(), ref.master),
        opt_equal=all(same_bits(opt[n], ref.opt[n]) for n in ref.opt),
    )


def root_gather_saving(world: World, rank: int) -> tuple[int, int]:
    """(elements, padding) of one all-gather of the root unit (unit 0) by `rank`: what the
    engine saves per micro-step at stage 3 by keeping the root gathered from its first use in
    forward to its last in backward, where the simulation gathers it twice."""
    n, L = world.n, world.shard[0]
    return (n - 1) * L, (n - 1) * world.padding[0][rank]


def stage_report(run: SimRun, *, rank: int = 0) -> str:
    """Markdown for one step of notebook 03: the messages `rank` sent, every rank's bytes with
    the analytic model beside them, and the bitwise verdict against the reference."""
    w = run.world
    held = {r: w.resident_bytes(r) for r in range(w.n)}
    want = analytic_bytes(w)
    total, expected = sum(held[rank].values()), sum(want.values())
    ok = "equal" if run.master_equal and run.opt_equal else "**NOT equal**"
    return "\n\n".join(
        [
            f"**Messages rank {rank} sent in the last step** (Ψ_pad = {padded_numel(w):,}, "
            f"N = {w.n}):",
            format_messages(message_table(w, rank), world_size=w.n, psi_padded=padded_numel(w)),
            "**Bytes each rank holds** (counted from its buffers):",
            format_memory(held),
            f"Analytic model (zero.memory.model_state_breakdown at Ψ_pad): {want} = "
            f"{expected:,} bytes; measured/expected = {total / expected:.4f}.",
            f"**Against the single-process reference** (reference/step.py `train_step`, the same "
            f"micro-batch gradients): fp32 master and optimizer states {ok}, bit for bit "
            "(compared as `.view(np.uint32)`).",
        ]
    )


@dataclass(frozen=True, kw_only=True)
class StageSummary:
    """One simulated step of every stage on the same problem, as rank 0 sees it."""

    held: dict[int, dict[str, int]]  # stage -> bytes by category, counted from the buffers
    expected: dict[int, int]  # stage -> analytic total (zero.memory)
    volume: dict[int, float]  # stage -> model-state elements sent / ((N-1)/N·Ψ_pad)

    def table(self) -> str:
        """Markdown: per stage, bytes held, measured/expected and the volume."""
        lines = [
            "| stage | bytes rank 0 holds | measured/expected | volume ×(N-1)/N·Ψ_pad |",
            "|---|---|---|---|",
        ]
        for s, held in self.held.items():
            total = sum(held.values())
            lines.append(
                f"| {s}: {STAGE_NAMES[s]} | {total:,} | {total / self.expected[s]:.4f} | "
                f"{self.volume[s]:.3f} |"
            )
        return "\n".join(lines)


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


def all_blocks(runs: Sequence[RankRun]) -> list[Block]:
    """The blocks of every rank of one Job, for draw_rank_bytes."""
    return [b for run in runs for b in run.blocks]


@dataclass(frozen=True, kw_only=True)
class EngineCheck:
    """One stage of notebook 03's last section: zero/ on gloo against the simulation."""

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
    lines = [
        "| stage | engine = reference (bits, every rank) | simulation = reference | "
        "rank 0 sent: engine | simulation | root gathers saved | traffic equal (every rank) | "
        "rank 0 bytes: engine | simulation | memory equal (every rank) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.stage}: {STAGE_NAMES[c.stage]} | {yes[c.engine_equals_reference]} | "
            f"{yes[c.simulation_equals_reference]} | {c.engine_sent[0]:,} | "
            f"{c.simulation_sent[0]:,} | {c.root_saving[0]:,} | {yes[c.traffic_matches]} | "
            f"{sum(c.engine_bytes.values()):,} | {sum(c.simulation_bytes.values()):,} | "
            f"{yes[c.memory_matches]} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Timelines


@dataclass(frozen=True, kw_only=True)
class Interval:
    """One bar of a timeline, in seconds from the start of the traced micro-steps."""

    lane: str  # "compute" or "communication"
    label: str
    start: float
    end: float
    kind: str  # forward, backward, step, or the collective's phase


def timeline(run: RankRun) -> list[Interval]:
    """A rank's compute intervals (unit forward/backward, the optimizer step) and its
    collectives (launch to completion, model and control), sorted by start time.

    A collective's end is when the engine completed it (waited for it): with overlap on, the
    transfer itself may have finished earlier, never later."""
    out = [
        Interval(lane="compute", label=e["name"], start=e["start"], end=e["end"], kind=e["phase"])
        for e in run.events
    ]
    for r in run.records:
        if r["end"] is None:
            continue
        label = r["op"] + ("" if r["unit_name"] is None else f" {r['unit_name']}")
        out.append(
            Interval(
                lane="communication",
                label=label,
                start=r["start"],
                end=r["end"],
                kind=r["phase"] if r["kind"] == "model" else "control",
            )
        )
    return sorted(out, key=lambda i: (i.start, i.end))


def overlap_seconds(intervals: Sequence[Interval], *, comm_phase: str, compute_kind: str) -> float:
    """Seconds during which some collective of `comm_phase` was in flight while some compute
    interval of `compute_kind` ran (union of intersections, so nothing is counted twice)."""
    comm = [
        (i.start, i.end) for i in intervals if i.lane == "communication" and i.kind == comm_phase
    ]
    comp = [(i.start, i.end) for i in intervals if i.lane == "compute" and i.kind == compute_kind]
    pieces = sorted(
        (max(a, c), min(b, d)) for a, b in comm for c, d in comp if min(b, d) > max(a, c)
    )
    total, cur_a, cur_b = 0.0, None, None
    for a, b in pieces:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


TIMELINE_COLORS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "step": "tab:green",
    "grad": "tab:red",
    "grad_gather": "tab:pink",
    "param_update": "tab:purple",
    "param_fwd": "tab:cyan",
    "param_bwd": "tab:olive",
    "control": "tab:gray",
}


def _rows(items: Sequence[Interval]) -> list[int]:
    """Greedy sub-rows so that intervals that overlap in time (collectives in flight together)
    are drawn one above the other, never on top of each other."""
    ends: list[float] = []
    rows = []
    for iv in items:
        row = next((k for k, e in enumerate(ends) if e <= iv.start), len(ends))
        if row == len(ends):
            ends.append(iv.end)
        else:
            ends[row] = iv.end
        rows.append(row)
    return rows


def draw_timeline(runs: Sequence[RankRun], *, title: str, ax=None):
    """One compute lane and one communication lane per rank; milliseconds on the x axis."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.0 + 1.1 * len(runs)))
    ticks, labels, seen = [], [], set()
    for i, run in enumerate(runs):
        for j, lane in enumerate(("compute", "communication")):
            y = -(2.4 * i + j)
            ticks.append(y)
            labels.append(f"rank {run.rank} · {lane}")
            items = [iv for iv in timeline(run) if iv.lane == lane]
            rows = _rows(items)
            h = 0.8 / max(1, max(rows, default=0) + 1)
            for iv, row in zip(items, rows):
                ax.barh(
                    y + 0.4 - h * (row + 0.5),
                    1e3 * (iv.end - iv.start),
                    left=1e3 * iv.start,
                    height=h,
                    color=TIMELINE_COLORS.get(iv.kind, "black"),
                    edgecolor="black",
                    linewidth=0.3,
                )
                seen.add(iv.kind)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("time since the first forward of the traced step (ms)")
    ax.set_title(title)
    ax.legend(
        handles=[Patch(color=TIMELINE_COLORS[k], label=k) for k in TIMELINE_COLORS if k in seen],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    return ax


# ---------------------------------------------------------------------------------------------
# Measurements behind the claims (notebooks/00_claims_vs_measurements.ipynb)


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


@dataclass(frozen=True, kw_only=True)
class SyncPoints:
    """When, in a traced step of one rank, the gradient became whole and the step ended."""

    last_grad_end: float  # the last gradient reduction completed
    first_control_start: float  # the step's control exchange (every rank takes part) began
    step_end: float  # engine.step() returned
    last_comm_end: float  # every collective of the step completed
    overlapped: float  # seconds of backward compute with a gradient reduction in flight
    backward: float  # seconds of backward compute


def sync_points(run: RankRun) -> SyncPoints:
    """Read the synchronisation structure of a traced step off its timeline."""
    iv = timeline(run)
    grads = [i for i in iv if i.lane == "communication" and i.kind == "grad"]
    control = [i for i in iv if i.lane == "communication" and i.kind == "control"]
    steps = [i for i in iv if i.kind == "step"]
    if not grads or not control or not steps:
        raise ValueError("run: not a traced run with gradient reductions (Job(trace=True))")
    comm = [i for i in iv if i.lane == "communication"]
    return SyncPoints(
        last_grad_end=max(i.end for i in grads),
        first_control_start=min(i.start for i in control),
        step_end=max(i.end for i in steps),
        last_comm_end=max(i.end for i in comm),
        overlapped=overlap_seconds(iv, comm_phase="grad", compute_kind="backward"),
        backward=sum(i.end - i.start for i in iv if i.kind == "backward"),
    )


def forward_calls(run: RankRun) -> dict[str, int]:
    """How many times each (non-root) unit ran forward on this rank in the traced step."""
    out: dict[str, int] = {}
    for e in run.events:
        if e["phase"] == "forward":
            out[e["name"]] = out.get(e["name"], 0) + 1
    return out


def gathers_per_unit(run: RankRun) -> dict[str, dict[str, int]]:
    """Stage 3: per unit, how many parameter all-gathers this rank issued in the last step, for
    forward (param_fwd) and for backward (param_bwd)."""
    out = {name: {"param_fwd": 0, "param_bwd": 0} for name in run.unit_names}
    for r in run.records:
        if r["phase"] in ("param_fwd", "param_bwd"):
            out[r["unit_name"]][r["phase"]] += 1
    return out


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
    """Markdown: per stage, the simulated reduction at each N beside zero.memory's formula, and
    the formula and the paper's asymptote at N_d = 1024."""
    head = " | ".join(f"N = {n}" for n in world_sizes)
    lines = [
        f"| stage | | {head} | N_d = 1024 | asymptote |",
        "|---|---|" + "---|" * len(world_sizes) + "---|---|",
    ]
    for stage, values in measured.items():
        formula = [reduction_factor(n, stage) for n in world_sizes]
        far = f"{reduction_factor(1024, stage):.2f}×"
        limit = f"{asymptotic_reduction(stage, world_size=1024):g}×"
        lines.append(
            f"| {STAGE_NAMES[stage]} | simulated | "
            + " | ".join(f"{v:.3f}" for v in values)
            + f" | {far} | {limit} |"
        )
        lines.append("| | formula | " + " | ".join(f"{v:.3f}" for v in formula) + " | | |")
    return "\n".join(lines)


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
    lines = [
        "| | " + " | ".join(f"stage {s}: {STAGE_NAMES[s]}" for s in stages) + " |",
        "|---" * (len(stages) + 1) + "|",
    ]
    for label, row in series.items():
        cells = [f"{row[s]:.{digits}f}" if s in row else "—" for s in stages]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_units(per_unit: dict[str, dict[str, float]], *, digits: int = 3) -> str:
    """Markdown: one row per series, one column per unit."""
    names = list(next(iter(per_unit.values())))
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, row in per_unit.items():
        lines.append(f"| {label} | " + " | ".join(f"{row[u]:.{digits}f}" for u in names) + " |")
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------------------------
# Figures (each returns its axes; the notebooks save them with save_figure)


def draw_stage_memory(
    per_stage: dict[int, dict[str, int]],
    *,
    title: str,
    ax=None,
    expected: dict[int, int] | None = None,
):
    """Stacked bars of one rank's bytes by category, one bar per stage; diamonds mark an
    expected total (e.g. zero.memory's analytic model) where given."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    stages = sorted(per_stage)
    x = np.arange(len(stages))
    bottom = np.zeros(len(stages))
    for cat in CATEGORIES:
        h = np.array([per_stage[s][cat] for s in stages], dtype=float) / 1024
        ax.bar(x, h, bottom=bottom, label=cat, width=0.6)
        bottom += h
    if expected:
        ax.plot(
            x, [expected[s] / 1024 for s in stages], "D", color="black", label="expected (analytic)"
        )
    for xi, total in zip(x, bottom):  # above the diamond, which sits on the bar's top
        ax.annotate(
            f"{total:.1f}",
            (xi, total),
            xytext=(0, 7),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, [f"{s}: {STAGE_NAMES[s]}" for s in stages])
    ax.set_xlabel("ZeRO stage")
    ax.set_ylabel("bytes per rank (KiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.margins(y=0.12)
    return ax


def draw_stage_volume(
    measured: dict[str, dict[int, float]],
    *,
    title: str,
    ax=None,
    paper: dict[int, float] | None = None,
):
    """Grouped bars: per stage, each series' model-state volume in units of (N-1)/N·Ψ; black
    bars mark the paper's 2Ψ / 2Ψ / 2Ψ / 3Ψ where given."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    stages = sorted({s for series in measured.values() for s in series})
    x = np.arange(len(stages))
    width = 0.8 / (len(measured) + (paper is not None))
    for i, (label, series) in enumerate(measured.items()):
        vals = [series.get(s, np.nan) for s in stages]
        bars = ax.bar(x + i * width, vals, width=width, label=label)
        ax.bar_label(
            bars, fmt="%.2f", fontsize=7, rotation=90 if len(measured) > 3 else 0, padding=2
        )
    if paper is not None:
        bars = ax.bar(
            x + len(measured) * width,
            [paper[s] for s in stages],
            width=width,
            color="black",
            label="paper (§7)",
        )
        ax.bar_label(bars, fmt="%g", fontsize=7)
    ax.set_xticks(x + 0.4 - width / 2, [f"{s}: {STAGE_NAMES[s]}" for s in stages])
    ax.set_xlabel("ZeRO stage")
    ax.set_ylabel("elements sent per rank per step / ((N-1)/N·Ψ)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    return ax


def draw_flops(per_rank: dict[str, list[int]], *, single_process: int, title: str, ax=None):
    """Bars of FLOPs per rank per micro-batch for each series, beside the single-process
    model's FLOPs on one micro-batch and what an N-way split of the model would leave."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    labels, values, colors = [], [], []
    for i, (series, flops) in enumerate(per_rank.items()):
        for r, f in enumerate(flops):
            labels.append(f"{series}\nrank {r}")
            values.append(f / 1e6)
            colors.append(f"C{i}")
    n = max(len(f) for f in per_rank.values())
    labels += ["one process,\nwhole model", f"model split\n{n} ways"]
    values += [single_process / 1e6, single_process / n / 1e6]
    colors += ["black", "lightgray"]
    bars = ax.bar(range(len(values)), values, color=colors, edgecolor="black", linewidth=0.4)
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("MFLOP per micro-batch (forward + backward)")
    ax.set_xlabel("who computes")
    ax.set_title(title)
    ax.margins(y=0.12)
    return ax


def draw_reduction(
    measured: dict[int, Sequence[float]],
    *,
    world_sizes: Sequence[int],
    title: str,
    max_world_size: int = 1024,
    ax=None,
    k: float = 12,
):
    """The memory reduction over baseline DP against N_d: zero.memory.reduction_factor as
    lines, the paper's asymptotes (4×, 8×, N_d×) dashed, and measured points."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    top = max(max_world_size, *world_sizes)
    dense = np.unique(np.round(np.geomspace(1, top, 60)).astype(int))
    for stage in (1, 2, 3):
        color = f"C{stage}"
        ax.plot(
            dense,
            [reduction_factor(int(n), stage, k=k) for n in dense],
            color=color,
            label=f"{STAGE_NAMES[stage]}: formula",
        )
        if stage == 3:
            ax.annotate(
                "N_d×",
                (dense[-1], float(dense[-1])),
                xytext=(-30, 0),
                textcoords="offset points",
                color=color,
                fontsize=8,
                va="center",
            )
        else:
            a = asymptotic_reduction(stage, k=k)
            ax.axhline(a, color=color, linestyle="--", linewidth=0.8)
            ax.text(dense[0], a * 1.05, f"asymptote {a:g}×", color=color, fontsize=8)
        if stage in measured:
            ax.plot(
                world_sizes,
                measured[stage],
                "o",
                color=color,
                markeredgecolor="black",
                label=f"{STAGE_NAMES[stage]}: simulated ranks",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ticks = [2**i for i in range(0, int(np.log2(top)) + 1, 2)]
    ax.set_yticks(ticks, [f"{t}×" for t in ticks])
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("data-parallel degree N_d")
    ax.set_ylabel("baseline bytes / stage bytes (per rank)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax


def draw_invariance(differing: dict[str, dict[int, int]], *, numel: int, title: str, ax=None):
    """Per mode, how many parameters differ in their bits from the N = 1 run, against N."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    ns = sorted({n for series in differing.values() for n in series})
    x = np.arange(len(ns))
    width = 0.8 / len(differing)
    for i, (label, series) in enumerate(differing.items()):
        bars = ax.bar(x + i * width, [series[n] for n in ns], width=width, label=label)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(x + 0.4 - width / 2, [f"N = {n}" for n in ns])
    ax.set_xlabel("world size")
    ax.set_ylabel(f"parameters whose bits differ from N = 1 (of {numel:,})")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    return ax


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
            lambda c: sum(c.engine_bytes.values()),
            lambda c: sum(c.simulation_bytes.values()),
        ),
        ("elements sent", lambda c: c.engine_sent[0], lambda c: c.simulation_sent[0]),
    )
    for ax, (what, engine, sim) in zip(axes, panels):
        for j, (label, get) in enumerate((("zero/ on gloo", engine), ("NumPy simulation", sim))):
            bars = ax.bar(x + 0.4 * j, [get(c) for c in checks], width=0.4, label=label)
            ax.bar_label(bars, fontsize=6, fmt="%d")
        ax.set_xticks(x + 0.2, [f"{c.stage}: {STAGE_NAMES[c.stage]}" for c in checks], fontsize=8)
        ax.set_xlabel("ZeRO stage")
        ax.set_ylabel(f"{what}, rank 0")
        ax.set_title(f"{title}: {what}")
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    return axes


# ---------------------------------------------------------------------------------------------
# Saving figures


def save_figure(fig, name: str, directory: str | Path = "figures") -> Path:
    """Save `fig` as directory/name.png atomically (zero.results.write_atomic): a reader never
    sees half a PNG."""
    from zero.results import write_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return write_atomic(Path(directory) / f"{name}.png", buf.getvalue())
