"""The bar and line charts of notebooks 02 and 04: bytes and message volume per stage, FLOPs
per rank, the memory reduction against N_d, and bitwise invariance against N. Each returns its
axes; the notebooks save them with save_figure.

Legend: see the package docstring; K is the optimizer-state multiplier (12 for mixed-precision
Adam), N_d the data-parallel degree."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zero.common.memory import asymptotic_reduction, reduction_factor

from .common import CATEGORIES, STAGE_NAMES, axes_or_new, stage_label


def grouped_bars(ax, x, columns: dict[str, Sequence[float]], *, slots: int | None = None, **label):
    """Bars side by side at each x: column i's at x + i·width, width = 0.8 / slots (by default
    one slot per column), each bar labelled with its value by ax.bar_label(**label).
    Returns the width."""
    width = 0.8 / (len(columns) if slots is None else slots)
    for i, (name, values) in enumerate(columns.items()):
        bars = ax.bar(x + i * width, values, width=width, label=name)
        ax.bar_label(bars, **label)
    return width


def draw_stage_memory(
    per_stage: dict[int, dict[str, int]],
    *,
    title: str,
    ax=None,
    expected: dict[int, int] | None = None,
):
    """Stacked bars of one rank's bytes by category, one bar per stage; diamonds mark an
    expected total (e.g. zero.common.memory's analytic model) where given."""
    ax = axes_or_new(ax, (7, 4))
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
    ax.set_xticks(x, [stage_label(s) for s in stages])
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
    ax = axes_or_new(ax, (7, 4))
    stages = sorted({s for series in measured.values() for s in series})
    x = np.arange(len(stages))
    columns = {label: [series.get(s, np.nan) for s in stages] for label, series in measured.items()}
    width = grouped_bars(
        ax,
        x,
        columns,
        slots=len(measured) + (paper is not None),
        fmt="%.2f",
        fontsize=7,
        rotation=90 if len(measured) > 3 else 0,
        padding=2,
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
    ax.set_xticks(x + 0.4 - width / 2, [stage_label(s) for s in stages])
    ax.set_xlabel("ZeRO stage")
    ax.set_ylabel("elements sent per rank per step / ((N-1)/N·Ψ)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    return ax


def draw_flops(per_rank: dict[str, list[int]], *, single_process: int, title: str, ax=None):
    """Bars of FLOPs per rank per micro-batch for each series, beside the single-process
    model's FLOPs on one micro-batch and what an N-way split of the model would leave."""
    ax = axes_or_new(ax, (7, 4))
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
    """The memory reduction over baseline DP against N_d: zero.common.memory.reduction_factor as
    lines, the paper's asymptotes (4×, 8×, N_d×) dashed, and measured points."""
    ax = axes_or_new(ax, (7, 4.5))
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
    ax = axes_or_new(ax, (7, 4))
    ns = sorted({n for series in differing.values() for n in series})
    x = np.arange(len(ns))
    columns = {label: [series[n] for n in ns] for label, series in differing.items()}
    width = grouped_bars(ax, x, columns, fontsize=7)
    ax.set_xticks(x + 0.4 - width / 2, [f"N = {n}" for n in ns])
    ax.set_xlabel("world size")
    ax.set_ylabel(f"parameters whose bits differ from N = 1 (of {numel:,})")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    return ax
