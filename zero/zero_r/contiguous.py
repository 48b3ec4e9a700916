"""ZeRO-R's M_D: pre-allocated contiguous memory for gradients and activation checkpoints.

Legend (paper §6.3, docs/paper.md §1.5): M_D memory defragmentation; "arena" one flat allocation
handed out front to back as aligned views; "slot" the arena bytes one checkpoint is copied into.

[Note: contiguous memory] A caching allocator (PyTorch's on CUDA) serves a request from a free
block at least as large, splits it, and never moves what lives in it. Long-lived buffers of many
sizes (each unit's gradient buffer) allocated between short-lived ones (activations, reduction
buffers) pin blocks in the middle of otherwise free segments, and activation checkpoints, which
live from a unit's forward to its backward, interleave with the activations freed around them.
The free memory is then cut into pieces too small for the next large request: the allocator
reserves new segments (reserved - allocated grows) or fails with memory to spare, which the paper
reports for very large models. With `contiguous_memory=True` the engine allocates each of these
once, as one block: every unit's resident gradient buffer is a view into one gradient arena
(sized at construction from the partitions), and every checkpointed unit input is copied into a
checkpoint arena reused across micro-steps (CheckpointArena). Views own nothing new, so memory
accounting counts each arena once (zero/introspect.py counts storages). The copies are exact
(same dtype): bits never change. `python -m measure.fragmentation` measures the effect on a GPU.
"""

from __future__ import annotations

import torch

ALIGN = 256  # bytes: every view starts at a multiple (docs/design.md §2's layout alignment)


def span(numel: int, dtype: torch.dtype) -> int:
    """Bytes a view of numel elements takes in an arena, rounded up to the alignment."""
    return -(-numel * dtype.itemsize // ALIGN) * ALIGN


class Arena:
    """One flat byte buffer handed out front to back as aligned views of any dtype."""

    def __init__(self, buffer: torch.Tensor):
        """buffer: 1D uint8, allocated by the caller (device or host memory, pinned or not)."""
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1
        self.buffer = buffer  # 1D, uint8, the arena's bytes
        self.cursor = 0  # bytes handed out

    @classmethod
    def zeros(cls, nbytes: int, *, device, pin: bool = False) -> Arena:
        return cls(torch.zeros(nbytes, dtype=torch.uint8, device=device, pin_memory=pin))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The next numel elements of dtype as a 1D view, or None if they do not fit."""
        need = span(numel, dtype)
        if self.cursor + need > self.nbytes:
            return None
        view = self.buffer[self.cursor : self.cursor + numel * dtype.itemsize].view(dtype)
        self.cursor += need
        return view

    def holds(self, t: torch.Tensor) -> bool:
        """Whether t is a view of this arena."""
        return t.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()


class _Generation:
    """One checkpoint arena buffer and how many saved checkpoints still point into it."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.live = 0  # _Saved handles alive (held by some autograd graph)
        self.wanted = 0  # bytes this generation's packs asked for (fitting or not)


class _Saved:
    """What a pack hook returns: autograd's graph holds it until the saved tensor is freed (at
    the end of the backward that used it, or when the graph is dropped), so its lifetime is
    exactly the slot's ([Note: checkpoint generations])."""

    __slots__ = ("gen", "tensor")

    def __init__(self, gen: _Generation, tensor: torch.Tensor):
        self.gen, self.tensor = gen, tensor
        gen.live += 1

    def __del__(self):
        self.gen.live -= 1


class CheckpointArena:
    """Activation checkpoints copied into one contiguous buffer, reused across micro-steps.

    [Note: checkpoint generations] A slot may be overwritten only when no autograd graph can
    still unpack it. Each saved checkpoint is a _Saved handle that the graph owns, so a buffer
    whose handles are all gone is provably free: backward releases them as it consumes the
    graph, and dropping a graph without backward releases them too. begin(), at the start of
    every forward that records a graph, rewinds the current buffer if it is free; if a graph
    still holds it (a forward without backward yet, or retain_graph), the new forward gets a
    fresh buffer and the old one lives on through its handles until they die.

    Sizing: the first checkpoint sizes the buffer at units × its bytes (transformer blocks share
    their input shape). A checkpoint that does not fit is kept as it is and counted (misses);
    the next fresh or rewound buffer is then grown to what the last forward asked for."""

    def __init__(self, *, units: int, device, pin: bool = False):
        self.units = units  # checkpointed units: checkpoints per forward for one-input blocks
        self.device, self.pin = torch.device(device), pin
        self.gen: _Generation | None = None
        self.size = 0  # bytes the next buffer gets (0: not known before the first checkpoint)
        self.buffers = 0  # buffers allocated so far (the first, growths, fresh generations)
        self.misses = 0  # checkpoints that did not fit and were kept as separate tensors
        self.missed_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the current buffer (0 before the first checkpoint)."""
        return 0 if self.gen is None else self.gen.arena.nbytes

    def begin(self) -> None:
        """A forward that records a graph starts: rewind, grow or replace the buffer."""
        gen = self.gen
        if gen is None:
            return
        self.size = max(self.size, gen.wanted)
        if gen.live == 0 and gen.arena.nbytes >= self.size:
            gen.arena.cursor, gen.wanted = 0, 0  # free: reuse it in place
        else:
            self.gen = None  # still referenced, or too small: the next store allocates

    def store(self, t: torch.Tensor) -> _Saved:
        """Copy t into the next slot (exact: same dtype); keep t itself if it does not fit."""
        if self.gen is None:
            size = self.size or self.units * span(t.numel(), t.dtype)
            self.gen = _Generation(Arena.zeros(size, device=self.device, pin=self.pin))
            self.buffers += 1
        gen = self.gen
        gen.wanted += span(t.numel(), t.dtype)
        slot = gen.arena.take(t.numel(), t.dtype)
        if slot is None:
            self.misses += 1
            self.missed_bytes += t.numel() * t.element_size()
            return _Saved(gen, t.detach())  # [Note: pack hooks keep a detached tensor]
        # a pinned host slot fills asynchronously; later kernels on the stream are ordered after
        slot.copy_(t.detach().reshape(-1), non_blocking=self.pin)
        return _Saved(gen, slot.view(t.shape))

    @staticmethod
    def load(saved: _Saved) -> torch.Tensor:
        return saved.tensor


def grad_arenas(parts, stages, *, dtype: torch.dtype, device, offload=None):
    """contiguous_memory: (device, host) gradient arenas, each sized to exactly the sum of the
    buffers it will hand out, in unit order ([Note: contiguous memory]). `stages[i]` is unit
    i's stage class: its grad_numel, extent and grad_on_host are known from the partition.
    Device: every u.grad that stays on the device. Host (offload, a HostOffload): every unit's
    host gradient buffer, the reduced gradient of its extent (at stages 2-3 that is u.grad
    itself, so the device arena then holds only stage-3 persistent units, or is not created at
    all). One dtype (the reduction dtype) for all gradients: one arena per placement."""
    on_device = [
        span(s.grad_numel(p), dtype)
        for p, s in zip(parts, stages, strict=True)
        if offload is None or not s.grad_on_host(p)
    ]
    arena = Arena.zeros(sum(on_device), device=device) if sum(on_device) else None
    host = None
    if offload is not None:
        ext = [s.extent(p) for p, s in zip(parts, stages, strict=True)]
        host = Arena(offload.empty(sum(span(e.stop - e.start, dtype) for e in ext), torch.uint8))
    return arena, host
