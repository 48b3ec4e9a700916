"""What a stage is given: StageContext, the shared queue of reductions, the accounting sink.

Legend: N ranks in the group, L a unit's shard length (a full flat buffer has N·L elements),
u a FlatUnit (zero/unit.py), C_B the bucket size (config.bucket_elements).

A stage never holds the engine (docs/design.md §3). The engine builds one StageContext and gives
it to every stage object it uses (at stage 3 two: Stage3 and, for persistent units, Stage0); a
stage reads only the context and its units. Where buffers live (device, arena, host) is the
placement policy's business (zero/zero_r/placement.py) and how gradients are cut for their
reduction is the bucketing policy's (zero/zero_r/buckets.py), so neither is a branch in a stage.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import collectives as C

if TYPE_CHECKING:
    from ..config import ZeroConfig
    from ..unit import FlatUnit
    from ..zero_r.buckets import Bucketing
    from ..zero_r.placement import Placement
    from .hsdp import Replicas


class Accounting:
    """Where stages report memory that no resident tensor shows: the streaming tree's partial
    sums (per unit, in shards) and the reduction buffers in flight (bytes, the peak)."""

    def __init__(self) -> None:
        self.extra_partials: dict[int, int] = {}  # unit index: peak partial sums, in shards of L
        self.transient_peak = 0  # bytes: the largest set of reduction buffers alive at once

    def partials(self, u: FlatUnit, peak: int) -> None:
        self.extra_partials[u.index] = max(self.extra_partials.get(u.index, 0), peak)

    def transient(self, nbytes: int, in_flight: int, bound: int) -> None:
        """Reductions in flight each hold an arrival and a receive buffer of nbytes."""
        held = 2 * nbytes * max(1, min(in_flight, bound))
        self.transient_peak = max(self.transient_peak, held)


class Reductions:
    """Launched gradient reductions, oldest first, shared by every stage object of an engine
    (a persistent stage-3 unit's reductions queue with the other units').

    [Note: bounded reductions in flight] Each launched reduction keeps its full-size input
    and receive buffers alive until it completes. Left to the end of the micro-step, that is
    every unit at once (for a 7.5B GPT, tens of GB); so when more than max_inflight reductions
    are outstanding, the oldest is completed first (ZeRO-R's constant-size buffers, §6.2)."""

    max_inflight = 2

    def __init__(self) -> None:
        self.queue: collections.deque = collections.deque()  # (complete, unit, Pending)

    def __len__(self) -> int:
        return len(self.queue)

    def make_room(self) -> None:
        """Complete the oldest reductions until one more fits within max_inflight. Called before
        a reduction allocates its buffers, so that at most max_inflight sets are ever alive (not
        max_inflight + 1 for the moment between a launch and the oldest's completion)."""
        while len(self.queue) >= self.max_inflight:
            self.pop()

    def launched(self, complete: Callable, u: FlatUnit, pending: C.Pending) -> None:
        """Track a launched reduction (its caller made room first; the loop is a guard)."""
        self.queue.append((complete, u, pending))
        while len(self.queue) > self.max_inflight:
            self.pop()

    def pop(self) -> None:
        complete, u, pending = self.queue.popleft()
        complete(u, pending)

    def drain(self) -> None:
        """Complete every outstanding reduction, oldest first (end of a micro-step)."""
        while self.queue:
            self.pop()


@dataclass
class Clock:
    """Where the engine is in its step: the engine advances it, stages read it."""

    microstep: int = 0  # micro-steps of the current step completed, 0 .. M/N - 1


@dataclass(kw_only=True)
class StageContext:
    """Everything a stage reads; per-unit facts live on the unit and its partition."""

    config: ZeroConfig
    group: object  # the group the model states are sharded over (HSDP: the shard group)
    rank: int
    world_size: int  # N (HSDP: G, zero/stages/hsdp.py)
    per_step: int  # micro-steps per step on each rank, M/N (N the whole data-parallel group)
    counter: C.CommCounter  # every collective is counted here
    clock: Clock  # the current micro-step
    group_index: dict[str, int]  # parameter name -> its optimizer parameter group
    placement: Placement  # where buffers live, and the counted copies between host and device
    buckets: Bucketing  # whole-buffer reductions, or constant-size C_B pieces
    replicas: Replicas | None = None  # HSDP's sum across the shard groups (stages/hsdp.py)
    accounting: Accounting = field(default_factory=Accounting)
    reductions: Reductions = field(default_factory=Reductions)

    def note_transient(self, nbytes: int) -> None:
        """Account nbytes of reduction buffer for each reduction in flight (at least one)."""
        self.accounting.transient(nbytes, len(self.reductions), self.reductions.max_inflight)


def replace_working(u: FlatUnit) -> torch.Tensor:
    """[Note: a NumPy view] `.numpy()` on a stage-3 parameter (or a view of it) inside
    gathered_params() marks the storage it shares with the array as never resizable again, even
    after the array is gone, so the unit could not be freed by resizing ([Note: freeing by
    storage resize] in zero/stages/stage3.py). Instead the unit gets a new working buffer (its
    values are not needed: it is freed at once and written by the next gather) and its
    parameters become views of it. The array keeps the old memory with the values it had, and
    no longer follows the parameter as it would in plain PyTorch: hence the warning. Between
    steps no autograd graph holds views of the old buffer. Returns the new buffer."""
    warnings.warn(
        f"unit {u.name or '<root>'}: its gathered parameters were shared with NumPy "
        "(.numpy()); the array keeps the values of this moment and no longer follows the "
        "parameters (copy inside gathered_params(): p.detach().cpu().numpy().copy())",
        UserWarning,
        stacklevel=6,  # the `with engine.gathered_params():` line
    )
    new = torch.empty_like(u.working)
    views = u.part.views(new)
    with torch.no_grad():
        for name, p in u.params:
            p.data = views[name]
    u.working = new
    return new


class OnBackward(torch.autograd.Function):
    """Identity in forward; in backward, before the gradients flow on past the marked tensors,
    it calls fn(unit). Stage 3 gathers a unit this way before the unit's own backward
    (Stage3.pre_backward on its outputs), and frees a frozen unit after it (on its inputs)."""

    @staticmethod
    def forward(ctx, fn, unit, *tensors):
        ctx.fn, ctx.unit = fn, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn(ctx.unit)
        return (None, None, *grads)

    @staticmethod
    def mark(fn, unit, tree):
        """`tree` (any nest of inputs or outputs) with every tensor that needs a gradient
        passed through OnBackward(fn, unit); None when none does (nothing to mark)."""
        import torch.utils._pytree as pytree

        flat, spec = pytree.tree_flatten(tree)
        idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not idx:
            return None
        marked = OnBackward.apply(fn, unit, *(flat[i] for i in idx))
        for i, t in zip(idx, marked, strict=True):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)
