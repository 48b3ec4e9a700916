"""measure.bench's tables, drawn from its records (never from numbers typed in): the step times
and their ratios (format_table), the step-time targets, the phases of --profile, the CPU per
step, the memory pass and the model-parallel systems; format_all prints each that the records
have data for. Re-exported by measure.bench_table. The legend of every column:
benchmarks/cpu-2core-2026-11.md, section "How the step time is taken".
"""

from __future__ import annotations

import numpy as np

from .bench_systems import MP_SYSTEMS, PEER_LABELS, system_key


def spread(per_round: list[float] | None) -> str:
    """The noise of a ratio: its quartiles over the rounds, each round's ratio taken between the
    two systems' medians of that round ([Note: alternating repeats]: they ran seconds apart)."""
    if not per_round:
        return "—"
    q25, q75 = np.percentile(per_round, [25, 75])
    return f"{q25:.2f}-{q75:.2f}"


TARGETS = {
    **{f"zero-s{k}": ("ratio_vs_ddp", 1.00) for k in (0, 1, 2)},
    "zero-s3": ("ratio_vs_ddp", 1.05),
    **{f"zero-s{k}-det": ("ratio_vs_fast", 1.03) for k in range(4)},
}
"""The issue's step-time targets: fast stages 0-2 at most 1.00× DDP, stage 3 at most 1.05×,
each deterministic stage at most 1.03× its fast one."""


def _grouped(records: list[dict]) -> bool:
    """Whether the records come from runs in named groups ([Note: system groups]): the tables
    then name each row's group, since a system may stand in several."""
    return any(r["config"].get("group") for r in records)


def format_targets(records: list[dict], *, markdown: bool = False) -> str:
    """One row per target and record that has its ratio: the ratio, its per-round quartiles,
    the target, and whether it is met (a system run in two groups has each ratio once)."""
    grouped = _grouped(records)
    head = ["model", "N", "system", *(["group"] if grouped else [])]
    head += ["ratio", "per round", "target", "met"]
    rows = []
    for rec in records:
        name, res = rec["config"]["system"], rec["result"]
        if name not in TARGETS or res.get("status") != "ok":
            continue
        key, limit = TARGETS[name]
        value = res.get(key)
        if value is None:
            continue
        what = "×DDP" if key == "ratio_vs_ddp" else "×fast"
        rows.append(
            [
                rec["config"]["model"],
                str(rec["config"]["world_size"]),
                name,
                *([rec["config"].get("group") or "—"] if grouped else []),
                f"{value:.2f} {what}",
                spread(res.get(key + "_by_repeat")),
                f"≤ {limit:.2f}",
                "yes" if round(value, 2) <= limit else "no",
            ]
        )
    return _render(head, rows, markdown)


def format_table(records: list[dict], *, markdown: bool = False) -> str:
    """The results table, drawn from the records (never from numbers typed in). ×DDP/round and
    ×fast/round: the interquartile range of the ratio over the rounds (`spread`)."""
    peers = [p for p in PEER_LABELS if any(r["config"]["system"] == p for r in records)]
    head = ["system", "N", "ms/step", "IQR", "MFU", "×DDP", "×DDP/round", "×fast", "×fast/round"]
    head += ["×s2"]
    head += [f"×{PEER_LABELS[p]}" for p in peers] + ["Δloss"]
    rows = []
    for rec in records:
        c, res = rec["config"], rec["result"]
        row = [c["system"], str(c["world_size"])]
        if res["status"] != "ok":
            rows.append(row + [res["status"]] + [""] * (len(head) - 3))
            continue

        def ratio(x):
            return "—" if x is None else f"{x:.2f}"

        diff = res.get("max_abs_loss_diff_vs_ddp")
        row += [
            f"{res['median_ms']:.0f}",
            f"{res['p25_ms']:.0f}-{res['p75_ms']:.0f}",
            "—" if res.get("mfu") is None else f"{100 * res['mfu']:.1f}%",
            ratio(res.get("ratio_vs_ddp")),
            spread(res.get("ratio_vs_ddp_by_repeat")),
            ratio(res.get("ratio_vs_fast")),
            spread(res.get("ratio_vs_fast_by_repeat")),
            ratio(res.get("ratio_vs_stage2")),
            *(ratio(res.get("ratio_vs", {}).get(p)) for p in peers),
            "—" if diff is None else f"{diff:.0e}",
        ]
        rows.append(row)
    return _render(head, rows, markdown)


PROFILE_COLUMNS = (
    ("step", "step"),
    ("forward", "forward"),
    ("backward", "backward"),
    ("backward.hooks", "hooks"),
    ("backward.finalize", "finalize"),
    ("update", "update"),
    ("update.reduce", "reduce"),
    ("update.refresh", "all-gather"),
    ("update.optimizer", "optimizer"),
    ("update.finish", "ag-wait"),
    ("update.control", "control"),
    ("update.other", "other"),
)
"""Phases of --profile (key, heading); a peer has forward, backward and update only. For ours,
backward holds hooks (flatten + launch, autograd's reductions at stage 2) and finalize (the
micro-step's waits); update holds reduce (the reduction at step()), all-gather (new working
parameters, stages 1-2: launched per unit), ag-wait (waiting for those all-gathers after the
last update), optimizer, control (norm partials and the step's one control exchange: losses,
overflow flag, partials) and other (the rest: 1/M scaling, clipping, ...)."""


def format_profile(records: list[dict], *, markdown: bool = False) -> str:
    """Phase medians in ms (mean over ranks, median over steps) of the profiled systems."""
    head = ["system", "N"] + [h for _, h in PROFILE_COLUMNS]
    rows = []
    for rec in records:
        prof = dict(rec["result"].get("profile_ms") or {})
        if not prof:
            continue
        if "update.optimizer" in prof:  # ours: the remainder of update is "other"
            parts = ("reduce", "refresh", "finish", "optimizer", "control")
            prof["update.other"] = prof["update"] - sum(prof.get(f"update.{k}", 0.0) for k in parts)
        row = [rec["config"]["system"], str(rec["config"]["world_size"])]
        rows.append(row + [f"{prof[k]:.0f}" if k in prof else "" for k, _ in PROFILE_COLUMNS])
    return _render(head, rows, markdown)


PHASE_PARTS = (
    ("forward", "forward"),
    ("backward.rest", "backward"),
    ("backward.hooks", "hooks"),
    ("backward.finalize", "finalize"),
    ("update.reduce", "reduce"),
    ("update.refresh", "all-gather"),
    ("update.finish", "ag-wait"),
    ("update.optimizer", "optimizer"),
    ("update.control", "control"),
    ("update.other", "update, rest"),
)
"""The disjoint parts of a profiled step (key, label), in the order a step runs them: they sum
to forward + backward + update (PROFILE_COLUMNS says what each holds). A peer's update is one
part ("update, rest"), its backward one ("backward")."""


def phase_parts(record: dict) -> dict[str, float]:
    """The record's profile split into PHASE_PARTS (ms), or {} when it was not profiled."""
    prof = record["result"].get("profile_ms") or {}
    if not prof:
        return {}
    inner = ("backward.hooks", "backward.finalize")
    updates = ("update.reduce", "update.refresh", "update.finish", "update.optimizer")
    parts = {k: prof.get(k, 0.0) for k in (*inner, *updates, "update.control")}
    parts["forward"] = prof["forward"]
    parts["backward.rest"] = prof["backward"] - sum(prof.get(k, 0.0) for k in inner)
    parts["update.other"] = prof["update"] - sum(
        prof.get(k, 0.0) for k in (*updates, "update.control")
    )
    return {k: parts[k] for k, _ in PHASE_PARTS}


def cpu_per_step(record: dict) -> dict[str, float] | None:
    """[Note: CPU time per step] (measure/parts/bench_ranks.py) of an ok record: the medians
    over repeats and ranks of a rank's CPU ms per timed step and of its kernel part (user: the
    rest); None for records without them."""
    res = record["result"]
    if res.get("status") != "ok" or "rank_cpu_ms" not in res:
        return None
    cpu = float(np.median([x for rep in res["rank_cpu_ms"] for x in rep]))
    system = float(np.median([x for rep in res["rank_system_ms"] for x in rep]))
    return {"cpu_ms": cpu, "system_ms": system, "user_ms": cpu - system}


def format_cpu(records: list[dict], *, markdown: bool = False) -> str:
    """CPU per rank and step beside the wall time, and both beside DDP's of the same group and N:
    where CPU ≈ wall the cores are the limit, and a system's extra CPU is extra time."""
    head = ["system", "N", "ms/step", "CPU ms/step", "user", "kernel", "CPU÷wall"]
    head += ["Δwall vs DDP", "ΔCPU vs DDP"]
    by_key = {system_key(r): r for r in records}
    rows = []
    for rec in records:
        cpu = cpu_per_step(rec)
        if cpu is None:
            continue
        system, n, group = system_key(rec)
        wall = rec["result"]["median_ms"]
        ddp = by_key.get(("ddp", n, group))
        ddp_cpu = cpu_per_step(ddp) if ddp else None
        dw = f"{wall - ddp['result']['median_ms']:+.0f}" if ddp_cpu else "—"
        dc = f"{cpu['cpu_ms'] - ddp_cpu['cpu_ms']:+.0f}" if ddp_cpu else "—"
        rows.append(
            [system, str(n), f"{wall:.0f}", f"{cpu['cpu_ms']:.0f}", f"{cpu['user_ms']:.0f}"]
            + [f"{cpu['system_ms']:.0f}", f"{cpu['cpu_ms'] / wall:.2f}", dw, dc]
        )
    return _render(head, rows, markdown)


def format_all(records: list[dict], *, markdown: bool = False) -> list[str]:
    """Every table the records have data for, in the order measure.bench prints them."""
    systems = {r["config"]["system"] for r in records}
    has = lambda key: any(key in r["result"] for r in records)  # noqa: E731
    out = [format_table(records, markdown=markdown)]
    if systems & set(TARGETS):
        out.append(format_targets(records, markdown=markdown))
    if has("profile_ms"):
        out.append(format_profile(records, markdown=markdown))
    if has("rank_cpu_ms"):
        out.append(format_cpu(records, markdown=markdown))
    if has("memory"):
        out.append(format_memory(records, markdown=markdown))
    if systems & set(MP_SYSTEMS):
        out.append(format_mp(records, markdown=markdown))
    return out


def format_memory(records: list[dict], *, markdown: bool = False) -> str:
    """Peak tensor bytes per rank (MiB) of the records that carry the memory pass: the peak, the
    bytes alive between steps, the analytic states and saved activations, our systems' bound
    ([Note: the memory bound]), and the ratios."""
    grouped = _grouped(records)
    head = ["system", "N", *(["group"] if grouped else []), "level", "peak MiB", "between steps"]
    head += [
        "states",
        "activations",
        "÷accounted",
        "bound",
        "÷bound",
        "×DDP",
        "×best peer",
        "drift",
    ]
    rows = []
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    ratio = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    for rec in records:
        mem = rec["result"].get("memory")
        if not mem:
            continue
        best = mem.get("best_peer_at_level")
        versus = ratio(mem.get("peak_vs_best_peer"))
        rows.append(
            [
                rec["config"]["system"],
                str(rec["config"]["world_size"]),
                *([rec["config"].get("group") or "—"] if grouped else []),
                str(mem["sharding_level"]),
                mib(mem["peak_bytes"]),
                mib(mem["resident_bytes"]),
                mib(mem["analytic_states_bytes"]),
                mib(mem["activation_bytes"]),
                ratio(mem.get("peak_over_accounted")),
                mib(mem["bound_bytes"]) if "bound_bytes" in mem else "—",
                ratio(mem.get("peak_over_bound")),
                ratio(mem.get("peak_vs_ddp")),
                versus if versus == "—" else f"{versus} ({PEER_LABELS.get(best, best)})",
                f"{mem['drift_bytes']}",
            ]
        )
    return _render(head, rows, markdown)


def format_mp(records: list[dict], *, markdown: bool = False) -> str:
    """The model-parallel systems' table: the mesh, the step time against DDP and Megatron, and
    one steady step's counted elements per rank (rank 0; ZeRO's kind "model", MP's kind "mp")."""
    head = ["system", "N", "N_d", "N_m", "stage", "ms/step", "IQR", "×DDP", "×Megatron"]
    head += ["model elements", "mp elements"]
    rows = []
    ratio = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    for rec in records:
        c, res = rec["config"], rec["result"]
        if c["system"] not in MP_SYSTEMS:
            continue
        row = [c["system"], str(c["world_size"]), str(c["dp"]), str(c["mp"]), str(c["stage"])]
        if res["status"] != "ok":
            rows.append(row + [res["status"]] + [""] * (len(head) - len(row) - 1))
            continue
        counted = res["traffic_per_step"][0]["elements"]
        rows.append(
            row
            + [f"{res['median_ms']:.0f}", f"{res['p25_ms']:.0f}-{res['p75_ms']:.0f}"]
            + [ratio(res.get("ratio_vs_ddp")), ratio(res.get("ratio_vs_megatron"))]
            + [f"{counted['model']:,}", f"{counted['mp']:,}"]
        )
    return _render(head, rows, markdown)


def _render(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(
        x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths))
    )
    return "\n".join([fmt(head), *(fmt(r) for r in rows)])
