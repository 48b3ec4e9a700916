"""Stage 2, P_os+g: the reduced gradients are partitioned too (ZeRO paper §5.2).

A diff of stage 1 (zero/stages/stage1.py). Rank r keeps only its shard of the reduced gradient: each
unit's gradients are reduce-scattered as soon as backward produces them (asynchronously when
overlap is on), and the full-size buffer they arrive in is freed when the reduce-scatter
completes. So gradients are reduced every micro-step in both modes: local accumulation would need
the full-size buffer that this stage exists to remove. Resident per rank: working params
Ψ·compute bytes, gradients Ψ·reduction bytes / N (+ the streaming tree's partial sums),
master + states KΨ/N. Traffic per step: (M/N + 1)Ψ × (N-1)/N in both modes (2Ψ at M = N).
"""

from __future__ import annotations

import torch

from ..partition import UnitPartition
from ..unit import FlatUnit
from .stage1 import Stage1


class Stage2(Stage1):
    stage = 2

    @staticmethod
    def grad_numel(part: UnitPartition) -> int:
        """u.grad is this rank's shard of the reduced gradient (L)."""
        return part.shard_numel

    def post_backward(self, u: FlatUnit) -> None:
        """Reduce-scatter this micro-batch's gradients of u now, from a transient arrival buffer
        (or, with C_B, in pieces filled straight from the parameters' gradients)."""
        self.reductions.make_room()  # before this reduction's buffers exist
        grads = u.grads()  # kept alive by the pieces' fill until the reduction completes
        u.clear_grads()
        arrival = self.buckets.arrival(u, grads, self.cfg.grad_dtype)  # 1D, N·L, or None
        if arrival is not None:
            grads = None  # copied into the arrival buffer: free the parameters' gradients now
        self.reductions.launched(self.complete, u, self.reduce_scatter(u, arrival, grads))
        self.buckets.note(self.ctx, u, arrival)

    @staticmethod
    def grad_on_host(part: UnitPartition) -> bool:
        return True

    def complete(self, u: FlatUnit, pending) -> None:
        if self.cfg.deterministic:
            super().complete(u, pending)
            return
        if self.ctx.clock.microstep == 0:  # fast: a running sum of the reduced shards
            self.placement.store_grad(u, pending.wait())
        else:
            self.placement.add_grad(u, pending.wait())

    def finish_reduction(self, u: FlatUnit) -> torch.Tensor:
        if self.cfg.deterministic:  # the tree's partial sums stay on the device; R goes down
            self.placement.store_grad(u, self.take_stream(u))
        return u.grad
