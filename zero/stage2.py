"""Stage 2, P_os+g: the reduced gradients are partitioned too (ZeRO paper §5.2).

A diff of stage 1 (zero/stage1.py). Rank r keeps only its shard of the reduced gradient: each
unit's gradients are reduce-scattered as soon as backward produces them (asynchronously when
overlap is on), and the full-size buffer they arrive in is freed when the reduce-scatter
completes. So gradients are reduced every micro-step in both modes: local accumulation would need
the full-size buffer that this stage exists to remove. Resident per rank: working params
Ψ·compute bytes, gradients Ψ·reduction bytes / N (+ the streaming tree's partial sums),
master + states KΨ/N. Traffic per step: (M/N + 1)Ψ × (N-1)/N in both modes (2Ψ at M = N).
"""

from __future__ import annotations

import torch

from .partition import UnitPartition
from .stage1 import Stage1
from .unit import FlatUnit


class Stage2(Stage1):
    stage = 2

    def grad_numel(self, part: UnitPartition) -> int:
        """u.grad is this rank's shard of the reduced gradient (L)."""
        return part.shard_numel

    def post_backward(self, u: FlatUnit) -> None:
        if self.cfg.bucket_elements is not None:  # no full-size arrival buffer: pieces of C_B
            grads = u.grads()  # kept alive by the pieces' fill until the reduction completes
            u.clear_grads()
            self.launched(u, self.reduce_scatter(u, None, grads))
            self.note_pieces(u)
            return
        arrival = torch.zeros(
            u.part.padded_numel, dtype=self.cfg.grad_dtype, device=u.working.device
        )  # 1D, reduction dtype, N·L, transient
        u.part.flatten_into(arrival, u.grads())
        u.clear_grads()
        self.launched(u, self.reduce_scatter(u, arrival))
        self.eng.note_transient(arrival)

    def grad_on_host(self, part: UnitPartition) -> bool:
        return True

    def complete(self, u: FlatUnit, pending) -> None:
        if self.cfg.deterministic:
            super().complete(u, pending)
            return
        off = self.eng.offload  # fast: a running sum of the reduced shards (on the host)
        if self.eng.microstep == 0:
            self.store_grad(u, pending.wait())
        elif off is None:
            u.grad += pending.wait()
        else:
            u.grad += off.down_now(u, pending.wait())

    def store_grad(self, u: FlatUnit, shard: torch.Tensor) -> None:
        """u.grad <- shard; with offload_optimizer u.grad is on the host: a counted download."""
        if self.eng.offload is None:
            u.grad.copy_(shard)
        else:
            self.eng.offload.down(u, u.grad, shard)

    def finish_reduction(self, u: FlatUnit) -> torch.Tensor:
        if self.cfg.deterministic:  # the tree's partial sums stay on the device; R goes down
            self.store_grad(u, self.take_stream(u))
        return u.grad
