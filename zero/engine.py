"""ZeroEngine: ZeRO stages 0-3 around an unchanged nn.Module, one data-parallel group.

    engine = ZeroEngine(model, ZeroConfig(stage=2, micro_batches=8, ...), group=dp_group)
    for batch in my_micro_batches:            # M/N of them per step on each rank
        _, loss = engine(*batch)               # forward, on the compute-dtype working copy
        engine.backward(loss)                  # backward; reductions launch as units finish
    result = engine.step()                     # global loss, global grad norm, skipped?

Legend: N ranks in `group`, M micro-batches per step over all ranks, S loss scale, t optimizer
steps taken, R the reduced gradient. A step is exactly reference/step.py's, computed on shards:
  1. every micro-step, each unit's gradients are reduced as its stage says (zero/stages/);
  2. overflow: any non-finite in R on any rank ([Note: overflow detection], zero/control.py);
  3. g = fp32(R) · s(1/(S·M)); the global norm from chunk partials; clipping;
  4. the optimizer on this rank's extent (zero/optim/update.py), skipping parameters that no rank
     had a gradient for ([Note: unused parameters], reference/step.py); the new working copy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from reference.precision import f32, scaler_init, scaler_update
from reference.step import clip_coefficient

from . import build, control, hooks
from . import collectives as C
from .build import build_frozen_units
from .config import ZeroConfig
from .hooks import backward_scaled, cast_inputs, forward_rng, phased
from .introspect import Introspection
from .materialize import StartValues
from .mp.step import MPStep
from .optim.update import Shard, live_runs, step_shards, update_batches
from .ranks.nodes import resolve as resolve_nodes
from .ranks.watchdog import Watch
from .stages import STAGE_CLASSES, StageContext, hsdp, stage_class
from .stages.base import Clock
from .stages.stage0 import Stage0
from .unit import FlatUnit
from .zero_r.buckets import bucketing
from .zero_r.placement import Placement


@dataclass(frozen=True, kw_only=True)
class StepResult:
    loss: float  # mean loss over all M micro-batches of the step, on every rank
    norm: float | None  # global gradient norm before clipping (None when skipped)
    skipped: bool  # overflow: nothing but the loss scale changed
    scale: float  # the loss scale S this step used


class ZeroEngine(Introspection, nn.Module):
    def __init__(
        self, module, config, *, group=None, device=None, init_seed=0, init="auto", mp=None
    ):
        """config: a ZeroConfig. module may live on the meta device: each unit is then
        materialised on `device` alone, by the rule `init` names ("auto", "own", "counter" or
        fn(module): [Note: meta start values] in zero/materialize.py) for `init_seed` (None:
        zeros, for a simulated rank); self.init_report says which rule gave each value.
        mp: a TP module's MPContext; `group` is then its DP group (zero/mp/step.py).
        Construction is the named steps below, in this order; each rank makes the same
        collectives in it (the ranks-agree check, the watchdog's)."""
        super().__init__()
        self._validate(module, config, group, mp)
        self._join(mp)
        self._choose_device(device)
        every, named, frozen, values_of = self._collect_units(init_seed, init)
        parts, kinds = self._partition(named, every)
        self._build_stages(parts, kinds)
        self._allocate(named, parts, kinds, values_of)
        self.frozen_units = (
            build_frozen_units(self, frozen, values_of, self._assign) if frozen else []
        )
        self._finish_allocation(values_of)
        self._start_training_state()
        self.called, self.activation_arena = hooks.install(self, mp)

    # -- construction, step by step ------------------------------------------------------------

    def _validate(self, module, config: ZeroConfig, group, mp) -> None:
        """The config spelled out (units="auto" resolved) and checked against this world."""
        self.module, self.config = module, build.resolve_units(module, config)  # types first
        if self.config.partition_activations and mp is None:
            raise ValueError("partition_activations=True: P_a needs model parallelism (mp=)")
        self.group = group if group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        build.check_config(self.config, self.world_size)
        hsdp.check(self.config, self.world_size, mp)  # shard_group_size's world

    def _join(self, mp) -> None:
        """The traffic counter (MP's, with model parallelism), and whether peers are real."""
        self.mp = None if mp is None else MPStep(self.module, mp, self.config)
        self.counter = C.CommCounter() if mp is None else self.mp.counter  # MP's counted here
        self.counter.step = -1  # construction's checks are "step -1"
        self.nodes, self.node = resolve_nodes(  # the world's nodes, checked in _partition
            self.config.ranks_per_node, rank=dist.get_rank(), world_size=dist.get_world_size()
        )
        self.counter.layout = self.nodes  # [Note: traffic per link]
        self.fake = dist.get_backend(self.group) == "fake"  # a simulated rank: no real peers
        self.step_config = self.config.step_config(self.world_size)

    def _choose_device(self, device) -> None:
        """Where units, control tensors (NCCL: CUDA only) and the watchdog live."""
        first = next(self.module.parameters()).device
        self.device = torch.device(device) if device is not None else first
        if first.type == "meta" and self.device.type == "meta":
            raise ValueError("device='meta': a meta-device model needs a real device to build on")
        k, mode = self.config.micro_batches // self.world_size, self.config.watchdog
        self.watch = Watch(
            self.group, per_step=k, mode=mode, counter=self.counter, device=self.device
        )

    def _collect_units(self, init_seed, init):
        """(every unit, their trainable halves, their frozen halves, start values per unit): a
        unit's two halves take their start values from one pass over it (zero/build.py)."""
        cfg = self.config
        every = build.collect_units(self.module, cfg)
        named, frozen = build.split_frozen(every)
        values = StartValues(self.module, cfg.units, seed=init_seed, init=init, device=self.device)
        return every, named, frozen, values.per_unit(every)

    def _partition(self, named, every):
        """Each unit's layout and shards ([Note: flat units], zero/partition.py), once the ranks
        agree on model, config and start values; and the stage class each unit runs under."""
        cfg, n = self.config, self.world_size
        self.group_index = build.group_index(cfg, named)
        if not self.fake:
            build.check_ranks_agree(cfg, every, self.group_index, engine_like=self)
        s = self.sharding = hsdp.sharding(cfg, self.group, n, self.rank)  # HSDP: groups of G
        self.shard_group, self.shard_size, self.shard_rank = s.group, s.size, s.rank
        parts = build.partitions(cfg, named, self.group_index, world_size=s.size, rank=s.rank)
        return parts, [stage_class(cfg.stage, p.layout.numel, cfg.persist_below) for p in parts]

    def _build_stages(self, parts, kinds) -> None:
        """ZeRO-R as policies the stages are given (placement: offload, arenas; C_B pieces),
        then one stage object per class: at stage 3 a persistent unit is a stage-0 unit."""
        cfg, n = self.config, self.shard_size
        self.placement = Placement.build(
            cfg, parts, kinds, device=self.device, counter=self.counter
        )
        self.grad_arena, self.host_grad_arena = self.placement.arenas()
        self.clock = Clock()
        same = ("counter", "clock", "group_index", "placement")
        shared = {k: getattr(self, k) for k in same}  # the engine's own, under the same names
        s, k = self.sharding, cfg.micro_batches // self.world_size  # the shard group's, and M/N
        shared.update(group=s.group, rank=s.rank, world_size=s.size, replicas=s.replicas)
        self.ctx = StageContext(
            config=cfg, buckets=bucketing(cfg.bucket_elements, n), per_step=k, **shared
        )
        self.accounting = self.ctx.accounting
        self.stages: dict[type, Stage0] = {k: k(self.ctx) for k in dict.fromkeys(kinds)}
        main = STAGE_CLASSES[cfg.stage]  # gathered_params' stage (at stage 3, not Persistent)
        self.impl = self.stages.setdefault(main, main(self.ctx))
        self.units: list[FlatUnit] = []
        self._stage_of: dict[int, Stage0] = {}  # unit index -> the stage object that runs it

    def _assign(self, u: FlatUnit, kind: type) -> Stage0:
        """u runs under the engine's stage object of class `kind`."""
        self._stage_of[u.index] = stage = self.stages.setdefault(kind, kind(self.ctx))
        return stage

    def _allocate(self, named, parts, kinds, values_of) -> None:
        """Unit by unit: the flat buffers, allocated and placed by the unit's stage, so that at
        stage 3 a rank never holds more than one full unit."""
        cfg = self.config
        for i, ((uname, params), part) in enumerate(zip(named, parts, strict=True)):
            u = FlatUnit(i, uname, params, part, cfg.compute_dtype, self.device, values_of(uname))
            if u.replaced:
                build.rebind(self.module, u.replaced)
            self.units.append(u)
            stage = self._assign(u, kinds[i])
            stage.allocate(u)
            on_host, extent = stage.grad_on_host(part), stage.extent(part)
            self.placement.place(u, grad_on_host=on_host, extent=extent)
            u.initial = None  # the fp32 start values are now in the master

    def _finish_allocation(self, values_of) -> None:
        """Every arena handed out exactly; each unit's optimizer runs; the buffers."""
        for arena in (self.grad_arena, self.host_grad_arena):
            assert arena is None or arena.cursor == arena.nbytes, (arena.cursor, arena.nbytes)
        self.runs = [self.stage_of(u).runs(u) for u in self.units]
        self.init_report = values_of.report  # {unit: {parameter: the rule that gave it}}
        # [Note: buffers] materialised, in the compute dtype, broadcast before each forward
        self.buffers = build.prepare_buffers(self.module, self.device, self.config.compute_dtype)
        self._forward_talks = any(s.collective_forward for s in self.stages.values())

    def _start_training_state(self) -> None:
        """Step counts, the loss scaler, and what is read or written between calls."""
        self.counter.step = 0
        self.scaler = scaler_init(self.config.scaler) if self.config.precision == "fp16" else None
        self.t, self.data_step, self._losses = 0, 0, []  # _losses: this step's, 0-dim tensors
        self._next = 0  # [Note: one launch order]: units[::-1][_next] is launched next
        # verification reads the step's R after it (last_reduced); holding it keeps the
        # gradient buffers alive between steps ([Note: gradients live within a step])
        self.keep_reduced = False
        self.last_reduced: list[torch.Tensor] | None = None
        self.checkpoint_run_id: str | None = None  # [Note: run identity] (zero/checkpoint/)
        # [Note: named phases] what each phase of a step runs under: nothing by default;
        # measure/bench.py times them by setting its own
        self.phase: Callable[[str], AbstractContextManager] = hooks.no_phase

    @property
    def microstep(self) -> int:
        """Micro-steps run of the current step (0 between steps)."""
        return self.clock.microstep

    @property
    def step_losses(self) -> tuple[torch.Tensor, ...]:
        """This step's micro-batch losses so far, 0-dim tensors in the order they were run:
        read once, in the step's control exchange (zero/control.py)."""
        return tuple(self._losses)

    # -- the lifecycle hooks (no math here) ---------------------------------------------------

    def stage_of(self, u: FlatUnit) -> Stage0:
        """The stage object that runs unit u (at stage 3: Persistent for persistent units)."""
        return self._stage_of[u.index]

    def launch_ready(self, everything: bool = False) -> None:
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
            with self.phase("backward.hooks"):
                self.stage_of(u).post_backward(u)

    @phased("forward")
    def forward(self, *args, **kwargs):
        """The wrapped module's forward on micro-batch j = microstep·N + rank (rank in the DP
        group: d, shared by the N_m ranks of an MP group, docs/design.md §6): floating inputs
        cast to the compute dtype, torch's RNG seeded per micro-batch (zero/hooks.py)."""
        if torch.is_grad_enabled() or self._forward_talks or self.buffers:
            self.at("forward" if torch.is_grad_enabled() else "eval")  # else no collective
        if self.activation_arena is not None and torch.is_grad_enabled():
            self.activation_arena.begin()  # [Note: checkpoint generations]
        if self.config.broadcast_buffers and self.buffers:  # DDP's broadcast_buffers
            build.broadcast_buffers(self.buffers, group=self.group, counter=self.counter)
        args, kwargs = cast_inputs(args, kwargs, self.config.compute_dtype)
        j = self.microstep * self.world_size + self.rank  # [Note: seeded forward]
        with forward_rng(self.config.dropout_seed, self.data_step, j, self.device):
            return self.module(*args, **kwargs)

    @phased("backward")
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
            self.launch_ready()
        self.finalize_backward()

    @phased("backward.finalize")
    def finalize_backward(self) -> None:
        self.launch_ready(everything=True)  # units with parameters that got no gradient
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

    @phased("update")
    def step(self) -> StepResult:
        self.at("step")
        cfg, k = self.config, self.config.micro_batches // self.world_size
        if self.microstep != k:
            raise RuntimeError(
                f"step() after {self.microstep} micro-steps on rank {self.rank}; "
                f"micro_batches={cfg.micro_batches} at N={self.world_size} needs {k}"
            )
        with self.phase("update.reduce"):
            held = [self.stage_of(u).finish_reduction(u) for u in self.units]
        held = self.placement.to_optimizer(self.units, held)  # R's extent where the update runs
        scale = 1.0 if self.scaler is None else self.scaler.scale
        inv = f32(1.0 / (scale * cfg.micro_batches))
        g = control.ScaledGrads(held, torch.tensor(inv))  # g_u = fp32(R_u)·c: [Note: host scalars]
        with self.phase("update.control"):  # [Note: one control exchange] (zero/control.py)
            agreed = control.step_exchange(self, held, g, inv)  # a control.StepControl
        self._losses = []  # consumed by the exchange
        overflow = agreed.overflow
        if overflow and self.scaler is None and cfg.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradient at data step {self.data_step} (rank {self.rank} saw it: "
                f"{agreed.overflow_here}) with precision={cfg.precision!r}; nonfinite='skip' skips"
            )
        if not overflow:
            if self.keep_reduced:  # R as this rank holds it, valid until the next backward
                self.last_reduced = held  # (it keeps the released gradient buffers alive)
            coef = clip_coefficient(agreed.norm, cfg.clip_norm)
            g.coef = None if coef is None else torch.tensor(coef)  # [Note: host scalars]
            self.t += 1
            self._update(g, agreed.used)
        for u in self.units:  # [Note: gradients live within a step] (zero/unit.py)
            u.release_grad()
        del held, g
        if self.scaler is not None:
            self.scaler = scaler_update(self.scaler, overflow, cfg.scaler)
        self.data_step, self.clock.microstep = self.data_step + 1, 0
        self.counter.step += 1
        norm = None if overflow else float(agreed.norm)
        return StepResult(loss=agreed.loss, norm=norm, skipped=overflow, scale=scale)

    def _update(self, g, used) -> None:
        """The optimizer on each unit's extent, skipping parameters no rank had a gradient for
        (zero/optim/update.py), and the new working copies (the stages' refresh_working)."""
        cfg, live = self.config, []
        for u, runs, use in zip(self.units, self.runs, used, strict=True):
            lo = self.stage_of(u).extent(u.part).start
            live.append(live_runs(runs, u.part.layout.slots, lo, use, u.steps))
            u.steps = [t + x for t, x in zip(u.steps, use, strict=True)]
        for batch in update_batches(self.units):  # the disk tier streams each batch's states
            units = [self.units[i] for i in batch]
            with self.placement.streamed(units):
                with self.phase("update.optimizer"):
                    shards = [Shard(u.master, g[i], u.opt, live[i]) for u, i in zip(units, batch)]
                    step_shards(cfg.optimizer, cfg.groups, shards, deterministic=cfg.deterministic)
                    del shards  # [Note: one unit's fp32 gradient at a time] (zero/control.py)
                with self.phase("update.refresh"):
                    for u in units:  # may launch its all-gather and return
                        self.stage_of(u).refresh_working(u)
        with self.phase("update.finish"):
            for stage in self.stages.values():
                stage.finish_step()

    # -- checkpoints (zero/checkpoint/) -----------------------------------------------------

    def save(self, directory, **kwargs):
        """A sharded, atomically committed checkpoint of every rank's state (zero/checkpoint/)."""
        from . import checkpoint

        return checkpoint.save(self, directory, **kwargs)

    def load(self, directory, **kwargs):
        """Load a checkpoint saved at any world size and stage, resharding on load."""
        from . import checkpoint

        return checkpoint.load(self, directory, **kwargs)
