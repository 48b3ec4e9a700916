"""The performance model to the paper's scale (paper_figures/performance/throughput_model.py):
fitted on Figure 4, Figures 2 and 3 predicted held out, each point beside the paper's value read
off its plot.

Writes results/perf_model.json (the fit and one record per point), figures/perf_model.png and
tables/perf_model.md. Every profile runs the same fit: it takes a second.
"""

from __future__ import annotations

from pathlib import Path

from paper_figures.common import Outputs, SummaryRow, compute_then_render, save_figure
from paper_figures.performance import throughput_model as perfmodel
from zero.common.results import write_atomic

NAME = "perf_model"


def compute(profile: str) -> dict:
    del profile
    return {"section": NAME, "records": perfmodel.build_records()}


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    records = payload["records"]
    table = "\n".join(
        [
            "# Performance model vs the paper (TFLOP/s per GPU)",
            "",
            perfmodel.summary(records).replace("\n", "  \n"),
            "",
            perfmodel.points_table(records),
            "",
        ]
    )
    write_atomic(out.table(NAME), table)
    import matplotlib.pyplot as plt

    fig = perfmodel.draw(records)  # a pyplot figure (the notebook shows it): closed after saving
    path = save_figure(fig, out.figure(NAME))
    plt.close(fig)
    errors = next(r for r in records if r["kind"] == perfmodel.KIND_FIT)["result"]["errors"]
    held = [e["mape"] for k, e in errors.items() if k.startswith("held out")]
    return path, f"held-out mean |error| {100 * min(held):.0f}-{100 * max(held):.0f}%"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: each group's mean |error|, fitted and held out apart."""
    fit = next(r for r in payload["records"] if r["kind"] == perfmodel.KIND_FIT)["result"]
    return [
        [
            f"Throughput, {name} (TFLOP/s per GPU, {e['points']} points)",
            "read off the plot",
            f"model, mean |error| {100 * e['mape']:.0f}%",
            "–",
            "modelled (paper_figures/performance/throughput_model.py; fitted on Figure 4 only)",
            "V100 numbers as stated in the paper",
        ]
        for name, e in fit["errors"].items()
    ]
