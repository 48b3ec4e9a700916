"""Figure 1: per-device model-state memory of a 7.5B model at N_d = 64, by ZeRO stage.

Ours are stacked by category from :func:`zero.memory.model_state_breakdown` in the paper's
configuration (fp16 params and grads, fp32 master, Adam; PAPER.md §1.1); the paper's printed
totals stand beside them. Measured bars (records of kind ``memory.measured``, from the simulation
of a large world) will be drawn beside the analytic ones when the results file holds them.

Legend: Ψ = num_params = 7.5e9, N_d = world_size = 64, K = 12 (mixed-precision Adam),
GB = 1e9 bytes.
"""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from paper_figures import paper
from paper_figures.common import Outputs, SummaryRow, compute_then_render, count_line
from zero.memory import GB, model_state_breakdown
from zero.results import make_record, provenance, write_atomic

NAME = "fig1_memory"
SERIES = (("memory.analytic", "ours, analytic"), ("memory.measured", "ours, measured"))
"""Record kinds drawn as bars, in this order, where the results file has them."""

# The paper's configuration (PAPER.md §1.1): model_state_breakdown(**config) re-derives a record.
PAPER_CONFIG = {
    "param_bytes": 2,
    "grad_bytes": 2,
    "master_bytes": 4,
    "optimizer_states": 2,
    "state_bytes": 4,
    "accumulation": 1,
    "deterministic": True,
    "padding": 0,
}
STAGE_TEX = ("Baseline DP", r"$P_{os}$", r"$P_{os+g}$", r"$P_{os+g+p}$")
FORMULAS = (  # mathtext, for the subscripts
    r"$(2+2+K)\Psi$",
    r"$2\Psi+2\Psi+K\Psi/N_d$",
    r"$2\Psi+(2+K)\Psi/N_d$",
    r"$(2+2+K)\Psi/N_d$",
)
CATEGORIES = (  # (label, result keys summed, colour): the paper's Figure 1 colours its bars alike
    ("fp16 parameters (2Ψ)", ("params",), "#4878a8"),
    ("fp16 gradients (2Ψ)", ("grads",), "#e08a3c"),
    ("fp32 master + Adam m, v (KΨ)", ("master", "optimizer"), "#5a9e5a"),
)


def compute(profile: str) -> dict:
    """The analytic records: one per stage. The profile does not matter to arithmetic."""
    del profile
    prov = provenance()
    records = []
    for stage in range(4):
        config = {
            "num_params": paper.FIG1_NUM_PARAMS,
            "world_size": paper.FIG1_WORLD_SIZE,
            "stage": stage,
            **PAPER_CONFIG,
        }
        result = model_state_breakdown(**config).to_dict()  # bytes by category, and total
        records.append(
            make_record(config=config, result=result, kind="memory.analytic", provenance=prov)
        )
    return {"section": NAME, "records": records}


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    """Draw the figure from the records; returns the PNG's path and the match count."""
    by_kind = {}
    for record in payload["records"]:
        by_kind.setdefault(record["kind"], {})[record["config"]["stage"]] = record["result"]
    series = [(kind, label) for kind, label in SERIES if kind in by_kind]

    fig = Figure(figsize=(9, 5.6), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / (len(series) + 1)
    top = max(paper.FIG1_GB.values())
    for i, (kind, _label) in enumerate(series):
        offset = (i - len(series) / 2) * width
        for stage in range(4):
            result = by_kind[kind][stage]
            bottom = 0.0
            for category, keys, colour in CATEGORIES:
                height = sum(result[k] for k in keys) / GB
                ax.bar(
                    stage + offset,
                    height,
                    width,
                    bottom=bottom,
                    color=colour,
                    edgecolor="white",
                    linewidth=0.5,
                    hatch="//" if kind == "memory.measured" else None,
                    label=category if stage == 0 and i == 0 else None,
                )
                bottom += height
            total = result["total"] / GB
            ax.annotate(
                paper.format_number(paper.paper_round(total)),
                (stage + offset, total),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
                fontweight="bold",
            )
            top = max(top, total)

    # The paper's printed totals: one neutral, hatched bar per stage, to the right of ours.
    offset = (len(series) - len(series) / 2) * width
    for stage in range(4):
        value = paper.FIG1_GB[stage]
        ax.bar(
            stage + offset,
            value,
            width,
            color="#d9d9d9",
            edgecolor="#555555",
            hatch="..",
            linewidth=0.8,
            label="paper, Figure 1 (printed)" if stage == 0 else None,
        )
        ax.annotate(
            paper.format_number(value),
            (stage + offset, value),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
            color="#444444",
        )

    ax.set_xticks(range(4))
    ax.set_xticklabels([f"{STAGE_TEX[s]}\n{FORMULAS[s]}" for s in range(4)])
    ax.set_xlabel("ZeRO-DP stage (per-device formula, paper Figure 1)")
    ax.set_ylabel("model-state memory per device (GB, 1 GB = 1e9 bytes)")
    ax.set_ylim(0, top * 1.12)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper right", fontsize=9, frameon=False, title="ours by category; paper total")
    kinds = ", ".join(label.removeprefix("ours, ") for _, label in series)
    ax.set_title(
        f"Figure 1: Ψ = {paper.FIG1_NUM_PARAMS / 1e9:g}B parameters, "
        f"$N_d$ = {paper.FIG1_WORLD_SIZE}, "
        f"K = {paper.FIG1_K} (mixed-precision Adam)\nours: {kinds}; paper: printed values",
        fontsize=11,
    )
    fig.tight_layout()

    png = io.BytesIO()
    fig.savefig(png, format="png")
    path = write_atomic(out.figure(NAME), png.getvalue())

    # Figure 1 prints one decimal even under 2 GB (1.875 -> 1.9), hence fine_below=0.
    analytic = by_kind.get("memory.analytic", {})
    matched = sum(
        paper.paper_round(analytic[s]["total"] / GB, fine_below=0) == paper.FIG1_GB[s]
        for s in range(4)
        if s in analytic
    )
    return path, count_line(matched, 4, "bars")


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)
