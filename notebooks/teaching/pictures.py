"""Who holds which bytes, and who sends which messages: the block pictures of notebook 02 and
its message and memory tables, for simulated ranks (reference/simulate.py) and real ones
(zero.engine.ZeroEngine).

Legend: see the package docstring; a *block* is (category, unit, shard) of one rank's buffers.

[Note: counted bytes] Resident bytes are counted as reference/simulate.py and
ZeroEngine.memory_report count them: each buffer once (a view, such as the fp32 master inside an
fp32 working copy, owns nothing new), padding included, and the deterministic mode's extra
streaming-tree partial sums (shards) counted as gradients. The block pictures are built from the
buffers themselves; tests/unit/test_teaching.py and tests/distributed/test_teaching.py check that
their per-rank totals equal World.resident_bytes and memory_report exactly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.precision import DTYPES
from reference.simulate import World

from .common import CATEGORIES, axes_or_new, markdown_table, volume_in_psi

# ---------------------------------------------------------------------------------------------
# Who holds which bytes


@dataclass(frozen=True, kw_only=True)
class Block:
    """A contiguous piece of one rank's model states (see the package legend)."""

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


Buffer = tuple[Hashable | None, int, int]
"""(storage key, bytes, elements) of one buffer; the key is None for a view, which owns nothing."""


def _unit_blocks(
    rank: int,
    unit: int,
    *,
    n: int,
    full_size: int,
    buffers: dict[str, list[Buffer]],
    seen: set,
    partial_nbytes: int,
) -> list[Block]:
    """One rank's blocks of one unit ([Note: counted bytes]). `seen` holds the storage keys the
    rank already counted: an array that plays two roles (the fp32 master that is the working
    copy) is counted once, in the first category that holds it."""
    out: list[Block] = []
    for cat in CATEGORIES:
        for key, nbytes, size in buffers[cat]:
            if key is None or key in seen:
                continue
            seen.add(key)
            out += _blocks_of(rank, cat, unit, nbytes, size, full_size, n, rank)
    if partial_nbytes:
        out.append(
            Block(
                rank=rank,
                category="grads",
                unit=unit,
                shard=rank,
                nbytes=partial_nbytes,
                partial=True,
            )
        )
    return out


def world_blocks(world: World) -> list[Block]:
    """Every block every simulated rank owns ([Note: counted bytes])."""

    def buffer(a: np.ndarray) -> Buffer:
        return (id(a) if a.base is None else None, a.nbytes, a.size)

    out: list[Block] = []
    for rk in world.ranks:
        seen: set[int] = set()  # ids of the arrays this rank already counted
        for u, L in enumerate(world.shard):
            buffers = {
                "params": [buffer(rk.working[u])],
                "grads": [buffer(rk.grad[u])],
                "master": [buffer(rk.master[u])],
                "optimizer": [buffer(a) for a in rk.opt[u].values()],
            }
            out += _unit_blocks(
                rk.rank,
                u,
                n=world.n,
                full_size=world.n * L,
                buffers=buffers,
                seen=seen,
                partial_nbytes=rk.peak_partials[u] * L * world.red.itemsize,
            )
    return out


def engine_blocks(engine) -> list[Block]:
    """This rank's blocks in a ZeroEngine, counted as memory_report counts them (each storage
    once). Runs inside a rank; comm_buffers (transient) are not model states and not drawn."""

    def buffer(t) -> Buffer:
        nbytes = t.untyped_storage().nbytes()
        return (t.untyped_storage().data_ptr(), nbytes, nbytes // t.element_size())

    def grad(u) -> Buffer:
        """Between steps the buffer may be released: drawn with what a step holds in it."""
        if u.grad_released:
            return (
                ("released", u.index),
                u.grad_nbytes,
                u.grad_nbytes // engine.config.grad_dtype.itemsize,
            )
        return buffer(u.grad)

    out: list[Block] = []
    seen: set[int] = set()  # storage pointers already counted
    for u in engine.units:
        buffers = {
            "params": [buffer(engine.working_extent(u)[0])],
            "grads": [grad(u)],
            "master": [buffer(u.master)],
            "optimizer": [buffer(t) for t in u.opt.values()],
        }
        out += _unit_blocks(
            engine.rank,
            u.index,
            n=engine.world_size,
            full_size=u.part.padded_numel,
            buffers=buffers,
            seen=seen,
            partial_nbytes=engine.partial_peak(u)
            * u.part.shard_numel
            * engine.config.grad_dtype.itemsize,
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
    from matplotlib.patches import Patch

    if not blocks:
        raise ValueError("blocks: empty; nothing to draw")
    ranks = sorted({b.rank for b in blocks})
    n = max(max(b.shard for b in blocks), max(ranks)) + 1
    colors = shard_colors(n)
    ax = axes_or_new(ax, (10, 0.32 * len(ranks) * len(CATEGORIES) + 1.6))
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


def format_messages(rows: Sequence[MessageRow], *, world_size: int, psi_padded: int) -> str:
    """A Markdown table of message rows, with the model-state volume in units of (N-1)/N·Ψ."""
    header = [
        "collective",
        "for",
        "kind",
        "calls",
        "elements sent",
        "of which padding",
        "bytes",
        "×(N-1)/N·Ψ",
    ]
    lines = []
    for r in rows:
        psi = (
            f"{volume_in_psi(r.elements, world_size, psi_padded):.3g}"
            if r.kind == "model" and world_size > 1
            else "—"
        )
        lines.append(
            [r.op, r.phase, r.kind, f"{r.calls}", f"{r.elements:,}", f"{r.padding:,}"]
            + [f"{r.nbytes:,}", psi]
        )
    model = [r for r in rows if r.kind == "model"]
    total = sum(r.elements for r in model)
    if world_size > 1:
        lines.append(
            ["**model states, total**", "", "", f"{sum(r.calls for r in model)}", f"{total:,}"]
            + [f"{sum(r.padding for r in model):,}", f"{sum(r.nbytes for r in model):,}"]
            + [f"**{volume_in_psi(total, world_size, psi_padded):.3g}**"]
        )
    return markdown_table(header, lines)


def format_memory(per_rank: dict[int, dict[str, int]]) -> str:
    """A Markdown table of resident bytes per rank and category, with the total."""
    return markdown_table(
        ["rank", *CATEGORIES, "total"],
        [
            [f"{r}", *(f"{row[c]:,}" for c in CATEGORIES), f"{sum(row[c] for c in CATEGORIES):,}"]
            for r, row in per_rank.items()
        ],
    )
