"""measure.bench's results records (zero.common.results), one per (system, N): the configuration
(_base_config) and what the ranks measured, summarised (record): the step times and their
spread, the losses, the CPU per step, the MFU, and the phases and the memory pass where they ran.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from zero.common.results import make_record

from .. import mfu
from .bench_config import BenchConfig
from .bench_ranks import BUILD_WARMUP, MEMORY_STEPS
from .bench_systems import MP_SYSTEMS, OURS, SHARDING_LEVEL, analytic_states_bytes

KIND = "bench.step_time"
"""The results-record kind (zero.common.results) of one (system, N) measurement."""


def _stats(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    p25, median, p75 = np.percentile(a, [25, 50, 75])
    return {
        "median_ms": float(median),
        "p25_ms": float(p25),
        "p75_ms": float(p75),
        "min_ms": float(a.min()),
        "max_ms": float(a.max()),
    }


def _base_config(name: str, n: int, cfg: BenchConfig) -> dict:
    w = cfg.workload
    stage = int(name[6]) if name in OURS else int(name[-1]) if name.startswith("deep") else None
    config = {
        "benchmark": "step_time",
        "system": name,
        "family": "ours" if name in OURS else "peer",
        "stage": stage,
        "mode": ("deterministic" if name.endswith("-det") else "fast") if name in OURS else None,
        "world_size": n,
        "micro_batches": n,
        "precision": "fp32",
        "reduce_dtype": "fp32",
        "optimizer": "adamw",
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "weight_decay_on": "matrices (ndim >= 2); none on biases and norms",
        "model": cfg.model,
        "gpt": asdict(w.gpt),
        "batch_size": w.batch_size,
        "seq_len": w.gpt.block_size,
        "seed": cfg.seed,
        "repeats": cfg.repeats,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "build_warmup": BUILD_WARMUP,
        "quiet_cores": cfg.quiet_cores,
        "retries": cfg.retries,
        "note": cfg.note,
        "group": cfg.group,
        "malloc": cfg.malloc,
    }
    if name in MP_SYSTEMS:
        from ..bench_mp import config_fields

        config.update(config_fields(name, n, cfg))
    return config


def record(name, n, cfg, built, timing, profile, prov, redone, peaks, memory=None) -> dict:
    config = _base_config(name, n, cfg)
    first = built[0]
    if first["status"] != "ok" or timing is None:
        statuses = sorted({b["status"] for b in built})
        result = {"status": "failed" if "failed" in statuses else statuses[0]}
        errors = [b.get("error") for b in built if b.get("error")]
        if errors:
            result["error"] = errors[0]
        return make_record(config=config, result=result, kind=KIND, provenance=prov)
    config.update(
        num_params=first["num_params"],
        threads_per_rank=max(b["threads"] for b in built),
        device=first["device"],
        backend=_backend(first["device"]),
        options=first["options"],
    )
    # timing[r][rank] = {"seconds": [...], "losses": [...], "first_step": s}
    rank_ms = [[[1e3 * t for t in per_rank["seconds"]] for per_rank in rep] for rep in timing]
    step_ms = [[max(col) for col in zip(*rep)] for rep in rank_ms]
    losses = [[float(np.mean(col)) for col in zip(*(p["losses"] for p in rep))] for rep in timing]
    samples = [t for rep in step_ms for t in rep]
    result = {
        "status": "ok",
        **_stats(samples),
        "repeat_medians_ms": [float(np.median(rep)) for rep in step_ms],
        "step_ms": step_ms,
        "rank_step_ms": rank_ms,
        "losses": losses,
        "first_data_steps": [rep[0]["first_step"] for rep in timing],
        "build_losses": [float(np.mean(col)) for col in zip(*(b["build_losses"] for b in built))],
        # cores other processes used during each kept repeat (None: not measurable here),
        # and during the repeats that were timed again because of them
        "other_cores": [rep[0]["other_cores"] for rep in timing],
        "redone_other_cores": redone.get(name, []),
        "waited_for_quiet_s": sum(rep[0]["waited_s"] for rep in timing),
        "traffic_per_step": [b["traffic"] for b in built],  # per rank; None: not our engine
        # [Note: CPU time per step]: per repeat and rank, ms per timed step of the loop's wall
        # time, its CPU time and the kernel's part of it
        "rank_span_ms": [[1e3 * p["span_s"] / cfg.steps for p in rep] for rep in timing],
        "rank_cpu_ms": [[1e3 * p["timed_cpu_s"] / cfg.steps for p in rep] for rep in timing],
        "rank_system_ms": [[1e3 * p["system_s"] / cfg.steps for p in rep] for rep in timing],
    }
    # MFU (measure/mfu.py): this rank's model FLOPs over the step's median time (the slowest
    # rank's), against the median over ranks of the peak each measured
    flops = mfu.step_flops(cfg.workload.gpt, cfg.workload.batch_size)
    peak = float(np.median([p["peak_flops"] for p in peaks]))
    config["peak_dtype"] = peaks[0]["dtype"]
    use = mfu.utilisation(flops, result["median_ms"] / 1e3, peak)
    result.update(
        flops_per_rank_step=flops,
        peak_flops_per_rank=peak,
        rank_peak_flops=[p["peak_flops"] for p in peaks],
        achieved_flops_per_rank=use["achieved_flops"],
        mfu=use["mfu"],
    )
    if profile is not None:
        result["profile_ms"], result["profile_steps_ms"] = _profile_summary(profile)
    if memory is not None:
        params = config.get("slice_params", config["num_params"])
        result["memory"] = _memory_summary(name, n, params, memory, config.get("mp", 1))
    return make_record(config=config, result=result, kind=KIND, provenance=prov)


def _memory_summary(name: str, n: int, num_params: int, per_rank: list[dict], mp=1) -> dict:
    """The memory pass's figures, the largest over ranks (the rank a budget must fit), with
    every rank's peak and the analytic model states of the system's sharding level."""
    states = [m["engine_states_bytes"] for m in per_rank]
    return {
        "peak_bytes": max(m["peak_bytes"] for m in per_rank),
        "rank_peak_bytes": [m["peak_bytes"] for m in per_rank],
        "resident_bytes": max(m["resident_bytes"] for m in per_rank),
        "build_peak_bytes": max(m["build_peak_bytes"] for m in per_rank),
        "drift_bytes": max(m["drift_bytes"] for m in per_rank),
        "activation_bytes": max(m["activation_bytes"] for m in per_rank),
        "engine_states_bytes": None if None in states else max(states),
        "analytic_states_bytes": analytic_states_bytes(name, n, num_params, mp),
        "sharding_level": SHARDING_LEVEL[name],
        "steps": MEMORY_STEPS,
        "method": per_rank[0]["method"],
    }


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _profile_summary(per_rank: list[list[dict[str, float]]]) -> tuple[dict, dict]:
    """Per phase: the median over steps of the mean over ranks, in ms; and the per-step means
    themselves. The phases nest within each step (a sub-phase inside its phase, the phases inside
    the step), so the per-step values add up; the medians need not (a median of a sum is not the
    sum of the medians)."""
    phases = sorted({k for rank in per_rank for step in rank for k in step})
    medians, steps = {}, {}
    for k in phases:
        per_step = [
            1e3 * float(np.mean([rank[i].get(k, 0.0) for rank in per_rank]))
            for i in range(len(per_rank[0]))
        ]
        medians[k], steps[k] = float(np.median(per_step)), per_step
    return medians, steps
