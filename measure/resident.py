"""Memory measured from outside the engine: the process's resident set on CPU, allocator bytes on
CUDA, and the activation bytes autograd keeps for backward (docs/design.md §3).

engine.memory_report() sums the storages the engine owns, so it equals the analytic model by
construction; a measurement asks someone else. CPU: the resident set (/proc/self/statm) at a
quiescent point minus the RSS before the model was built, and the peak from VmHWM
(/proc/self/status, reset through /proc/self/clear_refs between phases). CUDA:
torch.cuda.memory_allocated and max_memory_allocated, each minus the same baseline.

Legend: RSS resident set size; HWM high-water mark (peak RSS); Ψ parameters; b batch, s
sequence length, h hidden size, l layers.
"""

# [Note: quiescent RSS] glibc's malloc keeps freed memory for reuse, so after construction (which
# materialises and frees one full unit at a time) the RSS holds pages no tensor owns.
# release_free_memory() runs the garbage collector and malloc_trim(0), after which RSS bounds the
# live bytes tightly, up to page rounding and the interpreter's own objects; records keep the
# untrimmed number too. Pages of a torch.empty buffer never written are not resident at all, which
# is how a measurement can fall *below* the engine's accounting.

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import resource
from dataclasses import dataclass, field

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""The kernel's page: RSS moves in these steps, so one tensor can add up to a page of rounding."""


def _status_field(name: str) -> int | None:
    """A ``kB`` field of /proc/self/status (e.g. VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; elsewhere the peak, an upper bound)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or since :func:`reset_peak_rss`."""
    hwm = _status_field("VmHWM")
    if hwm is not None:
        return hwm
    # ru_maxrss is KiB on Linux and bytes on macOS; it cannot be reset.
    scale = 1 if os.uname().sysname == "Darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs).

    Returns False where that is not possible; the peak then covers the whole process so far.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_available_bytes() -> int | None:
    """The kernel's estimate of memory available to a new process (MemAvailable); None if
    unknown. A large simulated rank checks it before it starts, rather than being OOM-killed."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def release_free_memory() -> bool:
    """Collect garbage and return malloc's free pages to the kernel ([Note: quiescent RSS]).

    Returns whether ``malloc_trim`` was available (glibc); without it only gc runs.
    """
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC is not None else None
    if trim is None:
        return False
    trim(0)
    return True


# [Note: malloc keeps freed blocks] glibc gives a freed block back to the kernel when it was
# mapped on its own: every block over the mmap threshold (128 KiB at first, rising to 32 MiB as
# such blocks are freed), and the heap's free top over the trim threshold. A buffer freed every
# step and allocated again in the next (zero_grad(set_to_none=True), ZeroConfig.release_grads)
# then comes back through a page fault per 4 KiB and the kernel's zeroing of each page: at the
# 26M GPT, N = 2, our stage 0 took 1.01x DDP's step keeping its gradient buffers and 1.07x
# releasing them (benchmarks/cpu-2core-2026-11.md, "Gradients released, and glibc"). Fixing both
# thresholds keeps blocks up to 32 MiB (glibc's most) in the heap, where the next allocation of
# that size, or a step's activations, reuse them without a fault: the released run then costs
# what the kept one does. It changes where malloc takes memory from, not how much the tensors
# hold, so tensor-memory peaks (measure/tensor_memory.py) are the same either way.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_BLOCK_BYTES = 32 * 2**20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_blocks() -> bool:
    """[Note: malloc keeps freed blocks]: fix glibc's mmap threshold at 32 MiB and stop it
    trimming its heap on its own (release_free_memory() still trims). Applies to this process
    from now on; returns whether glibc took both settings (False without glibc)."""
    mallopt = getattr(_LIBC, "mallopt", None) if _LIBC is not None else None
    if mallopt is None:
        return False
    mmap_ok = mallopt(M_MMAP_THRESHOLD, KEEP_BLOCK_BYTES)
    trim_ok = mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # an int: the largest glibc's mallopt takes
    return bool(mmap_ok and trim_ok)


@dataclass(kw_only=True)
class MemoryProbe:
    """Bytes above a baseline, measured outside the engine, on CPU (RSS) or CUDA (allocator).

        probe = MemoryProbe(device="cpu")   # the baseline: before the model is built
        ... build ...
        probe.sample("after construction")  # quiescent bytes above the baseline, and the peak
        probe.reset_peak()
        ... one step ...
        probe.sample("after step 1")

    Each sample records ``bytes`` (quiescent, after :func:`release_free_memory` on CPU),
    ``bytes_untrimmed`` (CPU: before the trim) and ``peak`` (since the last reset), all minus
    the baseline.
    """

    device: str = "cpu"
    """"cpu" or "cuda" / "cuda:i"."""
    samples: list[dict] = field(default_factory=list)
    baseline: int = field(init=False)
    peak_resettable: bool = field(init=False, default=True)

    def __post_init__(self):
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} is not allowed: expected 'cpu' or 'cuda[:i]'")
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            release_free_memory()
            self.baseline = rss_bytes()
        self.reset_peak()

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def current(self) -> tuple[int, int]:
        """(quiescent bytes, untrimmed bytes) above the baseline now."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            now = torch.cuda.memory_allocated(self.device) - self.baseline
            return now, now
        untrimmed = rss_bytes() - self.baseline
        release_free_memory()
        return rss_bytes() - self.baseline, untrimmed

    def peak(self) -> int:
        """Peak bytes above the baseline since the last reset."""
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return peak_rss_bytes() - self.baseline

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_resettable = reset_peak_rss() and self.peak_resettable

    def sample(self, label: str) -> dict:
        now, untrimmed = self.current()
        out = {"label": label, "bytes": now, "bytes_untrimmed": untrimmed, "peak": self.peak()}
        self.samples.append(out)
        return out

    def describe(self) -> str:
        """Which measurement this is, for records and figures."""
        if self.cuda:
            return "torch.cuda.memory_allocated / max_memory_allocated minus the baseline"
        return "RSS (/proc/self/statm) after gc + malloc_trim, minus the baseline; peak VmHWM"


# --- activations -----------------------------------------------------------------------------


@dataclass(kw_only=True)
class SavedTensors:
    """What autograd saved for backward, each storage counted once (views share one)."""

    exclude: set = field(default_factory=set)
    """Storage keys not to count (the parameters': they are model states, not activations)."""
    storages: dict = field(default_factory=dict)  # key -> bytes
    calls: int = 0

    @staticmethod
    def key(t) -> tuple:
        s = t.untyped_storage()
        return (str(t.device), s.data_ptr(), s.nbytes())

    def add(self, t) -> None:
        self.calls += 1
        k = self.key(t)
        if k not in self.exclude:
            self.storages[k] = k[2]

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def saved_activations(params=()):
    """Count the tensors autograd saves for backward inside the block (not the parameters).

        with saved_activations(model.parameters()) as saved:
            loss = model(x, y)[1]
        saved.nbytes   # activation bytes held until backward

    Through ``torch.autograd.graph.saved_tensors_hooks``: every tensor an operation saves passes
    through the pack hook. Storages are counted once, so a view of a saved tensor adds nothing.
    Under reentrant activation checkpointing (``torch.utils.checkpoint(...,
    use_reentrant=True)``) the checkpointed function runs without grad and its checkpoint
    function saves only its inputs, so exactly the checkpoints are counted.
    """
    import torch

    saved = SavedTensors(exclude={SavedTensors.key(p) for p in params})

    def pack(t):
        saved.add(t)
        # [Note: pack hooks keep a detached tensor] in zero/zero_r/activations.py
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
