"""measure.bench's systems and tables: which systems there are, their ratios against DDP, the fast
mode and the peers, and the tables drawn from the records (never from numbers typed in).

Kept apart from measure/bench.py (which builds and times the systems in the ranks) so that
paper_figures and the notebooks can rebuild a table from a results file without the timing code.
The legend of every column: benchmarks/cpu-2core-2026-11.md, section "How the step time is taken".
"""

from __future__ import annotations

import numpy as np

from zero.common.memory import model_state_breakdown

OURS = (
    "zero-s0",
    "zero-s1",
    "zero-s2",
    "zero-s3",
    "zero-s0-det",
    "zero-s1-det",
    "zero-s2-det",
    "zero-s3-det",
)
PEERS = (
    "ddp",
    "zero-redundancy",
    "fsdp2",
    "fsdp2-reshard",
    "deepspeed-s1",
    "deepspeed-s2",
    "deepspeed-s3",
)
MP_DEGREES = (1, 2, 4)
"""N_m of the model-parallel systems ([Note: model-parallel systems] in measure/bench_mp.py)."""
MP_SYSTEMS = (
    "megatron-lm",
    "megatron-lm-det",
    *(f"zero-s{s}-mp{m}{mode}" for mode in ("", "-det") for s in range(4) for m in MP_DEGREES),
)
"""Tensor parallelism (zero/mp/): "megatron-lm" is MP alone (N_m = N, no ZeRO partitioning),
zero-s<stage>-mp<N_m> ZeRO inside the DP groups of N_d = N/N_m ranks; -det deterministic."""
DEFAULT_SYSTEMS = OURS + PEERS
"""What measure.bench times when --systems is left out: the data-parallel systems."""
SYSTEMS = OURS + PEERS + MP_SYSTEMS


def mp_layout(name: str) -> tuple[int, int | None, bool]:
    """(stage, N_m, deterministic) of an MP system; N_m None for megatron-lm (it is N)."""
    if name not in MP_SYSTEMS:
        raise ValueError(f"system={name!r}: allowed are {MP_SYSTEMS}")
    det = name.endswith("-det")
    if name.startswith("megatron-lm"):
        return 0, None, det
    return int(name[6]), int(name.removesuffix("-det").split("-mp")[1]), det


PEER_LABELS = {
    "zero-redundancy": "ZeRO-R",
    "fsdp2": "FSDP2",
    "fsdp2-reshard": "FSDP2-r",
    "deepspeed-s1": "DS-1",
    "deepspeed-s2": "DS-2",
    "deepspeed-s3": "DS-3",
}
"""Short column headings of the ×<peer> ratios."""


SHARDING_LEVEL = {
    **{name: int(name[6]) for name in OURS},
    "ddp": 0,
    "zero-redundancy": 1,
    "deepspeed-s1": 1,
    "deepspeed-s2": 2,
    "fsdp2": 3,
    "fsdp2-reshard": 3,
    "deepspeed-s3": 3,
    **{name: mp_layout(name)[0] for name in MP_SYSTEMS},
}
"""Which ZeRO stage's states each system partitions: what its memory is compared at. FSDP2
shards parameters at rest either way; without resharding it keeps them gathered from forward
to the end of backward, which its measured peak shows."""


def analytic_states_bytes(name: str, n: int, num_params: int, mp: int = 1) -> float:
    """zero/common/memory.py's model states per rank of `name`'s sharding level at N = n, in the
    benchmark's configuration: fp32 working parameters and gradients, no separate master (the
    working copy is it), AdamW's two fp32 states, M = N (no partial sums), no padding. With
    model parallelism num_params is the rank's slice (zero.mp.tp_num_params) and the states
    are partitioned over the DP group of n / mp ranks."""
    return model_state_breakdown(
        num_params=num_params,
        world_size=n // mp,
        stage=SHARDING_LEVEL[name],
        param_bytes=4,
        grad_bytes=4,
        master_bytes=0,
        optimizer_states=2,
        state_bytes=4,
        accumulation=1,
    ).total


# [Note: the memory bound] What our engine may hold at once beyond the analytic model states S, for
# the benchmark's configuration (fp32 throughout, M = N: one micro-step, no clipping), from the
# model's shape and the config alone, never from the engine. X = B·T·V·4 bytes (the logits); G_b,
# G_r the padded bytes of the largest block unit and of the root unit (reference/layout.py's layout
# of their parameters at this N), E the bytes of the optimizer's extent (Ψ·4, or Ψ·4/N from stage 1
# on, padded), A the activations autograd saves (measured on the plain model).   peak <= S + max(A +
# 3X + T_bwd, T_step) - 3X, the loss: the logits the caller keeps until its backward is done, and
# inside the   cross-entropy's backward the gradients of the log-softmax output and of the logits
# (the   log-softmax output itself is saved, in A). DDP's measured excess is exactly this.
# - T_bwd, the engine in forward and backward:
#   G_r + G_b  gradients waiting in .grad for their unit's last one: the running block's, and
#              the root's, whose tied head weight gets its gradient first and whose embedding
#              completes it last;
#   reductions at most 2 in flight ([Note: bounded reductions in flight]), each with a receive
#              buffer of N·L (stage 0 deterministic, stage 1: the input is u.grad, in S) or an
#              arrival and a receive buffer (stages 2-3): 2·G_b or 4·G_b (stage 0 fast: none,
#              the all-reduce is in place);
#   held       stage 0 deterministic: each unit's shard of R, kept by its gradient all-gather
#              until step(): E/N;
#   gathered   stage 3: the root's full working buffer and max_live = 2 blocks' (W = G here).
# - T_step, the update, when the activations are gone: the scaled gradient (E), at most one
#   whole-extent temporary of the optimizer (E; the deterministic blocks take 3 MiB, torch's   fused
# kernel works in place), and stages 1-2 the send buffers of the parameter all-gather,   one shard
# per unit, kept until the step ends (E). Each term is the most it can be, and they are added as if
# at one moment, so this bounds the peak from above; how close it is, the memory table shows
# (÷bound).
_GATHER_DEPTH = 2  # zero/stages/stage3.py: max_live
_REDUCTIONS = 2  # zero/stages/base.py: Reductions.max_inflight


def memory_bound(config: dict) -> dict[str, float] | None:
    """The terms of [Note: the memory bound] in bytes for one of OURS' records (config as a
    record holds it); None for the other systems (their transients are not ours to derive)."""
    if config["system"] not in OURS:
        return None
    from reference.layout import unit_layout
    from zero.workloads.models import GPT, GPTConfig

    n, stage = config["world_size"], config["stage"]
    det = config["options"]["deterministic"]
    chunk = config["options"]["chunk"]
    model = GPT(GPTConfig(**config["gpt"]), device="meta")
    units = {name: [] for name in model.unit_names()}
    root = []
    for name, p in model.named_parameters():
        owner = next((u for u in units if name.startswith(u + ".")), None)
        (units[owner] if owner else root).append((name, tuple(p.shape)))

    def padded(params) -> int:  # bytes of the unit's flat buffer, N·L fp32 elements
        return 4 * unit_layout(params, chunk=chunk).padded_numel(n)

    g_b = max(padded(ps) for ps in units.values())
    g_r = padded(root)
    whole = g_r + sum(padded(ps) for ps in units.values())
    extent = whole if stage == 0 else whole / n
    g = config["gpt"]
    x = config["batch_size"] * config["seq_len"] * g["vocab_size"] * 4
    terms = {
        "loss": 3 * x,
        "waiting": g_r + g_b,
        "reductions": 0 if stage == 0 and not det else _REDUCTIONS * g_b * (2 if stage >= 2 else 1),
        "held": whole / n if stage == 0 and det else 0,
        "gathered": g_r + _GATHER_DEPTH * g_b if stage == 3 else 0,
        "step": 2 * extent + (whole / n if stage in (1, 2) else 0),
    }
    return {k: float(v) for k, v in terms.items()}


def _loss_by_step(res: dict) -> dict[int, float]:
    out = dict(enumerate(res.get("build_losses", [])))
    for first, rep in zip(res["first_data_steps"], res["losses"]):
        out.update((first + i, loss) for i, loss in enumerate(rep))
    return out


# [Note: system groups] At `large` the fifteen systems do not fit in memory at once, so they run
# in groups (BenchConfig.group), one run each, whose records are merged. A step time is compared
# only with what ran in the same run, interleaved round by round ([Note: alternating repeats]):
# ×DDP and ×fast pair records of one group and N, so each group carries its own `ddp` and each
# deterministic stage its fast one. A peer in another group is compared through DDP, as
# (mine ÷ my group's DDP) ÷ (peer's ÷ its group's DDP). Memory peaks do not depend on what else
# ran, so they are compared across groups as they are.


def _system_key(r: dict) -> tuple[str, int, str]:
    c = r["config"]
    return c["system"], c["world_size"], c.get("group", "")


def merge_records(runs: list[list[dict]]) -> list[dict]:
    """The records of several runs (groups) as one list; a (system, N, group) measured twice
    is refused by name, since its ratios would pair with either."""
    seen, out = set(), []
    for records in runs:
        for r in records:
            key = _system_key(r)
            if key in seen:
                system, n, group = key
                raise ValueError(
                    f"records: system {system!r} at N = {n} in group {group!r} appears twice; "
                    "allowed is one record per (system, N, group): give each run its own --group"
                )
            seen.add(key)
            out.append(r)
    return out


def add_ratios(records: list[dict]) -> None:
    """Fill each ok record's ratios against DDP, the fast mode and the peers, at the same N
    ([Note: system groups]: time ratios within one group, peers across groups through DDP)."""
    every = [r for r in records if r["result"]["status"] == "ok"]
    groups: dict[str, dict] = {}
    for r in every:
        system, n, group = _system_key(r)
        groups.setdefault(group, {})[(system, n)] = r
    for ok in groups.values():
        for (name, n), rec in ok.items():
            _time_ratios(name, n, rec["result"], ok)
    anywhere: dict = {}  # (system, N) -> its record in the first group that has it
    for ok in groups.values():
        for key, rec in ok.items():
            anywhere.setdefault(key, rec)
    for ok in groups.values():
        for (name, n), rec in ok.items():
            if name in OURS:
                rec["result"]["ratio_vs"] = _peer_ratios(n, rec["result"], ok, anywhere)
    for ok in groups.values():
        for (name, n), rec in ok.items():
            if "memory" in rec["result"]:
                mem = rec["result"]["memory"]
                _memory_ratios(name, n, mem, {**anywhere, **ok}, rec["config"])


def _peer_ratios(n: int, res: dict, ok: dict, anywhere: dict) -> dict[str, float]:
    out = {}
    for peer in PEERS:
        if (peer, n) in ok:  # the same run: the medians compare directly
            out[peer] = res["median_ms"] / ok[(peer, n)]["result"]["median_ms"]
        elif (peer, n) in anywhere:
            mine, theirs = (
                res.get("ratio_vs_ddp"),
                anywhere[(peer, n)]["result"].get("ratio_vs_ddp"),
            )
            if mine and theirs:
                out[peer] = mine / theirs
    return out


def _time_ratios(name: str, n: int, res: dict, ok: dict) -> None:
    """×DDP, ×fast, ×stage 2 and ×Megatron of one record, against records of its own run."""
    mine = res["median_ms"]
    ddp = ok.get(("ddp", n))
    res["ratio_vs_ddp"] = mine / ddp["result"]["median_ms"] if ddp else None
    if ddp:
        # Paired by round: both ran within seconds of each other ([Note: alternating repeats]).
        res["ratio_vs_ddp_by_repeat"] = [
            a / b for a, b in zip(res["repeat_medians_ms"], ddp["result"]["repeat_medians_ms"])
        ]
        # matched by data step: a repeat timed again shifts one system's steps
        mine_at, theirs_at = _loss_by_step(res), _loss_by_step(ddp["result"])
        pairs = [abs(mine_at[s] - theirs_at[s]) for s in mine_at.keys() & theirs_at.keys()]
        res["max_abs_loss_diff_vs_ddp"] = max(pairs) if pairs else None
    if name in OURS:
        fast = ok.get((name.removesuffix("-det"), n))
        if name.endswith("-det") and fast:
            res["ratio_vs_fast"] = mine / fast["result"]["median_ms"]
            res["ratio_vs_fast_by_repeat"] = [
                a / b for a, b in zip(res["repeat_medians_ms"], fast["result"]["repeat_medians_ms"])
            ]
        two = ok.get((name.replace("-s3", "-s2"), n))
        if name.startswith("zero-s3") and two:
            res["ratio_vs_stage2"] = mine / two["result"]["median_ms"]
    if name in MP_SYSTEMS:
        fast = ok.get((name.removesuffix("-det"), n))
        if name.endswith("-det") and fast:
            res["ratio_vs_fast"] = mine / fast["result"]["median_ms"]
        mega = ok.get(("megatron-lm-det" if name.endswith("-det") else "megatron-lm", n))
        res["ratio_vs_megatron"] = mine / mega["result"]["median_ms"] if mega else None


def _memory_ratios(name: str, n: int, mem: dict, ok: dict, config: dict) -> None:
    """Peak over DDP's, over the best peer's at the same sharding level (ours), over the
    accounted bytes (analytic states + saved activations), and over [Note: the memory bound]
    (ours)."""

    def peak(system):
        rec = ok.get((system, n))
        return rec["result"].get("memory", {}).get("peak_bytes") if rec else None

    ddp = peak("ddp")
    mem["peak_vs_ddp"] = mem["peak_bytes"] / ddp if ddp else None
    level = SHARDING_LEVEL[name]
    peers = [p for p in PEERS if SHARDING_LEVEL[p] == level and peak(p)]
    best = min(peers, key=peak) if peers else None
    mem["best_peer_at_level"] = best
    mem["peak_vs_best_peer"] = mem["peak_bytes"] / peak(best) if name in OURS and best else None
    accounted = mem["analytic_states_bytes"] + mem["activation_bytes"]
    mem["accounted_bytes"] = accounted
    mem["peak_over_accounted"] = mem["peak_bytes"] / accounted
    terms = memory_bound(config)
    if terms is not None:  # [Note: the memory bound]
        backward = mem["activation_bytes"] + sum(v for k, v in terms.items() if k != "step")
        mem["bound_terms"] = terms
        mem["bound_bytes"] = mem["analytic_states_bytes"] + max(backward, terms["step"])
        mem["peak_over_bound"] = mem["peak_bytes"] / mem["bound_bytes"]


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
    """[Note: CPU time per step] (measure/bench.py) of an ok record: the medians over repeats and
    ranks of a rank's CPU ms per timed step and of its kernel part (user: the rest); None for
    records without them."""
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
    by_key = {_system_key(r): r for r in records}
    rows = []
    for rec in records:
        cpu = cpu_per_step(rec)
        if cpu is None:
            continue
        system, n, group = _system_key(rec)
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
