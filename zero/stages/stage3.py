"""Stage 3, P_os+g+p: the working parameters are partitioned too (ZeRO paper §5.3).

A diff of stage 2 (zero/stages/stage2.py). Between uses, rank r holds only its shard of each unit's
working parameters (compute dtype, L elements); the unit's full flat buffer exists only while the
unit runs:
    pre_forward(u)    all-gather u (or wait for its prefetch), then prefetch the next unit
                      (the root's pre-hook prefetches the first unit)
    post_forward(u)   free u, and mark its outputs so that its backward gathers it again
                      (the last unit's backward gather is launched here)
    pre_backward(u)   all-gather u again, then prefetch the unit before it
    post_backward(u)  reduce-scatter u's gradients (stage 2), then free u
The root unit (embeddings, the tied head, final norm) is used first and last, so it stays
gathered from its first use in forward to the end of backward (docs/design.md §3).

[Note: freeing by storage resize] Autograd saves views of the parameters for backward. Freeing
resizes the flat buffer's storage to 0 bytes and gathering resizes it back, so every saved view
keeps pointing at the same storage object and sees the re-gathered values. A kernel reading a
storage of 0 bytes would crash, so the parameters become Stage3Parameter, whose every use of
values while its unit is sharded raises an error naming the parameter and the unit (shape, dtype
and grad stay readable). To read full parameters between steps: `with engine.gathered_params():`.

Units of at most `persist_below` parameters are persistent: the engine gives them to Persistent,
the stage-0 policy (whole on every rank, no parameter traffic, gradients reduced to every rank:
2Ψ_unit per step), so Stage3 only ever sees the units it shards.

Resident per rank: working params Ψ·compute bytes / N, gradients Ψ·reduction bytes / N, master +
states KΨ/N, plus the units gathered at the moment (at most `max_live` besides the root).
Traffic per micro-step (× (N-1)/N): 3Ψ (all-gather in forward, again in backward, reduce-scatter);
the root costs 2Ψ_root (one all-gather, one reduce-scatter). At M = N that is the paper's 3Ψ.
With ZeroConfig.hpz, the backward all-gather comes from a secondary partition inside the node
(zero/stages/hpz.py).
"""

from __future__ import annotations

import contextlib

import torch

from ..unit import FlatUnit
from . import zeropp
from .base import OnBackward, StageContext, replace_working
from .frozen import mark_inputs
from .hpz import HpZ
from .sharded import PartitionState, Stage3Parameter
from .stage0 import Stage0
from .stage2 import Stage2
from .zeropp import NodeGroups


class Persistent(Stage0):
    """A stage-3 unit of at most persist_below parameters: stage 0, and always gathered."""

    stage = 3

    def allocate(self, u: FlatUnit) -> None:
        super().allocate(u)
        u.state = PartitionState.GATHERED

    def allocate_frozen(self, u: FlatUnit) -> None:
        u.state = PartitionState.GATHERED


class Stage3(Stage2):
    stage = 3
    collective_forward = True

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        self.units: list[FlatUnit] = []  # the units this stage shards (not the persistent ones)
        self.order: list[FlatUnit] = []  # units in forward execution order, this pass
        self.last_order: list[FlatUnit] = []  # ... and the previous pass's: forward prefetch
        self.max_live = 2  # gathered non-root units at once: the running one and one prefetched
        self.peak_live = 0
        self.gathering: dict[int, object] = {}  # unit index -> Pending all-gather
        cfg = ctx.config
        self.nodes = NodeGroups(ctx) if cfg.hpz or cfg.qgz_bits else None
        zeropp.refuse_subgroup(ctx)
        self.hpz = HpZ(ctx, self.nodes) if cfg.hpz else None  # ZeRO++'s secondary partition

    def post_backward(self, u: FlatUnit) -> None:
        """u's backward is over: free its gathered parameters first, then copy the gradients
        out and launch the reduce-scatter (stage 2), so that the full parameters and the
        gradient's arrival buffer are never alive together."""
        if u.index in self.gathering:  # prefetched, but no gradient reached it this pass
            self.gathering.pop(u.index).wait()
        self.transition(u, PartitionState.SHARDED)
        super().post_backward(u)

    # -- resident state ----------------------------------------------------------------------

    def allocate(self, u: FlatUnit) -> None:
        self.units.append(u)
        super().allocate(u)
        u.shard = u.working[u.part.own].clone()  # 1D, compute dtype, L: the resident part
        if u.shard.dtype == torch.float32:  # pure fp32: the shard is the master itself
            u.master = u.shard
        if self.nodes is not None:  # [Note: one node's group]
            self.nodes.make()
        if self.hpz is not None:  # frozen units keep no part: [Note: hpZ's secondary shards]
            self.hpz.allocate(u)
        self._shard(u)

    def allocate_frozen(self, u: FlatUnit) -> None:
        """Frozen parameters (zero/build.py): sharded like the trainable ones, gathered with
        their unit; freed after backward by mark_inputs (zero/stages/frozen.py: autograd hooks
        on parameters never fire for them), else at the end of the micro-step."""
        self.units.append(u)
        u.shard = u.working[u.part.own].clone()  # 1D, compute dtype, L
        self._shard(u)

    def _shard(self, u: FlatUnit) -> None:
        u.state = PartitionState.GATHERED
        for name, p in u.params:  # in place: identity, hooks and tied references survive
            p.__class__ = Stage3Parameter
            p._zero_unit, p._zero_name = u, name
        self.transition(u, PartitionState.SHARDED)

    @contextlib.contextmanager
    def gathered(self):
        """Every unit gathered (full working parameters readable), then sharded again. It is a
        deliberate exception to the live-unit bound, so it does not count in peak_live."""
        peak = self.peak_live
        units = list(self.units)
        for u in units:
            self.gather(u, "gathered_params")
        try:
            yield
        finally:
            for u in units:
                self.transition(u, PartitionState.SHARDED)
            self.peak_live = peak

    def working_extent(self, u: FlatUnit):
        return u.shard, u.part.own

    def refresh_working(self, u: FlatUnit) -> None:
        if self.hpz is not None:
            self.hpz.forget(u)  # the values change: [Note: hpZ's secondary shards]
        if u.master is not u.shard:
            self.write_working(u, u.shard)  # round to nearest even; it stays sharded

    # -- the one place where a unit changes state ---------------------------------------------

    def transition(self, u: FlatUnit, to: PartitionState, phase: str = "") -> None:
        # [Note: re-gathering under saved views] Forward saved views of these parameters for
        # backward; the backward all-gather writes the same values again into their storage.
        # Autograd would take that write for an in-place modification (backends bump the
        # version counter, gloo even from its own thread when an asynchronous gather completes),
        # so the counter is put back to its value from before the gather was launched.
        if to is PartitionState.GATHERED and u.state is PartitionState.GATHERING:
            keep = u.keep_version  # captured when the prefetch was launched
        else:
            keep = torch.autograd._unsafe_preserve_version_counter(u.working)
        with keep:
            self._transition(u, to, phase)
        if to is PartitionState.GATHERING:
            u.keep_version = keep
        self.peak_live = max(self.peak_live, self._live())

    def _transition(self, u: FlatUnit, to: PartitionState, phase: str) -> None:
        storage = u.working.untyped_storage()
        if to is PartitionState.SHARDED:  # [Note: freeing by storage resize]
            if not storage.resizable():
                storage = replace_working(u).untyped_storage()  # [Note: a NumPy view]
            storage.resize_(0)
        elif to is PartitionState.GATHERING:
            storage.resize_(u.part.padded_numel * u.working.element_size())
            self.gathering[u.index] = self.all_gather(u, u.working, u.shard, phase, async_op=True)
        elif to is PartitionState.GATHERED:
            if u.state is PartitionState.SHARDED:
                storage.resize_(u.part.padded_numel * u.working.element_size())
                self.all_gather(u, u.working, u.shard, phase).wait()
            else:
                self.gathering.pop(u.index).wait()
        u.state = to

    def all_gather(self, u: FlatUnit, out, shard, phase: str, async_op=False):
        """Over the world; with hpZ a backward gather from the node's parts (stages/hpz.py)."""
        if self.hpz is not None and self.hpz.serves(u, phase):
            return self.hpz.all_gather(u, out, self.tag(u, phase), async_op)
        if self.cfg.qwz_bits and phase in ("param_fwd", "param_bwd"):  # [Note: qwZ's values]
            return zeropp.qwz_all_gather(self.ctx, u, out, shard, self.tag(u, phase), async_op)
        return super().all_gather(u, out, shard, phase, async_op)

    def reduce_scatter(self, u: FlatUnit, flat, grads=None):
        """With qgZ, the two quantized hops of [Note: qgZ's sum] (zero/stages/zeropp.py)."""
        if not self.cfg.qgz_bits:
            return super().reduce_scatter(u, flat, grads)
        tag = self.tag(u, "grad")
        return zeropp.qgz_reduce_scatter(self.ctx, self.nodes, flat, tag, self.cfg.overlap)

    def _live(self) -> int:
        """Gathered or gathering units, the root excepted (it is accounted apart)."""
        sharded = PartitionState.SHARDED
        return sum(getattr(x, "state", sharded) is not sharded for x in self.units if x.name)

    def gather(self, u: FlatUnit, phase: str) -> None:
        if u.state is not PartitionState.GATHERED:
            self.transition(u, PartitionState.GATHERED, phase)

    def prefetch(self, u: FlatUnit | None, phase: str) -> None:
        """Start gathering u in the background if the live-unit bound allows it."""
        if u is None or not self.cfg.overlap or u.state is not PartitionState.SHARDED:
            return
        if self._live() < self.max_live:
            self.transition(u, PartitionState.GATHERING, phase)

    # -- hooks -------------------------------------------------------------------------------

    def register_hooks(self, modules: dict[str, torch.nn.Module]) -> list:
        root, handles = modules[""], []
        for u in self.units:
            if u.name:
                m = modules[u.name]
                if u.frozen:  # registered first, so it wraps the inputs the unit receives
                    handles.append(
                        m.register_forward_pre_hook(mark_inputs(self, u), with_kwargs=True)
                    )
                handles.append(m.register_forward_pre_hook(lambda _m, _a, u=u: self.pre_forward(u)))
                handles.append(
                    m.register_forward_hook(lambda _m, _a, out, u=u: self.post_forward(u, out))
                )
        for root_unit in [u for u in self.units if not u.name]:  # trainable and frozen parts
            handles.append(
                root.register_forward_pre_hook(lambda _m, _a, u=root_unit: self.pre_forward_root(u))
            )
        return handles

    def release(self, u: FlatUnit) -> None:
        """A frozen unit's backward is over (zero/stages/frozen.py's mark_inputs)."""
        if u.state is PartitionState.GATHERED:
            self.transition(u, PartitionState.SHARDED)

    # [Note: the ends of a pass] Within a pass each unit's gather is launched while its neighbour
    # computes; at the two ends nothing computed before it: the first unit of forward would be
    # gathered after the root's, and the last unit of forward again when backward reaches it,
    # each a synchronous gather that also waits for the slowest rank (at the 101M GPT, N = 2,
    # 9 and 10-130 ms a step). So the root's pre-hook launches the first unit's gather (behind
    # the embeddings), and the last unit's backward gather is launched as soon as forward frees
    # it (behind the head and the loss). The order is the previous pass's, the same on every
    # rank; the gathers and their counted traffic are the ones the unit had (3Ψ per micro-step).
    # Keeping the last unit gathered instead would save its second gather, but change the
    # paper's volume that the simulation and verify pin.

    def pre_forward_root(self, u: FlatUnit) -> None:
        self.gather(u, "param_fwd")
        if self.last_order:  # [Note: the ends of a pass]
            self.prefetch(self.last_order[0], "param_fwd")

    def pre_forward(self, u: FlatUnit) -> None:
        if u not in self.order:
            self.order.append(u)
        self.gather(u, "param_fwd")
        if self.hpz is not None:
            self.hpz.keep(u)  # this micro-step's values: [Note: hpZ's secondary shards]
        self.prefetch(self._neighbour(self.last_order, u, +1), "param_fwd")

    def post_forward(self, u: FlatUnit, output):
        self.transition(u, PartitionState.SHARDED)
        if not torch.is_grad_enabled():
            return output
        marked = OnBackward.mark(self.pre_backward, u, output)
        if marked is None:
            return output
        if self.last_order and u is self.last_order[-1]:  # [Note: the ends of a pass]
            self.prefetch(u, "param_bwd")
        return marked

    def pre_backward(self, u: FlatUnit) -> None:
        self.gather(u, "param_bwd")
        self.prefetch(self._neighbour(self.order, u, -1), "param_bwd")

    @staticmethod
    def _neighbour(order, u: FlatUnit, step: int) -> FlatUnit | None:
        """The unit after (+1) or before (-1) u in a recorded forward order."""
        if u not in order:
            return None
        i = order.index(u) + step
        return order[i] if 0 <= i < len(order) else None

    def end_microstep(self, u: FlatUnit) -> None:
        super().end_microstep(u)
        if self.hpz is not None:
            self.hpz.forget(u)
        if u.state is not PartitionState.SHARDED:  # the root, or a unit unused in backward
            if u.index in self.gathering:
                self.gathering.pop(u.index).wait()
            self.transition(u, PartitionState.SHARDED)

    def end_backward(self) -> None:
        """The order is relearned every pass: it may depend on data."""
        self.last_order, self.order = self.order, []
