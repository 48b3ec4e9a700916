"""Figure 1: per-device model-state memory of a 7.5B model at N_d = 64, by ZeRO stage.

Ours are stacked by category from :func:`zero.common.memory.model_state_breakdown` in the paper's
configuration (fp16 params and grads, fp32 master, Adam; docs/paper.md §1.1); the paper's printed
totals stand beside them. Measured bars (records of kind ``memory.measured``) come from
``results/simulated_ranks.json`` (paper_figures/model_states/simulated_ranks.py): one simulated
rank of the 64-rank job, the GPT of ``gpt_config_for(7.5e9)`` (7.518B parameters), measured
outside the engine after construction. A stage whose rank did not fit the machine has no
measured bar; the title says which bars were measured and on what.

Legend: Ψ = num_params = 7.5e9, N_d = world_size = 64, K = 12 (mixed-precision Adam), GB = 1e9
bytes."""

from __future__ import annotations

from pathlib import Path

from paper_figures import paper
from paper_figures.common import (
    Outputs,
    SummaryRow,
    compute_then_render,
    count_line,
    label_above,
    new_figure,
    save_figure,
)
from zero.common.memory import GB, model_state_breakdown
from zero.common.results import make_record, provenance, read_json

NAME = "fig1_memory"
SERIES = (("memory.analytic", "ours, analytic"), ("memory.measured", "ours, measured"))
"""Record kinds drawn as bars, in this order, where the results file has them."""

# The paper's configuration (docs/paper.md §1.1): model_state_breakdown(**config) re-derives a
# record.
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
STAGE_LABELS_PLAIN = ("Baseline", "P_os", "P_os+g", "P_os+g+p")
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
BOLD = {"fontsize": 9, "fontweight": "bold"}
"""How our totals are labelled above their bars."""


def compute(profile: str, *, ranks: dict | None = None) -> dict:
    """The analytic records, one per stage, and the measured ones found in ``ranks`` (the
    simulated_ranks results). The profile decided there what was measured."""
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
    for record in (ranks or {}).get("records", []):
        c = record["config"]
        if (c["num_params"], c["world_size"]) == (paper.FIG1_NUM_PARAMS, paper.FIG1_WORLD_SIZE):
            if record["kind"] not in ("memory.measured", "memory.skipped"):
                continue
            records.append(record)
    return {"section": NAME, "records": records}


def measured_bars(payload: dict) -> dict[int, dict]:
    """stage -> the measured numbers (GB and the machine), from the records."""
    from paper_figures.model_states.simulated_ranks import machine

    out = {}
    for record in payload["records"]:
        if record["kind"] != "memory.measured":
            continue
        r, c = record["result"], record["config"]
        out[c["stage"]] = {
            "measured": r["rss_after_construction"] / GB,
            "analytic": r["analytic_model_states"] / GB,
            "num_params": r["config"]["num_params"],
            "machine": machine(record["provenance"], c["device"]),
            "date": record["provenance"].get("date_utc", "?"),
        }
    return out


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    """Draw the figure from the records; returns the PNG's path and the match count."""
    by_kind = {}
    for record in payload["records"]:
        by_kind.setdefault(record["kind"], {})[record["config"]["stage"]] = record["result"]
    measured = measured_bars(payload)
    series = [(kind, label) for kind, label in SERIES if kind in by_kind]

    fig = new_figure((9, 5.6))
    ax = fig.add_subplot()
    width = 0.8 / (len(series) + 1)
    top = max(paper.FIG1_GB.values())
    for i, (kind, _label) in enumerate(series):
        offset = (i - len(series) / 2) * width
        for stage in range(4):
            if kind == "memory.measured":
                top = max(top, _measured_bar(ax, stage, stage + offset, width, measured))
            else:
                first = stage == 0 and i == 0
                top = max(top, _stacked_bar(ax, by_kind[kind][stage], stage + offset, width, first))
    _paper_bars(ax, (len(series) - len(series) / 2) * width, width)

    ax.set_xticks(range(4))
    ax.set_xticklabels([f"{STAGE_TEX[s]}\n{FORMULAS[s]}" for s in range(4)])
    ax.set_xlabel("ZeRO-DP stage (per-device formula, paper Figure 1)")
    ax.set_ylabel("model-state memory per device (GB, 1 GB = 1e9 bytes)")
    ax.set_ylim(0, top * 1.12)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper right", fontsize=9, frameon=False, title="ours by category; paper total")
    ax.set_title(_title(measured), fontsize=10)
    path = save_figure(fig, out.figure(NAME))
    return path, _matches(by_kind.get("memory.analytic", {}), measured)


def _measured_bar(ax, stage: int, x: float, width: float, measured: dict) -> float:
    """Stage `stage`'s measured bar at x (or "not measured"); its height, 0 for none."""
    if stage not in measured:
        label_above(ax, "not\nmeasured", (x, 0), va="bottom", fontsize=7, color="#666666")
        return 0.0
    value = measured[stage]["measured"]
    first = stage == min(measured)
    ax.bar(x, value, width, color="#8c6bb1", edgecolor="white", hatch="//",
           label="ours, measured (one simulated rank)" if first else None)  # fmt: skip
    label_above(ax, f"{value:.3g}", (x, value), va="bottom", **BOLD)
    return value


def _stacked_bar(ax, result: dict, x: float, width: float, first: bool) -> float:
    """One analytic bar at x, stacked by CATEGORIES (labelled on the `first` bar), its total
    above it as the paper prints it; returns the total (GB)."""
    bottom = 0.0
    for category, keys, colour in CATEGORIES:
        height = sum(result[k] for k in keys) / GB
        ax.bar(x, height, width, bottom=bottom, color=colour, edgecolor="white", linewidth=0.5,
               label=category if first else None)  # fmt: skip
        bottom += height
    total = result["total"] / GB
    shown = paper.format_number(paper.paper_round(total))
    label_above(ax, shown, (x, total), va="bottom", **BOLD)
    return total


def _paper_bars(ax, offset: float, width: float) -> None:
    """The paper's printed totals: one neutral, hatched bar per stage, to the right of ours."""
    for stage in range(4):
        value = paper.FIG1_GB[stage]
        label = "paper, Figure 1 (printed)" if stage == 0 else None
        ax.bar(stage + offset, value, width, color="#d9d9d9", edgecolor="#555555", hatch="..",
               linewidth=0.8, label=label)  # fmt: skip
        label_above(ax, paper.format_number(value), (stage + offset, value), va="bottom",
                    fontsize=9, color="#444444")  # fmt: skip


def _title(measured: dict) -> str:
    """The figure's title: the paper's case, and which bars were measured, on what."""
    if measured:
        machines = sorted({m["machine"] for m in measured.values()})
        what = (
            f"measured: {', '.join(STAGE_LABELS_PLAIN[s] for s in sorted(measured))} "
            f"(one simulated rank, {measured[min(measured)]['num_params'] / 1e9:.3f}B GPT) on "
            + "; ".join(machines)
        )
    else:
        what = "no bar measured in this run (see tables/simulated_ranks.md)"
    return (
        f"Figure 1: Ψ = {paper.FIG1_NUM_PARAMS / 1e9:g}B parameters, "
        f"$N_d$ = {paper.FIG1_WORLD_SIZE}, "
        f"K = {paper.FIG1_K} (mixed-precision Adam)\n{what}"
    )


def _matches(analytic: dict, measured: dict) -> str:
    """The match count: our analytic totals as the paper rounds them, against its bars."""
    # Figure 1 prints one decimal even under 2 GB (1.875 -> 1.9), hence fine_below=0.
    matched = sum(
        paper.paper_round(analytic[s]["total"] / GB, fine_below=0) == paper.FIG1_GB[s]
        for s in range(4)
        if s in analytic
    )
    line = count_line(matched, 4, "bars")
    if measured:
        worst = max(abs(m["measured"] / paper.FIG1_GB[s] - 1) for s, m in measured.items())
        line += f", {len(measured)} measured (within {100 * worst:.1f}% of the paper)"
    return line


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    from paper_figures.model_states.simulated_ranks import NAME as RANKS

    path = out.result(RANKS)
    ranks = read_json(path) if path.exists() else None
    return compute_then_render(
        NAME, lambda p: compute(p, ranks=ranks), render, profile=profile, out=out
    )
