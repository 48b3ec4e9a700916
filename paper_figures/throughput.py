"""Step time on CPU/gloo, our stages beside DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed
(python -m measure.bench), drawn from its records.

The quick profile renders the committed measurement, paper_figures/measured/bench_step_time.json
(a bench run takes tens of minutes and wants a quiet machine); --profile full measures again
(N = 2 and 4, the anchor GPT, with --profile) and renders that. Writes results/throughput.json,
figures/throughput_cpu.png, tables/throughput.md and, from records with a profile, the per-phase
figure figures/throughput_phases.png (phase_figure).
"""

from __future__ import annotations

from pathlib import Path

from measure import bench, bench_table
from paper_figures.common import (
    Outputs,
    SummaryRow,
    compute_then_render,
    new_figure,
    save_figure,
)
from zero.results import read_json, write_atomic

NAME = "throughput"
MEASURED = Path(__file__).resolve().parent / "measured" / "bench_step_time.json"


def compute(profile: str) -> dict:
    if profile == "full":
        cfg = bench.BenchConfig(
            model="anchor", world_sizes=(2, 4), repeats=6, steps=6, profile=True
        )
        records = [r for n in cfg.world_sizes for r in bench.bench_world(n, cfg)]
        bench_table.add_ratios(records)
        return {"section": NAME, "source": "measured by this run", "records": records}
    payload = read_json(MEASURED)
    records = payload["records"] if isinstance(payload, dict) else payload
    return {"section": NAME, "source": f"carried from {MEASURED.name}", "records": records}


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    records = [r for r in payload["records"] if r["result"]["status"] == "ok"]
    write_atomic(
        out.table(NAME),
        "# Step time, CPU/gloo (python -m measure.bench)\n\n"
        + bench_table.format_table(payload["records"], markdown=True)
        + "\n",
    )
    sizes = sorted({r["config"]["world_size"] for r in records})
    fig = new_figure((6 * len(sizes), 5))
    axes = fig.subplots(1, len(sizes), squeeze=False)[0]
    for ax, n in zip(axes, sizes, strict=True):
        here = [r for r in records if r["config"]["world_size"] == n]
        names = [r["config"]["system"] for r in here]
        ratios = [r["result"]["ratio_vs_ddp"] for r in here]
        colors = ["C0" if s in bench_table.OURS else "C7" for s in names]
        ax.barh(names, ratios, color=colors)
        ax.axvline(1.0, color="k", lw=1)
        ax.invert_yaxis()
        ax.set_xlabel("step time ÷ DDP's (below 1 is faster)")
        ax.set_ylabel("system (blue: ours)")
        ax.set_title(f"N = {n}, anchor GPT, fp32 AdamW, gloo")
    fig.suptitle("Step time beside DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed")
    path = save_figure(fig, out.figure("throughput_cpu"))
    if any(bench_table.phase_parts(r) for r in records):
        save_figure(phase_figure(records), out.figure("throughput_phases"))
    return path, f"{len(records)} systems × N timed ({payload['source']})"


def phase_figure(records: list[dict]):
    """Where a step's time goes: one stacked bar per profiled system, one panel per N, the parts
    of measure.bench_table.PHASE_PARTS (ms, the mean over ranks, the median over steps)."""
    profiled = [r for r in records if bench_table.phase_parts(r)]
    if not profiled:
        raise ValueError("records: none has a profile; allowed are records of a --profile run")
    sizes = sorted({r["config"]["world_size"] for r in profiled})
    model = profiled[0]["config"].get("model", "?")
    fig = new_figure((6 * len(sizes), 5.5))
    axes = fig.subplots(1, len(sizes), squeeze=False)[0]
    for ax, n in zip(axes, sizes, strict=True):
        here = [r for r in profiled if r["config"]["world_size"] == n]
        names = [r["config"]["system"] for r in here]
        left = [0.0] * len(here)
        for i, (key, label) in enumerate(bench_table.PHASE_PARTS):
            widths = [max(bench_table.phase_parts(r)[key], 0.0) for r in here]
            ax.barh(names, widths, left=left, color=f"C{i}", label=label)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median over steps, mean over ranks)")
        ax.set_ylabel("system")
        ax.set_title(f"N = {n}, {model} GPT, fp32 AdamW")
    axes[-1].legend(loc="lower right", fontsize=7)
    fig.suptitle("Where a step's time goes: measure.bench --profile, phase by phase")
    return fig


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: our stages' step time over DDP's (the paper has no CPU numbers)."""
    rows = []
    for r in payload["records"]:
        c, res = r["config"], r["result"]
        if c["system"] in bench_table.OURS and res["status"] == "ok":
            prov = r["provenance"]
            rows.append(
                [
                    f"Step time {c['system']} at N = {c['world_size']} ÷ DDP's (CPU, anchor GPT)",
                    "– (the paper: V100s)",
                    f"{res['ratio_vs_ddp']:.2f}",
                    "–",
                    f"measured (measure.bench, {prov.get('date_utc', '?')[:10]})",
                    f"CPU, {prov.get('cpu_count', '?')} cores, gloo",
                ]
            )
    return rows
