"""python -m measure.bench: one training step of our stages 0-3 timed beside torch DDP,
ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO-1/2/3, same GPT, same data, same N, one run,
then each system's peak tensor bytes per rank. DeepSpeed runs where it is installed
(`DS_BUILD_OPS=0 pip install deepspeed`; on a CPU the benchmark sets DS_ACCELERATOR=cpu); where
it is not, its rows say "not installed" and the other systems run.

    python -m measure.bench --model anchor --world-sizes 2 4 --repeats 8 --steps 6 --json b.json
    python -m measure.bench --model mid --world-sizes 2 4 --json mid.json   # 26.3M, fewer steps
    python -m measure.bench --from-json b.json --markdown          # the tables again, from records
    torchrun --standalone --nproc-per-node 1 -m measure.bench --world-sizes 1   # one GPU, NCCL

Systems (SYSTEMS): zero-s{0..3} (fast mode), zero-s{0..3}-det (deterministic), ddp,
zero-redundancy, fsdp2, fsdp2-reshard, deepspeed-s{1,2,3}; fp32 AdamW, M = N. Model parallelism
(named only, never by default): megatron-lm, zero-s{0..3}-mp{1,2,4}[-det] (measure/bench_mp.py).
Memory (--memory, on by default; [Note: the memory pass]): peak MiB per rank, measured by
measure/tensor_memory.py, beside the analytic model states of the system's sharding level
(zero/common/memory.py) and the activations autograd saves; ×DDP and ×best peer at the same level;
for ours, the bound derived from the model's shape ([Note: the memory bound] in
measure/bench_table.py) and the peak over it.
Legend: N ranks; ms/step the slowest rank's step, median over repeats × steps (IQR its spread);
×DDP / ×fast / ×s2 / ×<peer> ratios of medians; MFU model FLOPs ÷ step time ÷ measured peak
(measure/mfu.py); Δloss the largest loss difference from DDP. Every system, column and rule is
described in benchmarks/cpu-2core-2026-11.md, section "How the step time is taken".
"""

# [Note: alternating repeats] Machine noise comes in bursts of seconds, so repeats go round-robin
# over the systems (repeat 1 of every system, then repeat 2, ...), each round starting one system
# further along; every system lives in the same worker processes, built once. A barrier lines the
# ranks up before each timed step, whose time is the slowest rank's. Speed is reported, never
# asserted: tests check the records.
#
# [Note: disturbed repeats] With local ranks on Linux the driver measures how many cores *other*
# processes used during each repeat (/proc/stat's busy time minus our ranks' and our own). A repeat
# during which they used more than quiet_cores is timed again (up to `retries` times), and before
# each repeat the driver waits (at most quiet_wait_s) for a quiet machine. Every repeat's figure is
# kept in its record ("other_cores"). This drops disturbed samples; it never selects fast ones.

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from zero.common import cli
from zero.common.results import make_record, provenance, read_json, write_json
from zero.workloads.models import GPT

from . import mfu, tensor_memory
from .bench_table import (
    MP_SYSTEMS,
    OURS,
    SHARDING_LEVEL,
    SYSTEMS,
    add_ratios,
    analytic_states_bytes,
    format_all,
    merge_records,
)
from .parts.trainers import (
    MODELS,
    BenchConfig,
    DeepSpeedPeer,
    Ours,
    Phases,
    TorchPeer,
    Trainer,
    rank_device,
    sync,
)

KIND = "bench.step_time"
"""The results-record kind (zero.common.results) of one (system, N) measurement."""
_REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_WARMUP = 2
"""Untimed steps right after building a system (data steps 0 and 1)."""

_LIVE: dict[str, Trainer] = {}
"""The systems built in this rank, by name: they persist between pool calls."""


def prepare_deepspeed(rank: int, n: int) -> str | None:
    """Import DeepSpeed and join its communication layer to the existing group, one rank at a
    time: the first import JIT-compiles a small C++ op, and ranks compiling into the same
    directory at once race. Returns None, or why DeepSpeed cannot run here."""
    device = rank_device()
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Kept between runs (the build is ~30 s); .cache/ is in the ignored build area.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO_ROOT / ".cache" / "torch_extensions"))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    why = None
    for turn in range(n):
        if turn == rank:
            try:
                import deepspeed

                deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
                import logging

                logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            except ModuleNotFoundError as e:
                why = "not installed" if e.name == "deepspeed" else f"unavailable: {e}"
            except Exception as e:  # a broken install must not take the other systems down
                why = f"unavailable: {type(e).__name__}: {e}"
        dist.barrier()
    return why


def _ours(trainer: Trainer) -> bool:
    """Whether the system runs our engine: by the engine it holds, not its class (megatron-lm
    shares MPTrainer with ours but trains without the engine)."""
    from zero.engine import ZeroEngine

    return isinstance(getattr(trainer, "engine", None), ZeroEngine)


def _make(name: str, rank: int, n: int, cfg: BenchConfig) -> Trainer:
    if name in MP_SYSTEMS:
        from .bench_mp import MPTrainer as kind
    else:
        kind = Ours if name in OURS else DeepSpeedPeer if name.startswith("deep") else TorchPeer
    return kind(name, rank, n, cfg)


def _build(rank: int, n: int, name: str, cfg: BenchConfig) -> dict:
    """Build one system in this rank (and warm it up), or say why it cannot run."""
    if name.startswith("deepspeed"):
        why = prepare_deepspeed(rank, n)
        if why is not None:
            return {"status": why}
    try:
        trainer = _make(name, rank, n, cfg)
        # DDP rebuilds its buckets, and allocators settle, in the first steps
        losses = [trainer.step(trainer.batch()) for _ in range(BUILD_WARMUP)]
    except Exception:
        # A rank that fails half-way through a collective leaves its peers waiting; the pool's
        # timeout names them. A failure on every rank (a version mismatch) is reported here.
        return {"status": "failed", "error": traceback.format_exc(limit=8)}
    _LIVE[name] = trainer
    from .bench_mp import step_traffic

    return {
        # the counted collectives of the last warm-up step (a steady one), this rank's
        "traffic": step_traffic(trainer.engine.counter) if _ours(trainer) else None,
        "status": "ok",
        "options": trainer.options(),
        "threads": torch.get_num_threads(),
        "device": str(trainer.device),
        "num_params": GPT(cfg.workload.gpt, device="meta").num_params(),
        "build_losses": losses,  # data steps 0, 1: the same for every system, always
    }


# [Note: CPU time per step] Each rank's CPU time over its timed steps: every thread of the
# process (the compute thread, gloo's, the kernel's work on the rank's behalf in its sockets),
# from the process clock (time.process_time, nanoseconds), and the kernel's part from os.times()
# (clock ticks, 10 ms here: at a step of a few ms only the total is precise). On a machine with
# as many cores as ranks, a rank that is never idle has CPU ≈ wall, and then whatever CPU a
# system spends beyond DDP's, on copying or sending bytes, is wall time too: no overlap hides
# work from a core that has no other to give. Where the ranks outnumber the cores, CPU < wall by
# the time a rank waits for a core. The table (format_cpu) sets each system's CPU per step
# beside its wall time and DDP's.


def _repeat(rank: int, n: int, name: str, steps: int, warmup: int) -> dict:
    """One repeat of one system: warm-up steps, then `steps` timed steps. Per-step seconds."""
    trainer = _LIVE[name]
    cpu0 = time.process_time()
    for _ in range(warmup):
        trainer.step(trainer.batch())
    seconds, losses = [], []
    gc.collect()
    gc.disable()  # a collection pause would be charged to whichever system ran into it
    # [Note: CPU time per step]: this rank's threads over the timed steps (barriers included)
    span0, cpu_t0, times0 = time.perf_counter(), time.process_time(), os.times()
    try:
        for _ in range(steps):
            batch = trainer.batch()  # data is made outside the timed region
            sync(trainer.device)
            dist.barrier()
            t0 = time.perf_counter()
            loss = trainer.step(batch)
            sync(trainer.device)
            seconds.append(time.perf_counter() - t0)
            losses.append(loss)
    finally:
        gc.enable()
    span, cpu_t, times1 = time.perf_counter() - span0, time.process_time() - cpu_t0, os.times()
    return {
        "seconds": seconds,
        "losses": losses,
        "first_step": trainer.data_step - steps,
        "cpu_s": time.process_time() - cpu0,  # every thread of this rank
        "span_s": span,  # wall time of the timed steps' loop
        "timed_cpu_s": cpu_t,  # its CPU time (the process clock: nanoseconds)
        "system_s": times1.system - times0.system,  # of which the kernel's (clock ticks)
    }


def _profile(rank: int, n: int, name: str, steps: int) -> dict:
    """`steps` steps with phase timers: "phases", per step the seconds by phase (plus "step",
    the total), and "cpu_s"."""
    trainer = _LIVE[name]
    cpu0 = time.process_time()
    out = []
    for _ in range(steps):
        batch = trainer.batch()
        ph = Phases()
        ph.device = trainer.device
        with trainer.instrument(ph):
            sync(trainer.device)
            dist.barrier()
            t0 = time.perf_counter()
            trainer.step(batch)
            sync(trainer.device)
            ph.seconds["step"] = time.perf_counter() - t0
        out.append(dict(ph.seconds))
    return {"phases": out, "cpu_s": time.process_time() - cpu0}


MEMORY_STEPS = 3
"""Steps of the memory pass: the first allocates the optimizer states of torch.optim (lazily),
the second is the first steady one, the third shows drift ([Note: the memory pass])."""


def _memory(rank: int, n: int, name: str, cfg: BenchConfig) -> dict:
    """[Note: the memory pass] A fresh copy of system `name`, built and stepped MEMORY_STEPS
    times inside measure.tensor_memory.tracking, so that every byte it holds was allocated in the
    block: "peak_bytes" is the most tensor bytes alive at once during the steps, "resident_bytes"
    those alive after the last, "build_peak_bytes" the construction's peak, "drift_bytes" the
    growth from the second step's end to the third's (0 in steady state; see tensor_memory's
    docstring for what would make it positive). "activation_bytes": what autograd saves for
    backward in a plain GPT's forward of this rank's micro-batch (measure.resident)."""
    from measure.resident import release_free_memory, saved_activations

    device = rank_device()
    cpu0 = time.process_time()
    probe_of = Trainer
    if name in MP_SYSTEMS:  # the rank's slice and its micro-batch
        from .bench_mp import MPProbe as probe_of
    probe = probe_of(name, rank, n, cfg)
    model, batch = probe.model(), probe.batch()
    with saved_activations(model.parameters()) as saved:
        model(*batch)
    acts = saved.nbytes
    del model, batch, saved
    gc.collect()
    states = None
    with tensor_memory.tracking(device) as (mark, trace):
        mark("build")
        trainer = _make(name, rank, n, cfg)
        for i in range(MEMORY_STEPS):
            batch = trainer.batch()
            mark(f"step {i + 1}")
            trainer.step(batch)
            del batch
        mark("end")
        if _ours(trainer):
            report = trainer.engine.memory_report()  # model states; comm_buffers are transient
            states = sum(report.get(k, 0) for k in ("params", "frozen", "grads", "master"))
            states += report["optimizer"]
        del trainer
        gc.collect()
    release_free_memory()  # the next system's pass starts from what this rank held before this one
    last = f"step {MEMORY_STEPS}"
    return {
        "peak_bytes": trace.peak("step 1"),
        "resident_bytes": trace.end(last),
        "build_peak_bytes": trace.peak_of("build"),
        "drift_bytes": trace.end(last) - trace.end(f"step {MEMORY_STEPS - 1}"),
        "engine_states_bytes": states,
        "activation_bytes": acts,
        "method": tensor_memory.method(device),
        "cpu_s": time.process_time() - cpu0,
    }


def _peak(rank: int, n: int) -> dict:
    """This rank's measured peak FLOP/s, every rank at once ([Note: the peak a rank can reach]
    in measure/mfu.py)."""
    device = rank_device()
    cpu0 = time.process_time()
    peak = mfu.measure_peak_flops(device)
    return {
        "peak_flops": peak,
        "dtype": str(mfu.PEAK_DTYPE[device.type]).removeprefix("torch."),
        "cpu_s": time.process_time() - cpu0,
    }


def _keep_freed_blocks(rank: int, n: int) -> None:
    from measure.resident import keep_freed_blocks

    if rank_device().type == "cpu" and not keep_freed_blocks():
        raise RuntimeError(f"rank {rank}: malloc='keep' needs glibc's mallopt, not found here")


def _drop_all(rank: int, n: int) -> None:
    """Free every system in this rank (a shared pool outlives the benchmark), and hand malloc's
    free pages back to the kernel: without the trim a rank's resident memory stays at the sum of
    every system it has built (glibc keeps freed heap pages), and at `mid` the memory pass that
    follows the timing ran two ranks out of a 24 GiB machine."""
    from measure.resident import release_free_memory

    _LIVE.clear()
    release_free_memory()


# ---------------------------------------------------------------------------------------------
# The driver (the parent process, or every rank under torchrun)


class _World:
    """Runs fn(rank, N, *args) on every rank of one world, returning the results in rank order:
    through a pool of forked local ranks, or on this rank of a torchrun world, gathered."""

    def __init__(self, n: int, pool=None, timeout_s: float = 900.0):
        self.n, self.pool, self.timeout_s = n, pool, timeout_s

    def run(self, fn, *args) -> list:
        if self.pool is not None:
            return self.pool.run(fn, *args, timeout_s=self.timeout_s)
        mine = fn(dist.get_rank(), self.n, *args)
        every: list = [None] * self.n
        dist.all_gather_object(every, mine)
        return every


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


def bench_world(n: int, cfg: BenchConfig, *, pool=None, say=print) -> list[dict]:
    """Build every system of cfg in one world of n ranks, time them round-robin, and return
    one zero.common.results record per system (status "ok", "not installed", "unavailable: ...", or
    "failed"). `pool`: a zero.ranks.launch WorkerPool of n ranks, or None under torchrun."""
    world = _World(n, pool, cfg.timeout_s)
    if cfg.malloc == "keep":  # before any system allocates: every one runs under it
        world.run(_keep_freed_blocks)
    built: dict[str, list[dict]] = {}
    for name in cfg.systems:
        t0 = time.perf_counter()
        built[name] = world.run(_build, name, cfg)
        status = {b["status"] for b in built[name]}
        say(f"  N={n} {name}: {'/'.join(sorted(status))} ({time.perf_counter() - t0:.1f} s)")
    ready = [s for s in cfg.systems if all(b["status"] == "ok" for b in built[s])]
    # [Note: alternating repeats]
    timings: dict[str, list[list[dict]]] = {s: [] for s in ready}
    redone: dict[str, list[float]] = {s: [] for s in ready}
    meter = _Meter(cfg) if pool is not None else None  # other hosts' load is not visible here
    for r in range(cfg.repeats):
        t0 = time.perf_counter()
        order = ready[r % len(ready) :] + ready[: r % len(ready)] if ready else []
        for name in order:
            per_rank, noisy = _undisturbed(world, meter, cfg, _repeat, name, cfg.steps, cfg.warmup)
            timings[name].append(per_rank)
            redone[name] += noisy
        others = [timings[s][-1][0]["other_cores"] for s in order]
        busiest = max((x for x in others if x is not None), default=None)
        say(
            f"  N={n} repeat {r + 1}/{cfg.repeats} ({time.perf_counter() - t0:.1f} s"
            + ("" if busiest is None else f"; others used <= {busiest:.2f} cores")
            + f"; {sum(len(v) for v in redone.values())} repeats redone so far)"
        )
    peaks = _undisturbed(world, meter, cfg, _peak)[0] if ready else None
    profiles = {}
    if cfg.profile:
        for name in ready:
            per_rank, _ = _undisturbed(world, meter, cfg, _profile, name, cfg.steps)
            profiles[name] = [x["phases"] for x in per_rank]
    memory = {}
    if cfg.memory:
        world.run(_drop_all)  # the timed copies are not needed any more: room for the fresh ones
        for name in ready:
            memory[name] = world.run(_memory, name, cfg)
            say(
                f"  N={n} {name}: peak {max(m['peak_bytes'] for m in memory[name]) / 2**20:.1f} MiB"
            )
    world.run(_drop_all)
    prov = provenance()
    return [
        _record(
            name, n, cfg, built[name], timings.get(name), profiles.get(name), prov, redone, peaks,
            memory.get(name),
        )
        for name in cfg.systems
    ]  # fmt: skip


def _undisturbed(world: _World, meter, cfg: BenchConfig, fn, *args) -> tuple[list, list]:
    """world.run(fn, *args), timed again while others used more than cfg.quiet_cores
    ([Note: disturbed repeats]). fn returns a dict per rank with "cpu_s"; each gets
    "other_cores" and "waited_s". Returns (the kept results, other_cores of those redone)."""
    redone = []
    for attempt in range(cfg.retries + 1):
        waited = meter.wait_quiet() if meter else 0.0
        before = meter.read() if meter else None
        per_rank = world.run(fn, *args)
        other = meter.other_cores(before, per_rank) if meter else None
        for x in per_rank:
            x.update(other_cores=other, waited_s=waited)
        if other is None or other <= cfg.quiet_cores or attempt == cfg.retries:
            return per_rank, redone
        redone.append(other)
    raise AssertionError("unreachable: the last attempt returns")


class _Meter:
    """CPU time of the whole machine (Linux /proc/stat), so that the parent can tell how many
    cores processes other than ours used while a repeat ran ([Note: disturbed repeats]).

    Our own CPU time is the ranks' process times (every thread, gloo's included) plus this
    process's; the rest of the machine's busy time belongs to others."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def busy(self) -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                cpu = f.readline().split()
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
        ticks = [int(x) for x in cpu[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / self.tick

    def read(self) -> tuple[float | None, float, float]:
        return self.busy(), time.process_time(), time.perf_counter()

    def other_cores(self, before, per_rank: list[dict] | None = None) -> float | None:
        busy, cpu, wall = self.read()
        if busy is None or before[0] is None:
            return None
        ours = (cpu - before[1]) + sum(x["cpu_s"] for x in per_rank or ())
        return max(0.0, (busy - before[0] - ours) / max(wall - before[2], 1e-9))

    def wait_quiet(self) -> float:
        """Wait (probing half a second at a time, at most quiet_wait_s) until others use at most
        quiet_cores while our ranks sit idle; returns the seconds waited."""
        if self.cfg.quiet_wait_s <= 0:
            return 0.0
        t0 = time.perf_counter()
        while True:
            before = self.read()
            time.sleep(0.5)
            other = self.other_cores(before)
            waited = time.perf_counter() - t0
            if other is None or other <= self.cfg.quiet_cores or waited >= self.cfg.quiet_wait_s:
                return waited


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
        from .bench_mp import config_fields

        config.update(config_fields(name, n, cfg))
    return config


def _record(name, n, cfg, built, timing, profile, prov, redone, peaks, memory=None) -> dict:
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


def run_bench(cfg: BenchConfig, *, pools=None, say=print, done=None) -> list[dict]:
    """Every world size of cfg; returns the records with ratios filled in.

    pools: a function N -> WorkerPool to run in (e.g. zero.ranks.local.get_pool); None starts a
    fresh pool per N and closes it afterwards. Under torchrun, only the launched world size runs.
    done: called with the records so far after each world size (main writes them, so that a
    failure at one N keeps the measurements of the others).
    """
    from zero.ranks import launch, local

    records = []
    if launch.under_torchrun():
        if not dist.is_initialized():
            launch.init_from_env()
        if rank_device().type == "cpu":
            torch.set_num_threads(1)  # as the forked ranks have: one thread per rank
        n = dist.get_world_size()
        records += bench_world(n, cfg, say=say)
    else:
        for n in cfg.world_sizes:
            if pools is not None:
                records += bench_world(n, cfg, pool=pools(n), say=say)
            else:
                with local.WorkerPool(n, timeout_s=cfg.timeout_s) as pool:
                    records += bench_world(n, cfg, pool=pool, say=say)
            if done is not None and n != cfg.world_sizes[-1]:
                add_ratios(records)
                done(records)
    add_ratios(records)
    return records


def parse(argv=None) -> tuple[BenchConfig, argparse.Namespace]:
    """The configuration and the output options of a command line."""
    p = cli.new_parser("python -m measure.bench", __doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--from-json", nargs="+", default=None,
        help="print the tables of results files only (several: merged; with --json, written)",
    )  # fmt: skip
    return cli.parse(
        BenchConfig, argv, parser=p, aliases={"timeout_s": ("--timeout",)},
        choices={"model": MODELS, "systems": SYSTEMS},
    )  # fmt: skip


def read_results(path: str) -> list[dict]:
    """The records of a results file of `python -m measure.bench --json`; a ValueError naming
    the file and what is wrong with it (unreadable, not UTF-8 JSON, not such a file)."""
    allowed = "allowed are results files of python -m measure.bench --json"
    if not os.path.isfile(path):
        raise ValueError(f"from_json={path!r}: no such file; {allowed}")
    try:
        data = read_json(path)
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"from_json={path!r}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
            f"{exc.start}); {allowed}"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"from_json={path!r}: not JSON ({exc}); {allowed}") from None
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ValueError(f"from_json={path!r}: cannot be read ({why}); {allowed}") from None
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise ValueError(f"from_json={path!r}: has no list of 'records'; {allowed}")
    for i, r in enumerate(records):
        if not (
            isinstance(r, dict)
            and isinstance(r.get("config"), dict)
            and isinstance(r.get("result"), dict)
            and {"system", "world_size"} <= set(r["config"])
            and "status" in r["result"]
        ):
            raise ValueError(
                f"from_json={path!r}: records[{i}] is not a step-time record (config.system, "
                f"config.world_size, result.status); {allowed}"
            )
    return records


def main(argv=None) -> int:
    cfg, args = parse(argv)
    # every file read before anything is printed or written: one line naming a bad one
    runs = [read_results(path) for path in args.from_json or ()]
    if args.json is not None:
        cli.check_writable("json", args.json, file=True)  # before the timing, not after it
    if args.from_json:
        records = merge_records(runs)
        add_ratios(records)  # the ratios follow from the timings; recomputed, never trusted
        if args.json is not None:
            write_json(args.json, {"section": KIND, "records": records})
        print("\n\n".join(format_all(records, markdown=args.markdown)))
        return 0
    lead = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 alone prints and writes

    def say(*a):
        if lead:
            print(*a, flush=True)

    def keep(records):
        if args.json and lead:
            write_json(args.json, {"section": KIND, "records": records})

    started = time.time()
    records = run_bench(cfg, say=say, done=keep)
    say("\n\n".join(format_all(records, markdown=args.markdown)))
    psi = next((r["config"]["num_params"] for r in records if "num_params" in r["config"]), 0)
    say(
        f"model {cfg.model}: Ψ = {psi:,}, B = {cfg.workload.batch_size}, "
        f"seq {cfg.workload.gpt.block_size}; {time.time() - started:.0f} s"
    )
    keep(records)
    return 0 if any(r["result"]["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    cli.run(main, "python -m measure.bench")
