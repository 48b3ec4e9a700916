"""Peak tensor bytes of a block of code, on CPU and CUDA, for comparing systems in one process.

CPU: torch's profiler with profile_memory=True reports every allocation and free that torch's CPU
allocator makes on the profiled thread (and on autograd's, which inherit its state), with its
exact byte count; the running sum of those events, in time order, is the bytes of tensors
allocated inside the block and still alive, and its maximum is the peak. What it sees: every
torch tensor storage (parameters, gradients, optimizer states, activations, communication
buffers made as tensors), allocated and freed on this thread. What it does not see: memory
alive before the block (so the system to be measured is built inside it); allocations made on
other threads (gloo's worker threads, and gloo's own non-tensor buffers); a free on another
thread of a tensor allocated here (it stays counted: the check is `drift_bytes`, the growth of
the live bytes from one step's end to the next's, 0 in steady state); the interpreter, the
allocator's own overhead and fragmentation (measure/resident.py measures those through RSS).
[Note: frees on gloo's thread] A collective's work object holds its tensors, and gloo's worker
thread holds the work until just after it marks it complete. When the rank's thread drops its own
references first (a reduction's buffers, right after wait()), the last reference goes on gloo's
thread and the free is not seen: those bytes would stay counted, in the peak of every later phase,
by chance. So while tracking, every Work.wait() sleeps WAIT_SETTLE_S after it returns, and gloo
lets go first; the rank's thread then frees the buffers where the profiler sees it. That changes
timing only, for every system alike (DDP's, FSDP2's and DeepSpeed's waits too, as far as they
wait from Python).
CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus the bytes allocated
before the block: every tensor of the caching allocator, whatever thread made it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class PeakTrace:
    """The live tensor bytes of one block: marks split it into phases."""

    device: torch.device
    marks: list[str] = field(default_factory=list)
    """Mark names in order; phase i runs from mark i to mark i + 1 (or the block's end)."""
    phase_peak: list[int] = field(default_factory=list)
    """The most bytes alive at once during each phase (relative to the block's start)."""
    phase_end: list[int] = field(default_factory=list)
    """The bytes alive at the end of each phase."""

    def peak(self, first: str | None = None) -> int:
        """The most bytes alive at once, from mark `first` (None: the start) to the end."""
        i = 0 if first is None else self.marks.index(first)
        return max(self.phase_peak[i:])

    def peak_of(self, mark: str) -> int:
        """The most bytes alive at once during phase `mark` alone."""
        return self.phase_peak[self.marks.index(mark)]

    def end(self, mark: str) -> int:
        """The bytes alive at the end of phase `mark`."""
        return self.phase_end[self.marks.index(mark)]


def method(device: torch.device | str) -> str:
    """A record's one-line statement of what the numbers of `device` count."""
    if torch.device(device).type == "cuda":
        return "torch.cuda.max_memory_allocated (every tensor of the caching allocator)"
    return (
        "torch.profiler memory events: tensor storages allocated and freed on the rank's own "
        "threads (not gloo's worker threads nor its own buffers, nor the interpreter)"
    )


class _Tracker:
    def __init__(self, device: torch.device):
        self.device = device
        self.names: list[str] = []
        self.cuda_peaks: list[int] = []
        self.cuda_ends: list[int] = []

    def mark(self, name: str) -> None:
        """Start a new phase called `name` (the first mark starts the first phase)."""
        if name in self.names:
            raise ValueError(f"mark={name!r}: allowed are names not used yet in this block")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if self.names:
                self.cuda_peaks.append(torch.cuda.max_memory_allocated(self.device))
                self.cuda_ends.append(torch.cuda.memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # an empty range whose start time splits the memory events
            with torch.profiler.record_function(_MARK + name):
                pass
        self.names.append(name)


_MARK = "tensor_memory.mark:"

WAIT_SETTLE_S = 0.002
"""[Note: frees on gloo's thread]: how long each Work.wait() yields while tracking on CPU."""


@contextlib.contextmanager
def _settled_waits():
    """Work.wait() followed by a WAIT_SETTLE_S sleep, for the block ([Note: frees on gloo's
    thread])."""
    import time

    import torch.distributed as dist

    work = dist.distributed_c10d.Work
    plain = work.wait

    def wait(self, *args, **kwargs):
        done = plain(self, *args, **kwargs)
        time.sleep(WAIT_SETTLE_S)
        return done

    work.wait = wait
    try:
        yield
    finally:
        work.wait = plain


@contextlib.contextmanager
def tracking(device: torch.device | str = "cpu"):
    """Trace the live tensor bytes of the block; `mark(name)` starts each phase.

        with tracking("cpu") as (mark, trace):
            mark("build"); system = build()
            mark("step 1"); system.step()
        trace.peak("step 1"), trace.end("build")

    The first mark should come first in the block: bytes before it count towards no phase.
    """
    device = torch.device(device)
    trace = PeakTrace(device=device)
    tracker = _Tracker(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        yield tracker.mark, trace
        torch.cuda.synchronize(device)
        tracker.cuda_peaks.append(torch.cuda.max_memory_allocated(device))
        tracker.cuda_ends.append(torch.cuda.memory_allocated(device))
        trace.marks = tracker.names
        trace.phase_peak = [p - base for p in tracker.cuda_peaks]
        trace.phase_end = [e - base for e in tracker.cuda_ends]
        return
    if device.type != "cpu":
        raise ValueError(f"device={device!r}: allowed are cpu and cuda devices")
    acts = [torch.profiler.ProfilerActivity.CPU]
    with _settled_waits(), torch.profiler.profile(activities=acts, profile_memory=True) as prof:
        yield tracker.mark, trace
    events = prof.profiler.kineto_results.events()
    trace.marks = tracker.names
    trace.phase_peak, trace.phase_end = _replay(events, tracker.names)


def _replay(events, names: list[str]) -> tuple[list[int], list[int]]:
    """Walk the allocation events in time order, keeping the running sum; split at the marks."""
    starts = {e.name()[len(_MARK) :]: e.start_ns() for e in events if e.name().startswith(_MARK)}
    bounds = [starts[n] for n in names]
    mem = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    peaks, ends = [0] * len(names), [0] * len(names)
    live, phase = 0, -1
    for t, nbytes in mem:
        while phase + 1 < len(bounds) and t >= bounds[phase + 1]:
            phase += 1
            peaks[phase] = ends[phase] = live  # a phase starts with what is alive
        live += nbytes
        if phase >= 0:
            peaks[phase] = max(peaks[phase], live)
            ends[phase] = live
    while phase + 1 < len(bounds):  # marks after the last event
        phase += 1
        peaks[phase] = ends[phase] = live
    return peaks, ends
