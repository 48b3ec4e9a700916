"""Step time on CPU/gloo, our stages beside DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed
(python -m measure.bench), drawn from its records.

The quick profile renders the committed measurements, one file per model size in MEASURED
(paper_figures/measured/bench_step_time*.json; a bench run takes from half an hour at the anchor
size to hours at the large one, and wants a quiet machine); --profile full measures the anchor size
again (N = 2 and 4, with --profile) and renders that. Writes results/throughput.json,
figures/throughput_cpu.png (a row of panels per model size, a panel per N), tables/throughput.md
and, from records with a profile, the per-phase figure figures/throughput_phases.png (phase_figure).
Also here: the profiled steps in the performance model's terms (cpu_terms).
"""

from __future__ import annotations

from pathlib import Path

from measure import bench, bench_table
from paper_figures.common import (
    MEASURED as _DIR,
)
from paper_figures.common import (
    Outputs,
    SummaryRow,
    compute_then_render,
    new_figure,
    save_figure,
)
from zero.common.results import read_json, write_atomic
from zero.workloads.models import gpt_flops

NAME = "throughput"
MEASURED = {
    "anchor": _DIR / "bench_step_time.json",
    "mid": _DIR / "bench_step_time_mid.json",
    "large": _DIR / "bench_step_time_large.json",
}
"""measure.bench's records per model size (`--model anchor|mid|large --json ...`); a size whose
file is absent is not drawn (the anchor's must exist)."""


def compute(profile: str) -> dict:
    if profile == "full":
        cfg = bench.BenchConfig(
            model="anchor", world_sizes=(2, 4), repeats=6, steps=6, profile=True
        )
        records = [r for n in cfg.world_sizes for r in bench.bench_world(n, cfg)]
        bench_table.add_ratios(records)
        return {"section": NAME, "source": "measured by this run", "records": records}
    records, names = [], []
    for model, path in MEASURED.items():
        if model != "anchor" and not path.is_file():
            continue
        payload = read_json(path)
        here = payload["records"] if isinstance(payload, dict) else payload
        bench_table.add_ratios(here)  # per size: the ratios follow from the timings, recomputed
        records += here
        names.append(path.name)
    return {"section": NAME, "source": f"carried from {', '.join(names)}", "records": records}


def panels(records: list[dict]) -> list[tuple[str, int, list[dict]]]:
    """(model, N, its records) for every model size and N present, in MEASURED's order of sizes
    and rising N: one panel each. A system measured in several groups ([Note: system groups] in
    measure/bench_table.py: `ddp` is in every one) appears once, as the first group that gives it
    a ×DDP has it (a group without `ddp` gives none), else as its first group has it."""
    order = {m: i for i, m in enumerate(MEASURED)}
    keys = sorted(
        {(r["config"].get("model", "?"), r["config"]["world_size"]) for r in records},
        key=lambda k: (order.get(k[0], len(order)), k[0], k[1]),
    )
    out = []
    for m, n in keys:
        first: dict[str, dict] = {}
        for r in records:
            if (r["config"].get("model", "?"), r["config"]["world_size"]) == (m, n):
                name = r["config"]["system"]
                if name not in first or _ddp(r) is not None and _ddp(first[name]) is None:
                    first[name] = r
        out.append((m, n, list(first.values())))
    return out


def _ddp(record: dict) -> float | None:
    return record["result"].get("ratio_vs_ddp")


def _grid(keys: list[tuple[str, int, list[dict]]], size: tuple[float, float]):
    """A figure with a row per model size and a column per N; the axes in `keys` order (cells
    a size lacks are removed)."""
    models = list(dict.fromkeys(m for m, _, _ in keys))
    sizes = sorted({n for _, n, _ in keys})
    fig = new_figure((size[0] * len(sizes), size[1] * len(models)))
    grid = fig.subplots(len(models), len(sizes), squeeze=False)
    used = [grid[models.index(m)][sizes.index(n)] for m, n, _ in keys]
    for ax in grid.flat:
        if ax not in used:
            ax.remove()
    return fig, used


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    records = [r for r in payload["records"] if r["result"]["status"] == "ok"]
    models = list(dict.fromkeys(m for m, _, _ in panels(payload["records"])))
    sections = [
        f"## {m} GPT\n\n"
        + bench_table.format_table(
            [r for r in payload["records"] if r["config"].get("model", "?") == m], markdown=True
        )
        for m in models
    ]
    write_atomic(
        out.table(NAME),
        "# Step time, CPU/gloo (python -m measure.bench)\n\n" + "\n\n".join(sections) + "\n",
    )
    keys = panels(records)
    fig, axes = _grid(keys, (6, 5))
    for ax, (model, n, here) in zip(axes, keys, strict=True):
        here = [r for r in here if _ddp(r) is not None]  # timed only beside its fast stage
        names = [r["config"]["system"] for r in here]
        ratios = [_ddp(r) for r in here]
        colors = ["C0" if s in bench_table.OURS else "C7" for s in names]
        ax.barh(names, ratios, color=colors)
        ax.axvline(1.0, color="k", lw=1)
        ax.invert_yaxis()
        ax.set_xlabel("step time ÷ DDP's (below 1 is faster)")
        ax.set_ylabel("system (blue: ours)")
        ax.set_title(f"N = {n}, {model} GPT, fp32 AdamW, gloo")
    fig.suptitle("Step time beside DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed")
    path = save_figure(fig, out.figure("throughput_cpu"))
    if any(bench_table.phase_parts(r) for r in records):
        save_figure(phase_figure(records), out.figure("throughput_phases"))
    return path, f"{len(records)} systems × N timed ({payload['source']})"


def phase_figure(records: list[dict]):
    """Where a step's time goes: one stacked bar per profiled system, one panel per model size
    and N, the parts of measure.bench_table.PHASE_PARTS (ms, the mean over ranks, the median over
    steps)."""
    profiled = [r for r in records if bench_table.phase_parts(r)]
    if not profiled:
        raise ValueError("records: none has a profile; allowed are records of a --profile run")
    keys = panels(profiled)
    fig, axes = _grid(keys, (6, 5.5))
    for ax, (model, n, here) in zip(axes, keys, strict=True):
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
    # right of the last panel: inside a panel it hid the longest bars
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    fig.suptitle("Where a step's time goes: measure.bench --profile, phase by phase")
    return fig


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: our stages' step time over DDP's (the paper has no CPU numbers), one per
    system, size and N as the figure draws it (`panels`)."""
    rows = []
    ok = [r for r in payload["records"] if r["result"]["status"] == "ok"]
    for r in (r for _, _, here in panels(ok) for r in here):
        c, res = r["config"], r["result"]
        if c["system"] in bench_table.OURS and _ddp(r) is not None:
            prov = r["provenance"]
            rows.append(
                [
                    f"Step time {c['system']} at N = {c['world_size']} ÷ DDP's "
                    f"(CPU, {c.get('model', '?')} GPT)",
                    "– (the paper: V100s)",
                    f"{res['ratio_vs_ddp']:.2f}",
                    "–",
                    f"measured (measure.bench, {prov.get('date_utc', '?')[:10]})",
                    f"CPU, {prov.get('cpu_count', '?')} cores, gloo",
                ]
            )
    return rows


# ---------------------------------------------------------------------------------------------
# The CPU measurements in the performance model's three terms
# (paper_figures/performance/throughput_model.py)


COMPUTE_PHASES = ("forward", "backward")
COMM_PHASES = ("update.reduce", "update.refresh", "update.finish", "update.control")


def cpu_terms(records: list[dict]) -> list[dict]:
    """From measure.bench's profiled records (runs/paper_figures/results/bench_step_time.json): each
    of our systems' measured step split as the performance model splits it (the banner's
    module): compute (forward + backward),
    communication in step() (the phases measure.bench_table.PROFILE_COLUMNS calls reduce,
    all-gather, ag-wait and control: the norm's partials ride in the control exchange), optimizer
    (its kernels), and the achieved FLOP/s of forward + backward (Megatron's count without
    recomputation). A profile without one of those phases is refused: a renamed phase would
    otherwise count as 0 ms."""
    out = []
    for r in records:
        c, res = r["config"], r["result"]
        prof = res.get("profile_ms")
        if res.get("status") != "ok" or prof is None or c.get("family") != "ours":
            continue
        g = c["gpt"]
        flops = gpt_flops(c["batch_size"], g["block_size"], g["n_layer"], g["n_embd"],
                          g["vocab_size"], recompute=False)  # fmt: skip
        missing = [k for k in (*COMPUTE_PHASES, *COMM_PHASES, "update.optimizer") if k not in prof]
        if missing:
            raise ValueError(
                f"records: {c['system']} at N = {c['world_size']} has no phase {missing} in its "
                f"profile_ms; allowed are measure.bench --profile records"
            )
        compute = sum(prof[k] for k in COMPUTE_PHASES)
        comm = sum(prof[k] for k in COMM_PHASES)
        opt = prof["update.optimizer"]
        out.append({
            "system": c["system"], "world_size": c["world_size"], "step_ms": prof.get("step"),
            "median_ms": res["median_ms"], "compute_ms": compute, "comm_in_step_ms": comm,
            "optimizer_ms": opt, "gflops_per_rank": flops / (compute / 1e3) / 1e9,
        })  # fmt: skip
    return out
