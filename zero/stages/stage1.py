"""Stage 1, P_os: the fp32 master and the optimizer states are partitioned (ZeRO paper §5.1).

A diff of stage 0 (zero/stages/stage0.py). Rank r keeps only its shard of the fp32 master and of the
optimizer states, so it updates only its shard; after the update it all-gathers the new working
parameters. Resident per rank: working params Ψ·compute bytes, gradients Ψ·reduction bytes,
master + states KΨ/N. Traffic per step (× (N-1)/N): deterministic (M/N + 1)Ψ (reduce-scatter
every micro-step, all-gather of parameters); fast 2Ψ (local accumulation, one reduce-scatter,
one all-gather), the same as baseline DP, as the paper says.
"""

from __future__ import annotations

import torch

from ..partition import UnitPartition
from ..unit import FlatUnit
from .stage0 import Stage0


class Stage1(Stage0):
    stage = 1

    def own_master(self, u: FlatUnit) -> torch.Tensor:
        """Only this rank's shard (a view of the working copy when training in fp32)."""
        own = u.initial[u.part.own]
        return own if u.initial is u.working else own.clone()

    @staticmethod
    def extent(part: UnitPartition) -> slice:
        return part.own

    def runs(self, u: FlatUnit):
        return u.part.runs()

    def reduced(self, u: FlatUnit) -> None:
        """Each rank updates only its shard of R: it stays in the tree until step()."""

    def finish_reduction(self, u: FlatUnit) -> torch.Tensor:
        """R's shard r, in the rank's own slice of the full gradient buffer (fast mode: landed
        there in backward, by land())."""
        own = u.grad[u.part.own]
        if self.cfg.deterministic:
            own.copy_(self.take_stream(u))
        return own

    def reduce_accumulated(self, u: FlatUnit) -> None:
        """Fast mode: one reduce-scatter of the locally accumulated sum, completed through the
        shared queue ([Note: bounded reductions in flight]), so that its receive buffer (N·L
        on gloo's all-to-all path) is freed while backward runs instead of every unit's being
        held until step(), a second full-size gradient at the end of backward."""
        self.reductions.make_room()
        self.reductions.launched(self.land, u, self.reduce_scatter(u, u.grad))
        self.buckets.note(self.ctx, u)

    def land(self, u: FlatUnit, pending) -> None:
        """R's shard r lands in this rank's slice of u.grad (the input, free once completed)."""
        u.grad[u.part.own].copy_(pending.wait())

    def refresh_working(self, u: FlatUnit) -> None:
        own = u.working[u.part.own]
        if u.master.data_ptr() != own.data_ptr():
            self.write_working(u, own)  # round to nearest even, into the compute dtype
        # a separate send buffer: the output's own slice must not be the input on every backend;
        # asynchronous, so that it overlaps the next unit's update
        self.refreshing.append(
            self.all_gather(u, u.working, own.clone(), "param_update", async_op=self.cfg.overlap)
        )

    def finish_step(self) -> None:
        while self.refreshing:
            self.refreshing.pop(0).wait()
