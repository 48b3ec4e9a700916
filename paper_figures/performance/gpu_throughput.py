"""Step time and MFU on one GPU (python -m measure.gpu_bench), drawn from committed records.

Reads every paper_figures/measured/bench_gpu*.json (records of kind measure.gpu_bench.KIND) and
keeps those measured on CUDA; a CPU dry run is never drawn. Every profile renders what is
committed (a GPU is not assumed here). Writes results/gpu_throughput.json,
tables/gpu_throughput.md and, where there is a GPU record, figures/gpu_throughput.png: a row per
device and model, ms/step (median, whiskers min-max) beside MFU per system. Without one it
draws nothing and INDEX.md says NOT_MEASURED.

    python -m paper_figures --only gpu_throughput

Legend: ms/step the whole step at N = 1, bf16, AdamW; MFU model FLOPs ÷ step time ÷ the
device's measured bf16 peak; blue bars ours (ZeroEngine), grey the PyTorch systems.
"""

from __future__ import annotations

from pathlib import Path

from measure.gpu_bench import KIND, OURS
from measure.gpu_bench_table import format_all
from paper_figures.common import (
    MEASURED,
    Outputs,
    SummaryRow,
    compute_then_render,
    new_figure,
    save_figure,
)
from zero.common.results import read_json, write_atomic

NAME = "gpu_throughput"
PATTERN = "bench_gpu*.json"
"""The committed records: python -m measure.gpu_bench --json MEASURED/bench_gpu_<card>.json."""
NOT_MEASURED = "GPU step time: not yet measured (no committed GPU record)"


def gpu_records(records: list[dict]) -> list[dict]:
    """The records of measure.gpu_bench taken on CUDA (every status)."""
    return [
        r
        for r in records
        if r.get("kind") == KIND and str(r["config"].get("device", "")).startswith("cuda")
    ]


def compute(profile: str, directory: Path = MEASURED) -> dict:
    del profile  # every profile draws the committed records
    records, names = [], []
    for path in sorted(directory.glob(PATTERN)):
        payload = read_json(path)
        here = gpu_records(payload["records"] if isinstance(payload, dict) else payload)
        if here:
            records += here
            names.append(path.name)
    source = f"carried from {', '.join(names)}" if names else "no committed GPU record"
    return {"section": NAME, "source": source, "records": records}


def groups(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """(title, records) per device and model shape, in the order first seen."""
    out: dict[str, list[dict]] = {}
    for r in records:
        c = r["config"]
        g = c["gpt"]
        title = (
            f"{c.get('device_name', c['device'])}: GPT L {g['n_layer']}, d {g['n_embd']}, "
            f"Ψ {c['num_params'] / 1e6:.1f}M, B {c['batch_size']} × T {c['seq_len']}"
        )
        out.setdefault(title, []).append(r)
    return list(out.items())


def draw(records: list[dict], path: Path) -> Path | str:
    """The figure of the GPU records among `records` at `path`; NOT_MEASURED where none is ok."""
    ok = [r for r in gpu_records(records) if r["result"]["status"] == "ok"]
    if not ok:
        return NOT_MEASURED
    rows = groups(ok)
    fig = new_figure((12, 0.5 + 0.45 * max(len(here) for _, here in rows) * len(rows) + 1.2))
    axes = fig.subplots(len(rows), 2, squeeze=False)
    for (title, here), (left, right) in zip(rows, axes, strict=True):
        names = [r["config"]["system"] for r in here]
        res = [r["result"] for r in here]
        colors = ["C0" if s in OURS else "C7" for s in names]
        med = [x["median_ms"] for x in res]
        spread = [
            [m - x["min_ms"] for m, x in zip(med, res)],
            [x["max_ms"] - m for m, x in zip(med, res)],
        ]
        left.barh(names, med, xerr=spread, color=colors, capsize=2)
        left.invert_yaxis()
        left.set_xlabel("ms per step (median; whiskers min-max)")
        left.set_title(title, fontsize=9)
        right.barh(names, [100 * x["mfu"] for x in res], color=colors)
        right.invert_yaxis()
        right.set_xlabel("MFU, % of the measured bf16 peak")
        right.set_title("model FLOPs utilisation", fontsize=9)
    fig.suptitle("One training step at N = 1 on a GPU (blue: ours; grey: PyTorch)")
    return save_figure(fig, path)


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    records = gpu_records(payload["records"])
    body = [f"## {title}\n\n{format_all(here)}" for title, here in groups(records)]
    text = "# Step time on one GPU (python -m measure.gpu_bench)\n\n"
    text += "\n\n".join(body) if body else NOT_MEASURED + "."
    table = write_atomic(out.table(NAME), text + "\n")
    drawn = draw(records, out.figure(NAME))
    if isinstance(drawn, str):
        return table, drawn
    ok = sum(r["result"]["status"] == "ok" for r in records)
    return drawn, f"{ok} systems timed on a GPU ({payload['source']})"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def drawn_in(payload: dict) -> str:
    """INDEX.md's "drawn in" of these rows: the figure only where there is one."""
    ok = any(r["result"]["status"] == "ok" for r in gpu_records(payload["records"]))
    return f"figures/{NAME}.png, tables/{NAME}.md" if ok else f"tables/{NAME}.md"


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: each system's ms/step and MFU on a GPU, or one row saying there is none."""
    ok = [r for r in gpu_records(payload["records"]) if r["result"]["status"] == "ok"]
    if not ok:
        return [[NOT_MEASURED, "–", "–", "–", "–", "–"]]
    rows = []
    for r in ok:
        c, res = r["config"], r["result"]
        date = r["provenance"].get("date_utc", "?")[:10]
        rows.append(
            [
                f"GPU step time {c['system']} at N = 1 (Ψ {c['num_params'] / 1e6:.1f}M, bf16)",
                "– (the paper: V100s)",
                f"{res['median_ms']:.1f} ms, MFU {100 * res['mfu']:.0f}%",
                "–",
                f"measured (measure.gpu_bench, {date})",
                c.get("device_name", c["device"]),
            ]
        )
    return rows
