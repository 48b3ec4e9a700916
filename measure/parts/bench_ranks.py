"""What each rank runs for measure.bench (measure/bench.py drives these through its worker pool,
or on every rank under torchrun): build a system and warm it up (build), time one repeat of it
(repeat), time its phases (profile), measure its memory in a fresh copy (memory, [Note: the
memory pass]), measure the rank's peak FLOP/s (peak), and free every system (drop_all). The
systems built live in this process between calls (_LIVE).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from zero.workloads.models import GPT

from .. import mfu, tensor_memory
from .bench_config import BenchConfig
from .bench_systems import MP_SYSTEMS, OURS
from .trainers import DeepSpeedPeer, Ours, Phases, TorchPeer, Trainer, rank_device, sync

_REPO_ROOT = Path(__file__).resolve().parents[2]
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


def make(name: str, rank: int, n: int, cfg: BenchConfig) -> Trainer:
    if name in MP_SYSTEMS:
        from ..bench_mp import MPTrainer as kind
    else:
        kind = Ours if name in OURS else DeepSpeedPeer if name.startswith("deep") else TorchPeer
    return kind(name, rank, n, cfg)


def build(rank: int, n: int, name: str, cfg: BenchConfig) -> dict:
    """Build one system in this rank (and warm it up), or say why it cannot run."""
    if name.startswith("deepspeed"):
        why = prepare_deepspeed(rank, n)
        if why is not None:
            return {"status": why}
    try:
        trainer = make(name, rank, n, cfg)
        # DDP rebuilds its buckets, and allocators settle, in the first steps
        losses = [trainer.step(trainer.batch()) for _ in range(BUILD_WARMUP)]
    except Exception:
        # A rank that fails half-way through a collective leaves its peers waiting; the pool's
        # timeout names them. A failure on every rank (a version mismatch) is reported here.
        return {"status": "failed", "error": traceback.format_exc(limit=8)}
    _LIVE[name] = trainer
    from ..bench_mp import step_traffic

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


def repeat(rank: int, n: int, name: str, steps: int, warmup: int) -> dict:
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


def profile(rank: int, n: int, name: str, steps: int) -> dict:
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


def memory(rank: int, n: int, name: str, cfg: BenchConfig) -> dict:
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
        from ..bench_mp import MPProbe as probe_of
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
        trainer = make(name, rank, n, cfg)
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


def peak(rank: int, n: int) -> dict:
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


def keep_freed_blocks(rank: int, n: int) -> None:
    from measure.resident import keep_freed_blocks

    if rank_device().type == "cpu" and not keep_freed_blocks():
        raise RuntimeError(f"rank {rank}: malloc='keep' needs glibc's mallopt, not found here")


def drop_all(rank: int, n: int) -> None:
    """Free every system in this rank (a shared pool outlives the benchmark), and hand malloc's
    free pages back to the kernel: without the trim a rank's resident memory stays at the sum of
    every system it has built (glibc keeps freed heap pages), and at `mid` the memory pass that
    follows the timing ran two ranks out of a 24 GiB machine."""
    from measure.resident import release_free_memory

    _LIVE.clear()
    release_free_memory()
