"""ZeroEngine: ZeRO stages 0-3 around an unchanged nn.Module, one data-parallel group.

    engine = ZeroEngine(model, ZeroConfig(stage=2, micro_batches=8, ...), group=dp_group)
    for batch in my_micro_batches:            # M/N of them per step on each rank
        _, loss = engine(*batch)               # forward, on the compute-dtype working copy
        engine.backward(loss)                  # backward; reductions launch as units finish
    result = engine.step()                     # global loss, global grad norm, skipped?

Legend: N ranks in `group`, M micro-batches per step over all ranks, S loss scale, t optimizer
steps taken, R the reduced gradient. A step is exactly reference/step.py's, computed on shards:
  1. every micro-step, each unit's gradients are reduced as its stage says (zero/stages/);
  2. overflow: any non-finite in R on any rank ([Note: overflow detection]);
  3. g = fp32(R) · s(1/(S·M)); the global norm from chunk partials; clipping;
  4. the optimizer on this rank's extent (zero/optim.py), skipping parameters that no rank had
     a gradient for ([Note: unused parameters], reference/step.py), then the new working copy.

[Note: overflow detection] The reference checks every micro-batch gradient and R. Once a
non-finite value enters an IEEE sum, the sum stays non-finite (inf + x is inf or NaN; NaN
propagates), and casting to a wider dtype cannot overflow, so "some g_j is non-finite" implies "R
is non-finite". Each rank checks the part of R it alone accounts for, through its norm partials,
and the step's one control exchange tells every rank ([Note: one control exchange]).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from reference.precision import f32, scaler_init, scaler_update
from reference.step import clip_coefficient

from . import build, control, fullstate, introspect
from . import collectives as C
from .config import ZeroConfig
from .forward import backward_scaled, cast_inputs, forward_rng
from .frozen import build_frozen_units
from .materialize import StartValues
from .mp.control import MPStep
from .optim import Shard, live_runs, step_shards, update_batches
from .stages import STAGE_CLASSES, StageContext, stage_class
from .stages.base import Clock
from .stages.stage0 import Stage0
from .unit import FlatUnit
from .units import CalledCheck
from .watchdog import Watch
from .zero_r.activations import checkpoint_units
from .zero_r.buckets import bucketing
from .zero_r.contiguous import CheckpointArena
from .zero_r.placement import Placement


@dataclass(frozen=True, kw_only=True)
class StepResult:
    loss: float  # mean loss over all M micro-batches of the step, on every rank
    norm: float | None  # global gradient norm before clipping (None when skipped)
    skipped: bool  # overflow: nothing but the loss scale changed
    scale: float  # the loss scale S this step used


class ZeroEngine(nn.Module):
    def __init__(
        self,
        module,
        config: ZeroConfig,
        *,
        group=None,
        device=None,
        init_seed=0,
        init="auto",
        mp=None,
    ):
        """module may live on the meta device: each unit is then materialised on `device`
        alone, by the rule `init` names ("auto", "own", "counter" or fn(module): [Note: meta
        start values] in zero/materialize.py) for `init_seed` (None: zeros, for a simulated
        rank whose values do not matter); self.init_report says which rule gave each value.
        mp: a TP module's MPContext; `group` is then its DP group (zero/mp/control.py)."""
        super().__init__()
        if config.partition_activations and mp is None:
            raise ValueError("partition_activations=True: P_a needs model parallelism (mp=)")
        config = build.resolve_units(module, config)  # units="auto" spelled out
        self.module, self.config = module, config
        self.group = group if group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        n = self.world_size
        build.check_config(config, n)
        self.mp = None if mp is None else MPStep(module, mp, config)
        self.counter = C.CommCounter() if mp is None else self.mp.counter  # MP's counted here
        self.counter.step = -1  # construction's checks are "step -1"
        self.fake = dist.get_backend(self.group) == "fake"  # a simulated rank: no real peers
        self.step_config = config.step_config(n)
        first = next(module.parameters()).device  # control tensors too (NCCL: CUDA only)
        meta = first.type == "meta"
        self.device = device = torch.device(device) if device is not None else first
        if meta and device.type == "meta":
            raise ValueError("device='meta': a meta-device model needs a real device to build on")
        k, mode = config.micro_batches // n, config.watchdog
        self.watch = Watch(self.group, per_step=k, mode=mode, counter=self.counter, device=device)
        every = build.collect_units(module, config)
        named, frozen = build.split_frozen(every)  # frozen: zero/frozen.py
        # a unit's trainable and frozen halves take their start values from one pass over it
        values_of = StartValues(module, config.units, seed=init_seed, init=init, device=device)
        values_of = values_of.per_unit(every)
        self.group_index = build.group_index(config, named)
        if not self.fake:
            build.check_ranks_agree(config, every, self.group_index, engine_like=self)
        parts = build.partitions(config, named, self.group_index, world_size=n, rank=self.rank)
        # ZeRO-R as policies the stages are given: placement (offload, arenas) and C_B pieces
        kinds = [stage_class(config.stage, p.layout.numel, config.persist_below) for p in parts]
        self.placement = Placement.build(config, parts, kinds, device=device, counter=self.counter)
        self.grad_arena, self.host_grad_arena = self.placement.arenas()
        self.clock = Clock()
        self.ctx = ctx = StageContext(
            config=config,
            group=self.group,
            rank=self.rank,
            world_size=n,
            counter=self.counter,
            clock=self.clock,
            group_index=self.group_index,
            placement=self.placement,
            buckets=bucketing(config.bucket_elements, n),
        )
        self.accounting = ctx.accounting
        # one stage object per class, each unit given the one its kind names: at stage 3 a
        # persistent unit is simply a stage-0 unit (zero/stages/stage3.py's Persistent)
        self.stages: dict[type, Stage0] = {k: k(ctx) for k in dict.fromkeys(kinds)}
        main = STAGE_CLASSES[config.stage]  # gathered_params' stage (at stage 3, not Persistent)
        self.impl = self.stages.setdefault(main, main(ctx))
        self.units: list[FlatUnit] = []
        self._stage_of: list[Stage0] = []
        for i, ((uname, params), part) in enumerate(zip(named, parts, strict=True)):
            u = FlatUnit(i, uname, params, part, config.compute_dtype, device, values_of(uname))
            if u.replaced:
                build.rebind(module, u.replaced)
            real = [part.real_elements(r) for r in range(n)]
            L = part.shard_numel
            ctx.pad_rs.append(sum(L - real[r] for r in range(n) if r != self.rank))
            ctx.pad_ag.append((n - 1) * (L - real[self.rank]))
            ctx.accounting.extra_partials.append(0)
            self.units.append(u)
            stage = self.stages[kinds[i]]
            self._stage_of.append(stage)
            # allocate now, unit by unit: at stage 3 a rank never holds more than one full unit
            stage.allocate(u)
            self.placement.place(
                u, grad_on_host=stage.grad_on_host(part), extent=stage.extent(part)
            )
            u.initial = None  # the fp32 start values are now in the master
        self.frozen_units = build_frozen_units(self, frozen, values_of)  # after the trainable
        for arena in (self.grad_arena, self.host_grad_arena):  # each handed out exactly
            assert arena is None or arena.cursor == arena.nbytes, (arena.cursor, arena.nbytes)
        self.runs = [self.stage_of(u).runs(u) for u in self.units]
        self.init_report = values_of.report  # {unit: {parameter: the rule that gave it}}
        # [Note: buffers] materialised, in the compute dtype, broadcast before each forward
        self.buffers = build.prepare_buffers(module, device, config.compute_dtype)
        self.counter.step = 0
        self.scaler = scaler_init(config.scaler) if config.precision == "fp16" else None
        self.t, self.data_step, self._losses = 0, 0, []  # _losses: this step's, 0-dim tensors
        self._next = 0  # [Note: one launch order]: units[::-1][_next] is launched next
        # verification reads the step's R after it (last_reduced); holding it keeps the
        # gradient buffers alive between steps ([Note: gradients live within a step])
        self.keep_reduced = False
        self.last_reduced: list[torch.Tensor] | None = None
        # [Note: gradient hooks hold the engine weakly]
        hooks = [
            p.register_post_accumulate_grad_hook(_post_accumulate(weakref.ref(self), u.index, i))
            for u in self.units
            for i, (_, p) in enumerate(u.params)
        ]
        mods, every_unit = dict(self.module.named_modules()), [*self.units, *self.frozen_units]
        self.called = CalledCheck(list(dict.fromkeys(u.name for u in every_unit)), mods)
        undo = [functools.partial(_remove_hooks, hooks), self.called.stop]
        for stage in self.stages.values():
            handles = stage.register_hooks(
                {u.name: mods[u.name] for u in every_unit} | {"": self.module}
            )
            undo.append(functools.partial(_remove_hooks, handles))
        self.activation_arena: CheckpointArena | None = None
        if config.activation_checkpointing:  # ZeRO-R (zero/zero_r/activations.py)
            self.activation_arena, unwrap = checkpoint_units(
                self.units, mods, config=config, counter=self.counter, device=device, mp=mp
            )
            undo.append(unwrap)
        weakref.finalize(self, _run_all, undo)

    @property
    def microstep(self) -> int:
        """Micro-steps run of the current step (0 between steps)."""
        return self.clock.microstep

    # -- the lifecycle hooks (no math here) ---------------------------------------------------

    def stage_of(self, u: FlatUnit) -> Stage0:
        """The stage object that runs unit u (at stage 3: Persistent for persistent units)."""
        return self._stage_of[u.index]

    def _launch_ready(self, everything: bool = False) -> None:
        """[Note: one launch order] Every rank must launch the units' reductions in the same
        order, or the collectives pair up wrongly (a hang, a crash, or, for units of one size,
        silently wrong sums). Backward order is data-dependent where a unit (or one of its
        parameters) gets no gradient on some ranks only, so units are launched in one fixed
        order, the last unit first (backward order for blocks called in unit order): a ready
        unit waits for those before it, and finalize_backward launches the rest, ready or
        not (a unit without gradients reduces zeros, as DDP does)."""
        order = self.units[::-1]
        while self._next < len(order):
            u = order[self._next]
            if not everything and u.ready < len(u.params):
                return
            self._next += 1
            self.stage_of(u).post_backward(u)

    def forward(self, *args, **kwargs):
        """The wrapped module's forward on micro-batch j = microstep·N + rank (rank in the DP
        group: d, shared by the N_m ranks of an MP group, docs/design.md §6): floating inputs
        cast to the compute dtype, torch's RNG seeded per micro-batch (zero/forward.py)."""
        if torch.is_grad_enabled() or self.config.stage == 3 or self.buffers:
            self.at("forward" if torch.is_grad_enabled() else "eval")  # else no collective
        if self.activation_arena is not None and torch.is_grad_enabled():
            self.activation_arena.begin()  # [Note: checkpoint generations]
        if self.config.broadcast_buffers and self.buffers:  # DDP's broadcast_buffers
            build.broadcast_buffers(self.buffers, group=self.group, counter=self.counter)
        args, kwargs = cast_inputs(args, kwargs, self.config.compute_dtype)
        j = self.microstep * self.world_size + self.rank  # [Note: seeded forward]
        with forward_rng(self.config.dropout_seed, self.data_step, j, self.device):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (mean over its samples), then finalize_backward."""
        self.at("backward")
        self._losses.append(loss.detach().float())  # read once, in the step's exchange
        backward_scaled(loss, None if self.scaler is None else self.scaler.scale)
        self.finalize_backward()
        self.called.check({u.name for u in self.units if any(u.used)})

    def inject_gradients(self, grads: dict[str, torch.Tensor], loss: float = 0.0) -> None:
        """One micro-batch's backward without autograd, for verification: `grads` maps parameter
        names to what backward would have left in their .grad (the compute dtype, of the loss
        times the scaler's scale); a name left out had no gradient (its .grad None). Each unit
        then takes the path an autograd hook starts, last unit first, so partitioning,
        reduction and the optimizer see inputs that no model would produce (extremes, inf/NaN).
        At stage 3 no parameter is gathered: nothing reads them."""
        unknown = sorted(set(grads) - set(self.group_index))
        if unknown:
            raise ValueError(f"grads[{unknown[0]!r}]: no trainable parameter has that name")
        self.at("backward")
        self._losses.append(torch.tensor(float(loss), dtype=torch.float64))
        for u in reversed(self.units):
            for i, (name, p) in enumerate(u.params):
                if name not in grads:
                    continue
                g = grads[name]
                if tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype:
                    raise ValueError(
                        f"grads[{name!r}]: shape {tuple(g.shape)} dtype {g.dtype}; the parameter "
                        f"needs shape {tuple(p.shape)} dtype {p.dtype}"
                    )
                p.grad = g.to(p.device)
                u.used[i] = True
            u.ready = len(u.params)
            self._launch_ready()
        self.finalize_backward()

    def finalize_backward(self) -> None:
        self._launch_ready(everything=True)  # units with parameters that got no gradient
        self._next = 0
        self.ctx.reductions.drain()
        for u in (*self.units, *self.frozen_units):  # frozen: stage 3 frees what is gathered
            self.stage_of(u).end_microstep(u)
            u.ready = 0
        for stage in self.stages.values():
            stage.end_backward()
        self.clock.microstep += 1

    def at(self, call: str) -> None:
        """Every rank makes this call together ([Note: collective fingerprints])."""
        self.watch.boundary(call, step=self.data_step, micro=self.microstep)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> StepResult:
        self.at("step")
        k = self.config.micro_batches // self.world_size
        if self.microstep != k:
            raise RuntimeError(
                f"step() after {self.microstep} micro-steps on rank {self.rank}; "
                f"micro_batches={self.config.micro_batches} at N="
                f"{self.world_size} needs {k}"
            )
        held = [self.stage_of(u).finish_reduction(u) for u in self.units]
        held = self.placement.to_optimizer(self.units, held)  # R's extent where the update runs
        scale = 1.0 if self.scaler is None else self.scaler.scale
        inv = f32(1.0 / (scale * self.config.micro_batches))
        c = torch.tensor(inv)  # [Note: host scalars] (zero/collectives.py)
        g = [h.float() * c for h in held]
        overflow, bad, loss, norm, used = self._exchange(held, g, inv)
        if overflow:
            if self.scaler is None and self.config.nonfinite == "raise":
                raise FloatingPointError(
                    f"non-finite gradient at data step {self.data_step} "
                    f"(rank {self.rank} saw it: {bad}) with precision="
                    f"{self.config.precision!r}; nonfinite='skip' skips"
                )
        else:
            if self.keep_reduced:  # R as this rank holds it, valid until the next backward
                self.last_reduced = held  # (it keeps the released gradient buffers alive)
            coef = clip_coefficient(norm, self.config.clip_norm)
            if coef is not None:
                c = torch.tensor(coef)  # [Note: host scalars]
                for x in g:
                    x.mul_(c)
            self.t += 1
            shards = []
            for u, gu, runs, use in zip(self.units, g, self.runs, used, strict=True):
                lo = self.master_extent(u).start
                live = live_runs(runs, u.part.layout.slots, lo, use, u.steps)
                u.steps = [t + x for t, x in zip(u.steps, use, strict=True)]
                shards.append(Shard(u.master, gu, u.opt, live))
            for batch in update_batches(shards):
                step_shards(
                    self.config.optimizer,
                    self.config.groups,
                    [shards[i] for i in batch],
                    deterministic=self.config.deterministic,
                )
                for i in batch:  # may launch its all-gather and return
                    self.stage_of(self.units[i]).refresh_working(self.units[i])
            for stage in self.stages.values():
                stage.finish_step()
        for u in self.units:  # [Note: gradients live within a step] (zero/unit.py)
            u.release_grad()
        del held, g
        norm = None if overflow else norm
        if self.scaler is not None:
            self.scaler = scaler_update(self.scaler, overflow, self.config.scaler)
        self.data_step, self.clock.microstep = self.data_step + 1, 0
        self.counter.step += 1
        return StepResult(
            loss=loss, norm=None if norm is None else float(norm), skipped=overflow, scale=scale
        )

    def _exchange(self, held, g, inv: np.float32):
        """[Note: one control exchange] (zero/control.py; with mp, zero/mp/control.py's too):
        (overflow, bad, loss, norm, used); this rank's losses are consumed."""
        out, self._losses = control.step_exchange(self, held, g, inv), []
        return out

    # -- checkpoints (zero/checkpoint/) --------------------------------------------------------

    def save(self, directory, **kwargs):
        """A sharded, atomically committed checkpoint of every rank's state (zero/checkpoint/)."""
        from . import checkpoint

        return checkpoint.save(self, directory, **kwargs)

    def load(self, directory, **kwargs):
        """Load a checkpoint saved at any world size and stage, resharding on load."""
        from . import checkpoint

        return checkpoint.load(self, directory, **kwargs)

    # -- introspection: what other code reads (zero/introspect.py's Introspect) ----------------

    def gathered_params(self):
        """Context manager: the module's full working parameters are readable inside (stage 3
        all-gathers every unit and frees them on exit; stages 0-2 hold them anyway)."""
        self.at("gather")
        return self.impl.gathered()

    def master_extent(self, u: FlatUnit) -> slice:
        """Which elements of u's padded buffer this rank's master and optimizer states cover."""
        return self.stage_of(u).master_extent(u)

    def working_extent(self, u: FlatUnit) -> tuple[torch.Tensor, slice]:
        """u's resident working copy and which elements of the padded buffer it holds."""
        return self.stage_of(u).working_extent(u)

    def partial_peak(self, u: FlatUnit) -> int:
        """The most partial sums (shards of L) u's streaming tree has held at once."""
        return self.accounting.extra_partials[u.index]

    def memory_report(self) -> dict[str, int]:
        """Resident bytes by category, each storage counted once, wherever they live
        ([Note: counting storages]; memory_split() tells device from host)."""
        split = self.memory_split()
        return {k: split["device"][k] + split["host"][k] for k in split["device"]}

    def memory_split(self) -> dict[str, dict[str, int]]:
        """memory_report's categories split by placement: {"device": {...}, "host": {...}}."""
        return introspect.memory_split(self)

    def unit_specs(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """The units as the reference describes them: [[(param name, shape)], ...]."""
        return [[(s.name, s.shape) for s in u.part.layout.slots] for u in self.units]

    def gather_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """The full fp32 master and optimizer states by parameter name, on every rank (an
        all-gather of the shards, counted as control traffic)."""
        self.at("gather")
        return fullstate.gather_state(self)

    def param_steps(self) -> dict[str, int]:
        """t_p: the optimizer steps each parameter has taken ([Note: unused parameters])."""
        return {n: t for u in self.units for (n, _), t in zip(u.params, u.steps, strict=True)}

    def load_full_state(
        self, master, opt, *, t: int, data_step: int, scaler=None, steps=None
    ) -> None:
        """Set every model state from full fp32 arrays by parameter name, and each
        parameter's step count from `steps` (None: t). No communication: each rank takes its
        own extent. Verification runs fast mode in lock-step with it."""
        fullstate.load_full_state(self, master, opt)
        self.t, self.data_step, self.scaler = t, data_step, scaler
        for u in self.units:
            u.steps = [t if steps is None else int(steps[n]) for n, _ in u.params]


# [Note: gradient hooks hold the engine weakly] A hook registered on a parameter lives in the
# tensor's C++ autograd metadata, which Python's collector does not traverse. A hook closing over
# the engine made the cycle parameter → hook → engine → module → parameter invisible to it: a
# dropped engine, with its module, kept every model state alive until the process ended (in one
# process building systems one after another, as a benchmark or a notebook does, memory grew by
# a whole engine each time). The hook holds the engine through a weak reference and finds its unit
# by index. When the engine is collected a finalizer takes back everything it installed on the
# module: the parameter hooks, the module hooks of CalledCheck and stage 3, the checkpointing
# wrappers of ZeRO-R. A module that outlives its engine then holds none of the engine's state at
# stages 0-2. At stage 3 its parameters are the engine's Stage3Parameter views, each naming its
# unit, so the units stay as long as the module does (gather_state() first to keep the values).
# tests/distributed/test_engine_lifetime.py checks that a dropped engine frees its tensors.


def _post_accumulate(engine_ref: weakref.ref, index: int, i: int):
    """The post-accumulate-grad hook of parameter i of unit `index`."""

    def post_accumulate(_param) -> None:
        engine = engine_ref()
        if engine is None:  # collected; its finalizer is removing this hook
            return
        u = engine.units[index]
        u.used[i] = True  # [Note: unused parameters]: it has a gradient this step
        u.ready += 1
        if u.ready == len(u.params):  # overlap only decides whether it runs asynchronously
            engine._launch_ready()

    return post_accumulate


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()


def _run_all(undo) -> None:
    for fn in undo:
        fn()
