"""Stage 0: baseline data parallelism. Every rank keeps every model state whole.

Resident per rank (Ψ parameters; K = 12 for mixed-precision Adam; docs/design.md §3):
    working params  Ψ · compute bytes              (the fp32 master itself in pure fp32)
    gradients       Ψ · reduction bytes            (+ floor(log2(M/N)) shards of partial sums)
    master + states KΨ
Traffic per step (elements per rank, × (N-1)/N; docs/design.md §2):
    deterministic   (M/N + 1)Ψ: a tree-ordered reduce-scatter every micro-step, then one
                    all-gather of the reduced gradient, so every rank can run the whole optimizer
    fast            2Ψ: local accumulation over micro-steps, then one all-reduce

Stages 1 and 2 subclass this class and override only what they partition, so each reads as a
diff of this one. A stage is given a StageContext (zero/stages/base.py), never the engine.
The lifecycle (called by the engine, which does no stage-specific work):
    allocate(u)          once: the unit's resident buffers
    allocate_frozen(u)   once per unit with frozen parameters: their buffer (zero/build.py)
    post_backward(u)     a micro-batch's gradients of u are ready (autograd hook)
    end_microstep(u)     after backward: complete what post_backward launched
    end_backward()       once per backward, after every unit's end_microstep
    finish_reduction(u)  at step(): R, as far as this rank needs it
    refresh_working(u)   after the optimizer: the new working copy
    finish_step()        after every unit's update
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference.optim import state_names

from .. import collectives as C
from ..partition import UnitPartition
from ..unit import FlatUnit
from .base import StageContext


class Stage0:
    stage = 0
    collective_forward = False  # whether forward makes collectives (stage 3 gathers there)

    def __init__(self, ctx: StageContext):
        self.ctx, self.cfg, self.group, self.counter = ctx, ctx.config, ctx.group, ctx.counter
        self.placement = ctx.placement  # where buffers live (zero/zero_r/placement.py)
        self.buckets = ctx.buckets  # whole buffers or C_B pieces (zero/zero_r/buckets.py)
        self.reductions = ctx.reductions  # shared: [Note: bounded reductions in flight]
        self.refreshing: list[C.Pending] = []  # parameter all-gathers launched by the update

    # -- what stays resident -----------------------------------------------------------------

    def allocate(self, u: FlatUnit) -> None:
        u.master = self.own_master(u)
        groups = {self.ctx.group_index[n] for n, _ in u.params}
        names = {x for g in groups for x in state_names(self.cfg.optimizer, self.cfg.groups[g])}
        u.opt = self.placement.new_states(u.master, sorted(names))
        release = self.cfg.releases_grads(u.working.device)
        if release and self.placement.releasable(self.grad_on_host(u.part)):
            # [Note: gradients live within a step]: its first use in a step allocates it
            u.renew_grad = lambda: self.new_grad(u)
            u.grad_nbytes = self.grad_numel(u.part) * self.cfg.grad_dtype.itemsize
        else:
            u.grad = self.new_grad(u)

    def allocate_frozen(self, u: FlatUnit) -> None:
        """A unit's frozen parameters (zero/build.py): the working copy, kept whole."""

    @staticmethod
    def grad_numel(part: UnitPartition) -> int:
        """Elements of the resident gradient buffer u.grad: the whole padded unit (N·L)."""
        return part.padded_numel

    def new_grad(self, u: FlatUnit) -> torch.Tensor:
        """u.grad, zeros, where the placement policy puts it."""
        return self.placement.new_grad(u, self.grad_numel(u.part), self.grad_on_host(u.part))

    def own_master(self, u: FlatUnit) -> torch.Tensor:
        """The whole fp32 master (the working copy itself when training in fp32)."""
        return u.initial

    @staticmethod
    def extent(part: UnitPartition) -> slice:
        """Which elements of the padded buffer this rank's optimizer updates (known from the
        partition alone, so the engine can size its arenas before any unit exists)."""
        return slice(0, part.padded_numel)

    def master_extent(self, u: FlatUnit) -> slice:
        """extent() of u's partition."""
        return self.extent(u.part)

    def working_extent(self, u: FlatUnit):
        """The resident working copy and which elements of the padded buffer it holds."""
        return u.working, slice(0, u.part.padded_numel)

    def gathered(self):
        """Stages 0-2 keep the working parameters whole: nothing to gather."""
        return contextlib.nullcontext()

    def register_hooks(self, modules) -> list:
        """Module hooks (stage 3 gathers around each unit's forward and backward): their handles."""
        return []

    def runs(self, u: FlatUnit):
        """The parameter-group runs of the master's extent (zero/partition.py)."""
        return u.part.runs(whole=True)

    # -- backward ----------------------------------------------------------------------------

    def post_backward(self, u: FlatUnit) -> None:
        """This micro-batch's gradient of u, in the reduction dtype, goes into u.grad: reduce it
        now (deterministic), or add it to the local sum (fast; DDP's no_sync accumulation), and
        after the step's last micro-batch launch the sum's reduction at once, so that it
        overlaps the rest of backward as DDP's bucketed all-reduce does."""
        if not self.cfg.deterministic:
            self.accumulate_locally(u)
            if self.ctx.clock.microstep == self.ctx.per_step - 1:
                self.reduce_accumulated(u)
            return
        u.part.flatten_into(u.grad, u.grads())  # exact upcast into the reduction dtype
        u.clear_grads()
        self.reductions.make_room()
        self.reductions.launched(self.complete, u, self.reduce_scatter(u, u.grad))
        self.buckets.note(self.ctx, u)

    def complete(self, u: FlatUnit, pending: C.Pending) -> None:
        """Deterministic: each B_k shard joins the unit's streaming tree ([Note: the tree T])."""
        u.stream.push(pending.wait())
        if self.ctx.clock.microstep == self.ctx.per_step - 1:
            self.reduced(u)

    def reduced(self, u: FlatUnit) -> None:
        """Deterministic, after the step's last micro-step: u's shard of R is final.
        [Note: early gradient gather] Every rank runs the whole optimizer here, so R's shards
        are all-gathered into u.grad; launched now, while backward still runs on the units
        before u, instead of one unit after another inside step(), where nothing overlaps it.
        The same collective on the same data: the bits and the counted volume do not change."""
        shard = self.take_stream(u)
        u.pending = self.all_gather(u, u.grad, shard, "grad_gather", async_op=self.cfg.overlap)

    def accumulate_locally(self, u: FlatUnit) -> None:
        if self.ctx.clock.microstep == 0:
            u.part.flatten_into(u.grad, u.grads())
        else:
            for slot, (_, p) in zip(u.part.layout.slots, u.params, strict=True):
                if p.grad is not None:
                    view = u.grad[slot.offset : slot.offset + slot.numel]
                    view += p.grad.reshape(-1).to(view.dtype)
        u.clear_grads()

    def reduce_accumulated(self, u: FlatUnit) -> None:
        """Fast mode: one all-reduce of the locally accumulated sum (in place in u.grad), kept in
        u.pending and waited at step()."""
        pad, tag = u.part.padding_scattered + u.part.padding_gathered, self.tag(u, "grad")
        kw = {"group": self.group, "counter": self.counter, "async_op": self.cfg.overlap}
        u.pending = C.all_reduce_sum(u.grad, padding=pad, tag=tag, **kw)
        if self.ctx.replicas is not None:  # HSDP: and across the shard groups (stages/hsdp.py)
            u.pending = self.ctx.replicas.after(u.pending, u, self.counter, whole=True)

    def reduce_scatter(self, u: FlatUnit, flat: torch.Tensor | None, grads=None) -> C.Pending:
        """Reduce-scatter u's flat gradient `flat` (N·L), whole or in C_B pieces as the
        bucketing policy cuts it (pieces may fill straight from the parameters' `grads`)."""
        # [Note: fast reduce-scatter on gloo] gloo's reduce_scatter is several times slower than
        # its all-to-all (docs/machine_notes.md), so fast mode on gloo takes the all-to-all and a
        # local tree sum as well: same volume, and its error is within the fast bound a
        # fortiori. Other backends (NCCL) use their own reduce-scatter.
        tree = self.cfg.deterministic or dist.get_backend(self.group) == "gloo"
        fn = C.reduce_scatter_tree if tree else C.reduce_scatter_fast
        pending = self.buckets.reduce_scatter(self.ctx, u, fn, flat, grads, self.tag(u, "grad"))
        if self.ctx.replicas is None:
            return pending
        return self.ctx.replicas.after(pending, u, self.counter)  # HSDP (stages/hsdp.py)

    def all_gather(self, u: FlatUnit, out, shard, phase: str, async_op=False) -> C.Pending:
        pad, tag = u.part.padding_gathered, self.tag(u, phase)
        kw = {"group": self.group, "counter": self.counter, "async_op": async_op}
        return C.all_gather(out, shard, padding=pad, tag=tag, **kw)

    def tag(self, u: FlatUnit, phase: str) -> dict:
        return {"phase": phase, "unit": u.index, "kind": "model"}

    def end_microstep(self, u: FlatUnit) -> None:
        """After the reductions drained: a stage's work per unit at the end of a micro-step."""

    def end_backward(self) -> None:
        """After every unit's end_microstep, once per backward."""

    # -- step --------------------------------------------------------------------------------

    def finish_reduction(self, u: FlatUnit) -> torch.Tensor:
        """R over the whole unit: every rank runs the whole optimizer at stage 0."""
        u.pending.wait()  # launched in backward: the all-reduce (fast), R's all-gather (det)
        u.pending = None
        return u.grad

    def take_stream(self, u: FlatUnit) -> torch.Tensor:
        """The streaming tree's result, this rank's shard of R; the tree restarts."""
        shard = u.stream.result()
        self.ctx.accounting.partials(u, u.stream.peak_partials)
        u.stream = type(u.stream)()
        return shard

    def refresh_working(self, u: FlatUnit) -> None:
        if u.master is not u.working:
            self.write_working(u, u.working)

    def write_working(self, u: FlatUnit, dst: torch.Tensor) -> None:
        """dst (the resident working extent) <- the master in the compute dtype."""
        self.placement.write_working(u, dst)

    @staticmethod
    def grad_on_host(part: UnitPartition) -> bool:
        """Whether offload_optimizer moves u.grad itself to the host: only where it is the
        reduced shard (stages 2-3). Here it is the full-size buffer the collectives use."""
        return False

    def finish_step(self) -> None:
        """After every unit's update: complete what refresh_working launched."""
