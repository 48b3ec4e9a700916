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
diff of this one. The lifecycle (called by the engine, which does no stage-specific work):
    allocate(u)          once: the unit's resident buffers
    post_backward(u)     a micro-batch's gradients of u are ready (autograd hook)
    end_microstep(u)     after backward: complete what post_backward launched
    finish_reduction(u)  at step(): R, as far as this rank needs it
    refresh_working(u)   after the optimizer: the new working copy
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist

from . import collectives as C
from .partition import UnitPartition
from .unit import FlatUnit


class Stage0:
    stage = 0

    max_inflight = 2
    """[Note: bounded reductions in flight] Each launched reduction keeps its full-size input
    and receive buffers alive until it completes. Left to the end of the micro-step, that is
    every unit at once (for a 7.5B GPT, tens of GB); so when more than max_inflight reductions
    are outstanding, the oldest is completed first (ZeRO-R's constant-size buffers, §6.2)."""

    def __init__(self, engine):
        self.eng = engine
        self.cfg = engine.config
        self.group = engine.group
        self.counter = engine.counter
        self.inflight: collections.deque = collections.deque()  # (unit, Pending), oldest first
        self.refreshing: list[C.Pending] = []  # parameter all-gathers launched by the update

    # -- what stays resident -----------------------------------------------------------------

    def allocate(self, u: FlatUnit) -> None:
        u.master = self.own_master(u)
        names = {
            x
            for g in {self.eng.group_index[n] for n, _ in u.params}
            for x in self.eng.state_names(g)
        }
        u.opt = {x: torch.zeros_like(u.master) for x in sorted(names)}
        u.grad = self.new_grad(u)

    def grad_numel(self, part: UnitPartition) -> int:
        """Elements of the resident gradient buffer u.grad: the whole padded unit (N·L)."""
        return part.padded_numel

    def new_grad(self, u: FlatUnit) -> torch.Tensor:
        """u.grad, zeros: a view of the engine's gradient arena with contiguous_memory
        ([Note: contiguous memory] in zero/contiguous.py), else an allocation of its own. A
        buffer that offload_optimizer places on the host is only a placeholder here: the host
        buffer replaces it (HostOffload.place), so no device memory is spent on it."""
        dtype, device = self.cfg.grad_dtype, u.working.device
        if self.eng.offload is not None and self.grad_on_host(u.part):
            return torch.empty(0, dtype=dtype, device=device)
        arena = self.eng.grad_arena
        if arena is None:
            return torch.zeros(self.grad_numel(u.part), dtype=dtype, device=device)
        view = arena.take(self.grad_numel(u.part), dtype)
        assert view is not None, "the gradient arena was sized from these same partitions"
        return view

    def own_master(self, u: FlatUnit) -> torch.Tensor:
        """The whole fp32 master (the working copy itself when training in fp32)."""
        return u.initial

    def extent(self, part: UnitPartition) -> slice:
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

    def register_hooks(self, modules) -> None:
        """Module hooks (stage 3 gathers around each unit's forward and backward)."""

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
            if self.eng.microstep == self.cfg.micro_batches // self.eng.world_size - 1:
                u.pending = self.reduce_accumulated(u)
            return
        u.part.flatten_into(u.grad, u.grads())  # exact upcast into the reduction dtype
        u.clear_grads()
        self.launched(u, self.reduce_scatter(u, u.grad))
        self.note_pieces(u)

    def launched(self, u: FlatUnit, pending: C.Pending) -> None:
        """Track a launched reduction; complete the oldest beyond the in-flight bound."""
        self.inflight.append((u, pending))
        while len(self.inflight) > self.max_inflight:
            self.complete(*self.inflight.popleft())

    def complete(self, u: FlatUnit, pending: C.Pending) -> None:
        """Deterministic: each B_k shard joins the unit's streaming tree ([Note: the tree T])."""
        u.stream.push(pending.wait())

    def drain(self) -> None:
        """Complete every outstanding reduction, oldest first (end of a micro-step)."""
        while self.inflight:
            self.complete(*self.inflight.popleft())

    def accumulate_locally(self, u: FlatUnit) -> None:
        if self.eng.microstep == 0:
            u.part.flatten_into(u.grad, u.grads())
        else:
            for slot, (_, p) in zip(u.part.layout.slots, u.params, strict=True):
                if p.grad is not None:
                    view = u.grad[slot.offset : slot.offset + slot.numel]
                    view += p.grad.reshape(-1).to(view.dtype)
        u.clear_grads()

    def reduce_accumulated(self, u: FlatUnit) -> C.Pending:
        """Fast mode: one all-reduce of the locally accumulated sum (in place in u.grad)."""
        return C.all_reduce_sum(
            u.grad,
            group=self.group,
            counter=self.counter,
            padding=self.eng.pad_rs[u.index] + self.eng.pad_ag[u.index],
            tag=self.tag(u, "grad"),
            async_op=self.cfg.overlap,
        )

    def reduce_scatter(self, u: FlatUnit, flat: torch.Tensor | None, grads=None) -> C.Pending:
        """Reduce-scatter u's flat gradient `flat` (N·L), or, with bucket_elements, in pieces
        filled from `flat` or straight from the parameters' `grads` (flat None)."""
        # [Note: fast reduce-scatter on gloo] gloo's reduce_scatter is several times slower than
        # its all-to-all (docs/machine_notes.md), so fast mode on gloo takes the all-to-all and a
        # local tree sum as well: same volume, and its error is within the fast bound a
        # fortiori. Other backends (NCCL) use their own reduce-scatter.
        tree = self.cfg.deterministic or dist.get_backend(self.group) == "gloo"
        fn = C.reduce_scatter_tree if tree else C.reduce_scatter_fast
        if self.cfg.bucket_elements is not None:
            return self.reduce_scatter_pieces(u, fn, flat, grads)
        return fn(
            flat,
            group=self.group,
            counter=self.counter,
            padding=self.eng.pad_rs[u.index],
            tag=self.tag(u, "grad"),
            async_op=self.cfg.overlap,
        )

    def piece_width(self) -> int:
        """Columns per piece: N·width <= C_B elements (the engine checks C_B >= N)."""
        return self.cfg.bucket_elements // self.eng.world_size

    def reduce_scatter_pieces(self, u: FlatUnit, fn, flat, grads) -> C.Pieces:
        """[Note: constant-size buffers] in zero/collectives.py."""
        n, L, rank = self.eng.world_size, u.part.shard_numel, self.eng.rank
        width = self.piece_width()
        full = None if flat is None else flat.view(n, L)
        dtype, device = self.cfg.grad_dtype, u.working.device

        def launch(a: int, b: int) -> C.Pending:
            buf = torch.zeros(n, b - a, dtype=dtype, device=device)  # the capped fused buffer
            if full is None:
                u.fill_columns(buf, grads, a, b)
            else:
                buf.copy_(full[:, a:b])
            pad = sum(b - a - u.real_in(r * L + a, r * L + b) for r in range(n) if r != rank)
            return fn(
                buf.view(-1),
                group=self.group,
                counter=self.counter,
                padding=pad,
                tag=self.tag(u, "grad"),
                async_op=self.cfg.overlap,
            )

        cuts = [(a, min(a + width, L)) for a in range(0, L, width)]
        return C.Pieces(cuts, launch, torch.empty(L, dtype=dtype, device=device))

    def note_pieces(self, u: FlatUnit) -> None:
        """Account the pieces a launched reduction may hold: Pieces.depth fused buffers of at
        most N·width elements (each with a receive buffer of its size: engine.note_transient)."""
        if self.cfg.bucket_elements is not None:
            n, w = self.eng.world_size, min(self.piece_width(), u.part.shard_numel)
            self.eng.note_transient(C.Pieces.depth * n * w * self.cfg.grad_dtype.itemsize)

    def all_gather(self, u: FlatUnit, out, shard, phase: str, async_op=False) -> C.Pending:
        return C.all_gather(
            out,
            shard,
            group=self.group,
            counter=self.counter,
            padding=self.eng.pad_ag[u.index],
            tag=self.tag(u, phase),
            async_op=async_op,
        )

    def tag(self, u: FlatUnit, phase: str) -> dict:
        return {"phase": phase, "unit": u.index, "kind": "model"}

    def end_microstep(self, u: FlatUnit) -> None:
        """After drain(): anything a stage does per unit at the end of a micro-step."""

    # -- step --------------------------------------------------------------------------------

    def finish_reduction(self, u: FlatUnit) -> torch.Tensor:
        """R over the whole unit: every rank runs the whole optimizer at stage 0."""
        if self.cfg.deterministic:
            shard = self.take_stream(u)
            self.all_gather(u, u.grad, shard, "grad_gather").wait()
        else:
            u.pending.wait()  # launched after the last micro-batch's backward
            u.pending = None
        return u.grad

    def take_stream(self, u: FlatUnit) -> torch.Tensor:
        """The streaming tree's result, this rank's shard of R; the tree restarts."""
        shard = u.stream.result()
        self.eng.note_partials(u, u.stream.peak_partials)
        u.stream = type(u.stream)()
        return shard

    def refresh_working(self, u: FlatUnit) -> None:
        if u.master is not u.working:
            self.write_working(u, u.working)

    def write_working(self, u: FlatUnit, dst: torch.Tensor) -> None:
        """dst (the resident working extent) <- the master rounded to nearest even into the
        compute dtype; with offload_optimizer, rounded on the host and uploaded (counted)."""
        if self.eng.offload is None:
            dst.copy_(u.master)
        else:
            self.eng.offload.up(u, dst)

    def grad_on_host(self, part: UnitPartition) -> bool:
        """Whether offload_optimizer moves u.grad itself to the host: only where it is the
        reduced shard (stages 2-3). Here it is the full-size buffer the collectives use."""
        return False

    def finish_step(self) -> None:
        """After every unit's update: complete what refresh_working launched."""
