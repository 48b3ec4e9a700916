"""ZeRO-Offload: the optimizer's side of the model states in host memory, the update on the CPU.

Legend: Ψ parameters, N ranks, K the optimizer-state multiplier (docs/design.md §2), "extent" the
elements of the padded flat buffer whose update a rank owns (the whole unit at stage 0, its
shard at stages 1-3; a stage-3 persistent unit is whole).

What lives where, per rank (ZeRO-Offload, docs/paper.md §2):
    device   working parameters (compute dtype), the reduction buffers of backward
    host     fp32 master and optimizer states of the extent (KΨ/N), the reduced gradient of the
             extent (stages 2-3: the gradient shard itself; stages 0-1 keep their full-size
             device buffer, which their collectives need, and copy the extent down), and two
             compute-dtype staging buffers of the largest extent (mixed precision only)
    host bytes per parameter at N = 1: 12 (master, m, v) + 4 or 2 (fp32 or bf16 gradients),
             the floor; the staging is two units' worth, not 2Ψ (zero/zero_r/disk.py: 12 to disk)
Traffic per step (kind='offload' in the engine's CommCounter, one record per unit and way):
    down     the reduced gradient of the extent, in the reduction dtype      (2Ψ or 4Ψ at N=1)
    up       the updated working parameters of the extent, in the compute dtype    (2Ψ at N=1)
so 4Ψ with fp16/bf16 gradients and 6Ψ with fp32 gradients at N = 1, ZeRO-Offload's minimum
(Ψ/N of each per rank at N ranks). In fast mode with M > N, stages 2-3 bring each micro-step's
reduced shard down and accumulate it on the host: M/N downloads per step.

The update itself is zero/optim/update.py's, unchanged: it already runs on whatever device its
tensors are on, and on the CPU its deterministic kernels are the reference's bits. The compute-dtype
rounding of the new master (round to nearest even) happens on the host; torch's CPU and CUDA
casts round alike (docs/machine_notes.md), so the working copy's bits do not depend on where.

On CUDA host buffers are pinned and copies are non-blocking: downloads of all units are queued at
once and one stream synchronisation precedes the CPU's first read; an upload is queued as soon as
its unit is updated and overlaps the next unit's update. The staging slot an upload reads is
rewritten only after the event recorded behind that upload has passed ([Note: bounded upload
staging]), two units later. On a CPU-only machine host and device are the same memory: offload
is a change of placement only, and it is the accounting (which buffers are "host", which bytes
crossed) and the bits that are tested there."""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager

import torch

from ..collectives import CommCounter
from ..unit import FlatUnit

STAGING_SLOTS = 2
"""Upload staging buffers ([Note: bounded upload staging]): one being read by an upload while
the next unit's is written."""


class HostOffload:
    """The engine's host side: host buffers, counted copies, and which storages are host."""

    def __init__(
        self,
        *,
        device: torch.device,
        counter: CommCounter,
        grad_dtype: torch.dtype,
        compute_dtype: torch.dtype,
    ):
        self.device, self.counter = device, counter
        self.grad_dtype, self.compute_dtype = grad_dtype, compute_dtype
        self.pinned = device.type == "cuda"  # pinned memory makes copies asynchronous
        self.host_ptrs: set[int] = set()  # storages placed on the host by this class
        self.queued: list = []  # records of non-blocking downloads, stamped at synchronize()
        self.padding: dict[int, int] = {}  # unit index -> padding elements in its extent
        # [Note: bounded upload staging] the compute-dtype copies uploads read: STAGING_SLOTS
        # buffers of the largest extent, used in turn, not one per unit (2 bytes per parameter
        # in host memory); on CUDA a slot is rewritten only after the event recorded behind its
        # last upload has passed, so the copy still reading it is never overwritten
        self.slots: list[torch.Tensor] = []  # 1D, compute dtype, the largest extent each
        self.slot_events: list = [None] * STAGING_SLOTS  # the upload last queued from each slot
        self.next_slot = 0
        self.new_event = (lambda: torch.cuda.Event()) if self.pinned else None
        self.registered: list[torch.Tensor] = []  # [Note: pinned without rounding]
        if self.pinned:
            weakref.finalize(self, _unregister, self.registered)

    # -- placement -----------------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new host buffer of zeros (pinned on CUDA), registered as host memory."""
        t = (
            pinned_zeros(numel, dtype, self.registered)
            if self.pinned
            else torch.zeros(numel, dtype=dtype)
        )
        self.host_ptrs.add(t.untyped_storage().data_ptr())
        return t

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A new host tensor with t's values (construction only: not counted as traffic)."""
        h = self.empty(t.numel(), t.dtype)
        h.copy_(t.reshape(-1))
        return h

    def _fit_slots(self, numel: int) -> None:
        """The staging slots made large enough for an extent of numel (construction only)."""
        if self.slots and self.slots[0].numel() >= numel:
            return
        for s in self.slots:
            self.host_ptrs.discard(s.untyped_storage().data_ptr())
            if any(s is r for r in self.registered):
                torch.cuda.cudart().cudaHostUnregister(s.data_ptr())
                self.registered[:] = [r for r in self.registered if r is not s]
        self.slots = [self.empty(numel, self.compute_dtype) for _ in range(STAGING_SLOTS)]

    def _states(self, u: FlatUnit) -> None:
        """u.master (its values kept) and u.opt (zeros) in host memory (the disk tier:
        zero/zero_r/disk.py, in files)."""
        u.master = self.copy(u.master)
        n = u.master.numel()  # the states are placeholders (Placement.new_states)
        u.opt = {k: self.empty(n, torch.float32) for k in u.opt}  # zeros at start

    def is_disk(self, t: torch.Tensor) -> bool:
        return False

    @contextmanager
    def streamed(self, units: list[FlatUnit]):
        """Around the update of `units` (the disk tier streams their states here)."""
        yield

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.host_ptrs

    def place(self, u: FlatUnit, grad_shard: bool, extent: slice, arena=None) -> None:
        """After the stage allocated u: master and states to the host; the gradient shard too
        (grad_shard, stages 2-3: the stage left a placeholder), else a host buffer for the
        extent's gradient. The master gets its own storage even where it was a view of the
        working copy (pure fp32). With contiguous_memory the host gradient buffers are views of
        one host `arena` (registered here as host memory when it was made by empty): like the
        device arena, one allocation instead of one per unit, and on CUDA one pinned block
        rather than many (pinned allocations are slow and rounded up by the host allocator)."""
        self.padding[u.index] = (extent.stop - extent.start) - _real_in(u, extent)
        self._states(u)
        u.host_stage = None
        dtype = self.grad_dtype
        if arena is None:
            u.host_grad = self.empty(u.master.numel(), dtype)
        else:
            u.host_grad = arena.take(u.master.numel(), dtype)
            assert u.host_grad is not None, "the host arena was sized from the same extents"
        if grad_shard:  # the reduced shard's extent is the master's (stages 2-3)
            u.grad = u.host_grad
        if self.compute_dtype != torch.float32:
            self._fit_slots(u.master.numel())

    # -- counted copies ------------------------------------------------------------------------

    def _record(self, u: FlatUnit, t: torch.Tensor, op: str, phase: str):
        pad = self.padding[u.index]
        return self.counter.add(
            op=op,
            phase=phase,
            kind="offload",
            unit=u.index,
            elements=t.numel(),
            padding=pad,
            nbytes=t.numel() * t.element_size(),
        )

    def down(self, u: FlatUnit, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """The reduced gradient of u's extent into its host buffer (queued on CUDA)."""
        rec = self._record(u, src, "d2h", "grad_down")
        dst.copy_(src, non_blocking=self.pinned)
        if self.pinned:
            self.queued.append(rec)
        else:
            rec.end = time.perf_counter()
        return dst

    def down_now(self, u: FlatUnit, src: torch.Tensor) -> torch.Tensor:
        """A completed download into a host buffer of its own, for fast mode's running sum of
        reduced shards (u.grad is the sum; this is the addend, allocated on first use)."""
        if u.host_stage is None:
            u.host_stage = self.empty(src.numel(), src.dtype)
        self.down(u, u.host_stage, src)
        self.synchronize()
        return u.host_stage

    def synchronize(self) -> None:
        """Before the CPU reads what non-blocking downloads wrote."""
        if self.pinned:  # also completes earlier uploads that read host buffers
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        for rec in self.queued:
            rec.end = now
        self.queued = []

    def up(self, u: FlatUnit, dst: torch.Tensor) -> None:
        """u's updated master, rounded to the compute dtype on the host, into the device's
        working extent dst (non-blocking on CUDA; see the module docstring for why the staging
        buffer is not rewritten too early)."""
        src = u.master
        if self.slots:  # [Note: bounded upload staging]
            i, self.next_slot = self.next_slot, (self.next_slot + 1) % STAGING_SLOTS
            if self.slot_events[i] is not None:
                self.slot_events[i].synchronize()  # its previous upload has read it
            src = self.slots[i][: u.master.numel()]
            src.copy_(u.master)  # round to nearest even, on the host
        rec = self._record(u, src, "h2d", "param_up")
        dst.copy_(src, non_blocking=self.pinned)
        if self.slots and self.new_event is not None:
            self.slot_events[i] = self.new_event()
            self.slot_events[i].record()
        rec.end = time.perf_counter()


def _real_in(u: FlatUnit, extent: slice) -> int:
    """Non-padding elements of the padded buffer inside extent."""
    return sum(
        max(0, min(s.offset + s.numel, extent.stop) - max(s.offset, extent.start))
        for s in u.part.layout.slots
    )


# [Note: pinned without rounding] torch's pinned host allocator rounds every request up to a
# power of two and keeps freed blocks for reuse: a host buffer of 1.1 GiB takes 2 GiB, and the
# master, the moments and the gradient of every unit each round up on their own: a likely part
# of the 30 bytes per parameter one H200 run held on the host for 16 of model states
# (docs/zero_r.md, "Tiers"). Pinning pageable memory in place (cudaHostRegister) costs exactly
# its bytes; the registration is undone when the offload object goes, before the memory is
# freed. Where the runtime refuses, the allocator's pinned memory is used as before.


def pinned_zeros(numel: int, dtype: torch.dtype, registered: list) -> torch.Tensor:
    """Zeros in host memory pinned for asynchronous copies, exactly numel elements."""
    t = torch.zeros(numel, dtype=dtype)
    register = getattr(torch.cuda.cudart(), "cudaHostRegister", None)
    if t.nbytes and register is not None and int(register(t.data_ptr(), t.nbytes, 0)) == 0:
        registered.append(t)
        return t
    return torch.zeros(numel, dtype=dtype, pin_memory=True)


def _unregister(registered: list) -> None:
    unregister = torch.cuda.cudart().cudaHostUnregister
    while registered:
        unregister(registered.pop().data_ptr())
