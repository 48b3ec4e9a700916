"""measure.bench's systems and tables: which systems there are, their ratios against DDP, the fast
mode and the peers, and the tables drawn from the records (never from numbers typed in).

Kept apart from measure/bench.py (which builds and times the systems in the ranks) so that
paper_figures and the notebooks can rebuild a table from a results file without the timing code.
Here: the ratios (add_ratios, merge_records) and our systems' memory bound (memory_bound); the
systems' names and analytic states are measure/parts/bench_systems.py's, the tables
measure/parts/bench_format.py's, both importable from here. The legend of every column:
benchmarks/cpu-2core-2026-11.md, section "How the step time is taken".
"""

from __future__ import annotations

from .parts.bench_format import (  # noqa: F401  (the tables, importable from here)
    PHASE_PARTS,
    PROFILE_COLUMNS,
    TARGETS,
    cpu_per_step,
    format_all,
    format_cpu,
    format_memory,
    format_mp,
    format_profile,
    format_table,
    format_targets,
    phase_parts,
    spread,
)
from .parts.bench_systems import (  # noqa: F401  (the systems, importable from here)
    DEFAULT_SYSTEMS,
    MP_DEGREES,
    MP_SYSTEMS,
    OURS,
    PEER_LABELS,
    PEERS,
    SHARDING_LEVEL,
    SYSTEMS,
    analytic_states_bytes,
    mp_layout,
    system_key,
)

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


def merge_records(runs: list[list[dict]]) -> list[dict]:
    """The records of several runs (groups) as one list; a (system, N, group) measured twice
    is refused by name, since its ratios would pair with either."""
    seen, out = set(), []
    for records in runs:
        for r in records:
            key = system_key(r)
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
        system, n, group = system_key(r)
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
