"""What every paper_figures section shares: output locations, summary rows, the section record.

A *section* is one function, ``run(*, profile, out) -> list[SummaryRow]``. It first computes or
measures and writes its records (``zero.common.results``) to ``out.result(name)``, then renders its
figures and tables by reading that JSON back, never from numbers held in code. The paper's own
numbers come from :mod:`paper_figures.paper`.

Legend: Ψ = num_params, N_d = world_size, K = the optimizer-state multiplier (12 for mixed-precision
Adam)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MEASURED = Path(__file__).resolve().parent / "measured"
"""The committed measurements (records too slow or too machine-bound to take in a quick run),
which the sections in this package and its folders draw."""

PROFILES = ("quick", "full", "smoke")
"""quick: minutes on a 2-core CPU (make repro); full: the large cases (simulated ranks of 7.5B,
128B and 1T models where they fit, N = 8 everywhere); smoke: the smallest case of each section,
seconds, for the tests of the main job itself."""


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """Where a run writes: ``root/results/*.json``, ``root/figures/*.png``, ``root/tables/*.md``
    and the index (INDEX.md under the root unless ``index`` says otherwise)."""

    root: Path
    """The output root."""
    index: Path | None = None
    """Where INDEX.md goes; None: INDEX.md under the root."""

    @property
    def index_path(self) -> Path:
        return self.root / "INDEX.md" if self.index is None else self.index

    def linked(self, relative: str) -> str:
        """A path under the root (e.g. ``figures/x.png``), relative to the index's folder."""
        return os.path.relpath(self.root / relative, self.index_path.parent)

    def result(self, name: str) -> Path:
        return self.root / "results" / f"{name}.json"

    def figure(self, name: str) -> Path:
        return self.root / "figures" / f"{name}.png"

    def table(self, name: str) -> Path:
        return self.root / "tables" / f"{name}.md"

    def show(self, path: Path) -> str:
        """``path`` relative to the root, for the summary."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


@dataclass(frozen=True, kw_only=True)
class SummaryRow:
    """One line of the summary that the main job prints."""

    section: str
    wrote: tuple[str, ...]
    """Files written, relative to the output root."""
    matches: str
    """How ours compares with the paper, e.g. "54/54 cells"; "" where nothing is compared."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """A registered section of the main job (see ``paper_figures.sections.SECTIONS``)."""

    name: str
    """Unique; ``--only NAME`` selects it, and its records go to ``results/<name>.json``."""
    run: Callable[..., list[SummaryRow]]
    """``run(*, profile: str, out: Outputs) -> list[SummaryRow]``."""
    about: str
    """One line for ``--help``."""


def compute_then_render(name: str, compute, render, *, profile: str, out: Outputs):
    """Every section's shape: records to JSON first, then its output drawn from that JSON alone.

    compute(profile) -> payload; render(payload, out) -> (path written, match summary).
    """
    from zero.common.results import read_json, write_json

    result_path = write_json(out.result(name), compute(profile))
    path, matches = render(read_json(result_path), out)
    return [
        SummaryRow(section=name, wrote=(out.show(result_path), out.show(path)), matches=matches)
    ]


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def count_line(matched: int, total: int, what: str) -> str:
    """A match count as the tables print it and the tests read it, e.g. "54/54 cells ..."."""
    return f"{matched}/{total} {what}"


def new_figure(figsize: tuple[float, float]):
    """A matplotlib Figure on the Agg canvas (no display needed), at the sections' 150 dpi."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=150)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path: Path) -> Path:
    """Lay ``fig`` out tightly and write it as a PNG at ``path``, atomically; returns the path."""
    import io

    from zero.common.results import write_atomic

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return write_atomic(path, png.getvalue())


def label_above(ax, text: str, xy: tuple[float, float], *, points: float = 3, **style) -> None:
    """Write ``text`` centred ``points`` typographic points above the data point ``xy`` (a bar's
    top): the offset is in points so that it stays the same whatever the axis' scale."""
    ax.annotate(text, xy, xytext=(0, points), textcoords="offset points", ha="center", **style)
