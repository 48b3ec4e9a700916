"""Figure 2's shape at our scale: Megatron (model parallelism alone) against ZeRO stages 1 and 3
at N_m ∈ {1, 2, 4}, a fixed world of N = 4 gloo ranks, the GPT grown in width and depth.

The quick profile draws the committed measurements, paper_figures/measured/bench_mp_<model>.json
(one `python -m measure.bench` run per size: the commands are in STATUS.md); --profile full
measures the mini size again. Writes results/throughput_mp.json, figures/throughput_mp.png
(achieved GFLOP/s per rank and the step time over Megatron's, per system against Ψ, beside the
paper's Figure 2 values: compare the shape, who wins as the model grows, never the absolute
numbers: V100s with NVSwitch against two shared CPU cores) and tables/throughput_mp.md.
"""

from __future__ import annotations

from pathlib import Path

from measure import bench, bench_table
from paper_figures import paper
from paper_figures.common import (
    MEASURED,
    Outputs,
    SummaryRow,
    compute_then_render,
    new_figure,
    save_figure,
)
from zero.common.results import read_json, write_atomic

NAME = "throughput_mp"
SYSTEMS = ("megatron-lm", "zero-s1-mp1", "zero-s1-mp2", "zero-s1-mp4", "zero-s3-mp1",
           "zero-s3-mp2", "zero-s3-mp4", "ddp")  # fmt: skip
"""What the committed runs time (--systems of the command in STATUS.md)."""


def measured_files() -> list[Path]:
    return sorted(MEASURED.glob("bench_mp_*.json"))


def compute(profile: str) -> dict:
    if profile == "full":
        cfg = bench.BenchConfig(model="mini", systems=SYSTEMS, world_sizes=(4,))
        records = bench.bench_world(4, cfg)
        bench_table.add_ratios(records)
        return {"section": NAME, "source": "measured by this run", "records": records}
    files = measured_files()
    if not files:
        raise ValueError(f"measured: no bench_mp_*.json under {MEASURED.name}/")
    records = [r for f in files for r in read_json(f)["records"]]
    names = ", ".join(f.name for f in files)
    return {"section": NAME, "source": f"carried from {names}", "records": records}


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if r["result"]["status"] == "ok"]


def series(records: list[dict]) -> dict[str, list[tuple[int, dict]]]:
    """Per system, (Ψ, record) in growing Ψ."""
    out: dict[str, list[tuple[int, dict]]] = {}
    for r in _ok(records):
        out.setdefault(r["config"]["system"], []).append((r["config"]["num_params"], r))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def winners(records: list[dict]) -> list[tuple[str, int, str, float]]:
    """Per model size: (model, Ψ, the fastest of Megatron and ZeRO with MP, its step time over
    Megatron's); DDP is drawn beside them, not ranked."""
    by_model: dict[str, list[dict]] = {}
    for r in _ok(records):
        if r["config"]["system"] not in bench_table.MP_SYSTEMS:
            continue
        by_model.setdefault(r["config"]["model"], []).append(r)
    rows = []
    for model, recs in by_model.items():
        mega = next((r for r in recs if r["config"]["system"] == "megatron-lm"), None)
        best = min(recs, key=lambda r: r["result"]["median_ms"])
        ratio = best["result"]["median_ms"] / mega["result"]["median_ms"] if mega else None
        rows.append((model, best["config"]["num_params"], best["config"]["system"], ratio))
    return sorted(rows, key=lambda x: x[1])


def _style(name: str) -> dict:
    if name == "megatron-lm":
        return dict(color="C3", marker="s", lw=2.2)
    if name == "ddp":
        return dict(color="k", marker="x", ls=":", lw=1)
    stage, mp, _ = bench_table.mp_layout(name)
    return dict(color=f"C{[1, 2, 4].index(mp)}", marker="o" if stage == 1 else "^",
                ls="-" if stage == 1 else "--")  # fmt: skip


def draw(records: list[dict]):
    fig = new_figure((17, 5))
    ax_f, ax_r, ax_p = fig.subplots(1, 3)
    for name, pts in series(records).items():
        xs = [p / 1e6 for p, _ in pts]
        st = _style(name)
        flops = [r["result"]["achieved_flops_per_rank"] / 1e9 for _, r in pts]
        ax_f.plot(xs, flops, label=name, **st)
        ratio = [r["result"].get("ratio_vs_megatron") for _, r in pts]
        if None not in ratio:
            ax_r.plot(xs, ratio, label=name, **st)
    ax_f.set_title("Ours, N = 4 gloo ranks (CPU): model GFLOP/s per rank", fontsize=10)
    ax_f.set_ylabel("GFLOP/s per rank (model FLOPs ÷ median step)")
    ax_r.axhline(1.0, color="C3", lw=1)
    ax_r.set_title("Ours: step time ÷ Megatron's (below 1: faster than Megatron)", fontsize=10)
    ax_r.set_ylabel("step time ÷ Megatron's")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for ax in (ax_f, ax_r):
        ax.set_xscale("log")
        ax.set_xticks([0.5, 1, 2, 5, 10, 20, 50])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # not 2×10⁰
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("parameters Ψ (millions)")
        ax.legend(fontsize=7)
    for rows, label, st in (
        (paper.FIG2_MEGATRON, "Megatron (MP 2-256)", dict(color="C3", marker="s")),
        (paper.FIG2_ZERO, "ZeRO-100B (P_os+g, MP 1-16)", dict(color="C0", marker="o")),
    ):
        xs = [float(r[0].rstrip("B")) for r in rows]
        ax_p.plot(xs, [r[-1] for r in rows], label=label, **st)
        for x, r in zip(xs, rows):
            ax_p.annotate(f"MP {r[2]}", (x, r[-1]), fontsize=6, xytext=(2, 3),
                          textcoords="offset points")  # fmt: skip
    ax_p.set_xscale("log")
    ax_p.set_xlabel("parameters (billions)")
    ax_p.set_ylabel("TFLOP/s per GPU (read off the plot)")
    ax_p.set_title("The paper's Figure 2: 400 V100s (compare the shape only)", fontsize=10)
    ax_p.legend(fontsize=7)
    note = (records[0]["config"].get("note") or "").split(";")[0] if records else ""
    fig.suptitle("Figure 2's shape: who wins as the model grows" + (f"  [{note}]" if note else ""),
                 fontsize=10)  # fmt: skip
    return fig


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    records = payload["records"]
    lines = ["# Figure 2's shape at N = 4 (python -m measure.bench, model-parallel systems)", ""]
    for model in dict.fromkeys(r["config"]["model"] for r in records):
        here = [r for r in records if r["config"]["model"] == model]
        psi = here[0]["config"]["num_params"]
        lines += [f"## {model} GPT, Ψ = {psi:,}", "", bench_table.format_mp(here, markdown=True)]
        lines += ["", bench_table.format_table(here, markdown=True), ""]
    notes = {r["config"].get("note") for r in records} - {"", None}
    lines += [f"Note: {n}" for n in sorted(notes)]
    write_atomic(out.table(NAME), "\n".join(lines) + "\n")
    path = save_figure(draw(records), out.figure(NAME))
    won = ", ".join(f"{m}: {s}" for m, _, s, _ in winners(records))
    return path, f"fastest per size: {won} ({payload['source']})"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: per size, the fastest system and its step time over Megatron's."""
    rows = []
    records = _ok(payload["records"])
    for model, psi, best, ratio in winners(records):
        prov = next(r for r in records if r["config"]["model"] == model)["provenance"]
        rows.append(
            [
                f"Figure 2's shape at N = 4, {model} GPT (Ψ = {psi / 1e6:.2f}M): fastest system, "
                "step time ÷ Megatron's",
                "– (Figure 2: ZeRO ahead of Megatron at every size, V100s)",
                f"{best} {'—' if ratio is None else f'{ratio:.2f}'}",
                "–",
                f"measured (measure.bench, {prov.get('date_utc', '?')[:10]}; noisy)",
                f"CPU, {prov.get('cpu_count', '?')} cores, gloo",
            ]
        )
    return rows
