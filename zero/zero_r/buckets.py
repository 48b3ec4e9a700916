"""ZeRO-R's constant-size buffers (C_B) as a policy: how a unit's gradient is cut for reduction.

Legend: N ranks, L a unit's shard length (its flat buffer has N·L elements), C_B
config.bucket_elements, width = C_B // N columns of every rank's shard per piece.

A stage asks its bucketing policy for three things, and never branches on C_B itself:
    arrival(u, grads)    the full-size N·L buffer a reduction reads (None: pieces fill from grads)
    reduce_scatter(...)  one collective over the whole buffer, or Pieces of at most C_B each
    note(ctx, u, ...)    the transient buffers this holds, for the memory report
WholeBuffers is the policy without C_B; ConstantBuffers the one with it
([Note: constant-size buffers] below).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import collectives as C
from ..unit import FlatUnit


class WholeBuffers:
    """No C_B: each reduction runs over the unit's whole flat buffer."""

    def arrival(self, u: FlatUnit, grads, dtype: torch.dtype) -> torch.Tensor:
        """A transient buffer for this micro-batch's gradients of u (stage 2-3's arrival)."""
        arrival = torch.zeros(
            u.part.padded_numel, dtype=dtype, device=u.working.device
        )  # 1D, reduction dtype, N·L, transient
        u.part.flatten_into(arrival, grads)
        return arrival

    def reduce_scatter(self, ctx, u: FlatUnit, fn, flat, grads, tag: dict) -> C.Pending:
        pad, overlap = u.part.padding_scattered, ctx.config.overlap
        return fn(
            flat, group=ctx.group, counter=ctx.counter, padding=pad, tag=tag, async_op=overlap
        )

    def note(self, ctx, u: FlatUnit, arrival: torch.Tensor | None = None) -> None:
        """The arrival buffer is held while its reduction is in flight (with a receive buffer)."""
        if arrival is not None:
            ctx.note_transient(arrival.nbytes)


class ConstantBuffers:
    """C_B: each reduce-scatter in pieces of at most C_B elements (the engine checks C_B >= N)."""

    def __init__(self, elements: int, world_size: int):
        self.width = elements // world_size  # columns per piece: N·width <= C_B elements

    def arrival(self, u: FlatUnit, grads, dtype: torch.dtype) -> None:
        """No full-size arrival buffer: the pieces fill from the parameters' gradients."""
        return None

    def reduce_scatter(self, ctx, u: FlatUnit, fn, flat, grads, tag: dict) -> Pieces:
        """Pieces filled from `flat` (N·L), or straight from `grads` when flat is None."""
        n, L, rank = ctx.world_size, u.part.shard_numel, ctx.rank
        full = None if flat is None else flat.view(n, L)
        dtype, device = ctx.config.grad_dtype, u.working.device

        def launch(a: int, b: int) -> C.Pending:
            buf = torch.zeros(n, b - a, dtype=dtype, device=device)  # the capped fused buffer
            if full is None:
                u.fill_columns(buf, grads, a, b)
            else:
                buf.copy_(full[:, a:b])
            pad = sum(b - a - u.real_in(r * L + a, r * L + b) for r in range(n) if r != rank)
            return fn(
                buf.view(-1),
                group=ctx.group,
                counter=ctx.counter,
                padding=pad,
                tag=tag,
                async_op=ctx.config.overlap,
            )

        cuts = [(a, min(a + self.width, L)) for a in range(0, L, self.width)]
        return Pieces(cuts, launch, torch.empty(L, dtype=dtype, device=device))

    def note(self, ctx, u: FlatUnit, arrival: torch.Tensor | None = None) -> None:
        """Pieces.depth fused buffers of at most N·width elements (each with a receive buffer
        of its size)."""
        n, w = ctx.world_size, min(self.width, u.part.shard_numel)
        ctx.note_transient(Pieces.depth * n * w * ctx.config.grad_dtype.itemsize)


def bucketing(bucket_elements: int | None, world_size: int) -> WholeBuffers | ConstantBuffers:
    """The policy for config.bucket_elements."""
    if bucket_elements is None:
        return WholeBuffers()
    return ConstantBuffers(bucket_elements, world_size)


Bucketing = WholeBuffers | ConstantBuffers


class Pieces:
    """[Note: constant-size buffers] One unit's reduce-scatter done in pieces (ZeRO-R's C_B,
    paper §6.2): piece [a, b) reduces columns a..b of every rank's shard, i.e. elements
    [r·L + a, r·L + b) for each rank r, through a fused buffer of N·(b - a) <= C_B elements that
    `fill(buf, a, b)` writes. At most `depth` pieces are in flight; wait() completes them in
    order, launching the next as each finishes, and assembles this rank's shard (L elements).
    The deterministic tree sums each element over ranks on its own, so any cut gives the same
    bits; the volume is the unit's, split over the pieces (each piece is one counted call).

    All-gathers are not cut into pieces, at any stage: each lands in a buffer the unit has
    anyway (its flat working parameters, or its flat gradient at stage 0), so there is no fused
    buffer to cap, only the L elements this rank sends. What a gather holds is set by the unit
    choice instead: one unit's parameters, and at stage 3 at most `max_live` units besides the
    root (zero/stages/stage3.py), so splitting units, not C_B, bounds it."""

    depth = 2

    def __init__(self, cuts, launch: Callable[[int, int], C.Pending], out: torch.Tensor):
        self._queue, self._running, self._out, self._launch = list(cuts), [], out, launch
        self._top_up()

    def _top_up(self) -> None:
        while self._queue and len(self._running) < self.depth:
            a, b = self._queue.pop(0)
            self._running.append((a, b, self._launch(a, b)))

    def wait(self) -> torch.Tensor:
        while self._running:
            a, b, p = self._running.pop(0)
            self._out[a:b].copy_(p.wait())
            self._top_up()
        return self._out
