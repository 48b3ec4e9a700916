"""What every part of teaching shares: the category and stage names, bitwise
comparison of parameter dicts, Markdown tables, new axes, and saving a figure atomically.

Legend: see the package docstring (notebooks/teaching/__init__.py)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from reference import bits

CATEGORIES = ("params", "grads", "master", "optimizer")
"""The model-state categories of docs/design.md §3, in the order the pictures draw them."""

STAGE_NAMES = {0: "baseline DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def stage_label(stage: int) -> str:
    """How tables and axes name a stage, e.g. "2: P_os+g"."""
    return f"{stage}: {STAGE_NAMES[stage]}"


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


def volume_in_psi(elements: int, world_size: int, psi_padded: int) -> float:
    """Elements sent per rank in units of (N-1)/N·Ψ_pad: 2 for baseline DP at M = N."""
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: a volume in Ψ needs N >= 2 (N = 1 sends 0)")
    return elements * world_size / ((world_size - 1) * psi_padded)


# ---------------------------------------------------------------------------------------------
# Tables and figures


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; an empty cell is written "| |"."""

    def line(cells):
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(r) for r in rows)])


def axes_or_new(ax, figsize: tuple[float, float]):
    """`ax` itself, or the axes of a new figure of `figsize` when it is None."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)[1]


def save_figure(fig, name: str, directory: str | Path = "figures") -> Path:
    """Save `fig` as directory/name.png atomically (zero.common.results.write_atomic): a reader
    never sees half a PNG."""
    from zero.common.results import write_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return write_atomic(Path(directory) / f"{name}.png", buf.getvalue())
