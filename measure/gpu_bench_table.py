"""The tables of python -m measure.gpu_bench, drawn from its records alone (kind bench.gpu_step).

    format_all(records)   # the Markdown table, the run's line and the targets, as printed
    format_table(records) # system | ms/step | ×ddp | MFU | peak GiB | update ms | ×roofline | loss
    targets(records)      # which of TARGETS are met (on CUDA only; a CPU run is a dry run)

Legend: ms/step median [min-max] over the timed steps; ×ddp a ratio of medians; MFU model FLOPs
÷ step time ÷ the run's measured peak; update ms the median update; ×roofline update ms ÷
roofline ms ([Note: the update's roofline] in measure/gpu_bench.py); first→last loss the losses
of the first and the last step run (every system ran the same batches). The paper_figures
section gpu_throughput draws the same records.
"""

from __future__ import annotations

GiB = 1 << 30
FAST = ("zero-s0", "zero-s1", "zero-s2", "zero-s3")
DET = {"zero-s0-det": "zero-s0", "zero-s3-det": "zero-s3"}
"""Each deterministic stage measured, and the fast stage it is compared with."""
TARGETS = (
    "ours fast stages 0-2 ≤ 1.00× ddp",
    "zero-s3 ≤ fsdp2-reshard",
    "det ≤ 1.10× the same stage's fast",
    "fast update ≤ 1.5× roofline",
    "det update ≤ 2× roofline",
    "MFU ≥ 45% at stages 0-2",
)
DRY_RUN = "dry run on cpu: targets not evaluated"


def ok_records(records: list[dict]) -> dict[str, dict]:
    """{system: record} of the records that measured something."""
    return {r["config"]["system"]: r for r in records if r["result"]["status"] == "ok"}


def ratio_vs_ddp(record: dict, ok: dict[str, dict]) -> float | None:
    ddp = ok.get("ddp")
    if ddp is None or record["result"]["status"] != "ok":
        return None
    return record["result"]["median_ms"] / ddp["result"]["median_ms"]


def format_table(records: list[dict]) -> str:
    ok = ok_records(records)
    head = "| system | ms/step (median [min-max]) | ×ddp | MFU | peak GiB | update ms | ×roofline "
    lines = [head + "| first→last loss |", "|---" * 8 + "|"]
    for r in records:
        name, res = r["config"]["system"], r["result"]
        if res["status"] != "ok":
            error = res.get("error", res["status"]).replace("|", "/")
            lines.append(f"| {name} | error: {error} |" + " – |" * 6)
            continue
        ddp = ratio_vs_ddp(r, ok)
        peak = res.get("peak_allocated_bytes")
        losses = res["losses"]
        cells = [
            name,
            f"{res['median_ms']:.2f} [{res['min_ms']:.2f}-{res['max_ms']:.2f}]",
            "–" if ddp is None else f"{ddp:.2f}",
            f"{100 * res['mfu']:.1f}%",
            "–" if peak is None else f"{peak / GiB:.2f}",
            f"{res['update_median_ms']:.2f}",
            f"{res['update_over_roofline']:.2f}",
            f"{losses[0]:.4f}→{losses[-1]:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _check(values: dict[str, float | None], passes, fmt: str) -> tuple[str, str]:
    missing = [k for k, v in values.items() if v is None]
    if missing:
        return "not evaluated", f"no record of {', '.join(missing)}"
    shown = ", ".join(f"{k} {fmt.format(v)}" for k, v in values.items())
    return ("met" if all(passes(v) for v in values.values()) else "not met"), shown


def targets(records: list[dict]) -> list[tuple[str, str, str]]:
    """(target, "met" / "not met" / "not evaluated", the values) for each of TARGETS; [] when
    the records are not of a CUDA run."""
    ok = ok_records(records)
    if not ok or not all(r["config"]["device"].startswith("cuda") for r in ok.values()):
        return []

    def res(name, key):
        r = ok.get(name)
        return None if r is None else r["result"][key]

    def ratio(a, b, key="median_ms"):
        x, y = res(a, key), res(b, key)
        return None if x is None or y is None else x / y

    fast02 = FAST[:3]
    checks = [
        _check({s: ratio(s, "ddp") for s in fast02}, lambda v: v <= 1.00, "{:.2f}×"),
        _check({"zero-s3": ratio("zero-s3", "fsdp2-reshard")}, lambda v: v <= 1.00, "{:.2f}×"),
        _check({d: ratio(d, f) for d, f in DET.items()}, lambda v: v <= 1.10, "{:.2f}× fast"),
        _check({s: res(s, "update_over_roofline") for s in FAST}, lambda v: v <= 1.5, "{:.2f}×"),
        _check({s: res(s, "update_over_roofline") for s in DET}, lambda v: v <= 2.0, "{:.2f}×"),
        _check({s: res(s, "mfu") for s in fast02}, lambda v: v >= 0.45, "{:.1%}"),
    ]
    return [(t, *c) for t, c in zip(TARGETS, checks, strict=True)]


def format_targets(records: list[dict]) -> str:
    found = targets(records)
    if not found:
        return DRY_RUN
    met = sum(status == "met" for _, status, _ in found)
    lines = [f"targets met: {met}/{len(found)}"]
    lines += [f"- [{status}] {t}: {values}" for t, status, values in found]
    return "\n".join(lines)


def format_all(records: list[dict]) -> str:
    """What the benchmark prints last: the run's line, the table, the targets."""
    first = next(
        (r for r in records if r["result"]["status"] == "ok"), records[0] if records else None
    )
    if first is None:
        return "no records"
    c, res = first["config"], first["result"]
    g = c["gpt"]
    run = (
        f"GPT L {g['n_layer']}, d {g['n_embd']}, {g['n_head']} heads, V {g['vocab_size']}, "
        f"T {c['seq_len']}: Ψ = {c['num_params']:,}; B = {c['batch_size']}, {c['precision']}, "
        f"{c['device']} ({c['device_name']}); peak {res['peak_flops'] / 1e12:.4g} TFLOP/s "
        f"({c['peak_dtype']}), copy {res['copy_bandwidth'] / 1e9:.4g} GB/s; "
        f"{c['warmup']} warm-up + {c['steps']} timed steps"
    )
    memory = "" if c["device"].startswith("cuda") else "\npeak GiB: not measured on a CPU (null)"
    return f"{run}\n\n{format_table(records)}\n{memory}\n{format_targets(records)}"
