"""What code outside the engine may read of it: the Introspect protocol, and memory accounting.

Legend: u a FlatUnit (zero/unit.py); "extent" a range of a unit's padded flat buffer (N·L
elements); R the reduced gradient. Checkpoints (zero/checkpoint/), verification (verify/),
figures and teaching (notebooks/teaching/) read an engine only through the members Introspect
lists, never a stage or a policy: so the stages and policies can change without their readers
changing.

[Note: counting storages] Memory is reported by storage, each counted once: a view owns
nothing new, so the gradient arenas of contiguous_memory count once, whole, and a master that is
a view of the working copy (pure fp32) counts under params alone. A gradient buffer released
between steps counts with what it holds within a step ([Note: gradients live within a step]).
Host bytes are what offload_optimizer placed there; partial sums and communication buffers are
device memory.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import nn

from reference.optim import state_names

from . import control
from .collectives import CommCounter
from .config import ZeroConfig
from .unit import FlatUnit


class Introspect(Protocol):
    """The surface of a ZeroEngine other code may use: read-only, but for t, data_step and
    scaler (which load sets) and the few members below marked as set from outside."""

    module: nn.Module  # the wrapped model (its parameters are views of the units' buffers)
    config: ZeroConfig
    group: object  # the data-parallel process group
    rank: int
    world_size: int
    shard_group: object  # the ranks sharing the model states: `group`, or HSDP's group of G
    shard_size: int  # its size: N, or G with hierarchical sharding (zero/stages/hsdp.py)
    shard_rank: int  # this rank's shard of every unit: rank, or rank mod G
    device: torch.device  # where control tensors and the working copy live
    fake: bool  # a simulated rank (fake process group): values are void
    units: list[FlatUnit]  # in construction order, root first
    frozen_units: list[FlatUnit]  # each unit's frozen parameters (zero/build.py), after them
    group_index: dict[str, int]  # parameter name -> optimizer parameter group
    counter: CommCounter  # every collective and host<->device copy, by step
    microstep: int  # micro-steps run of the current step (0 between steps)
    t: int  # optimizer steps taken
    data_step: int  # the next data step
    mp: object  # None, or a model-parallel engine's MPStep (zero/mp/step.py; .ctx)
    checkpoint_run_id: str | None  # the run a save continues ([Note: run identity]); load sets it
    # what verification sets and reads: keep_reduced = True makes each step leave R, as this
    # rank holds it, in last_reduced (one tensor per unit) until the next backward
    keep_reduced: bool
    last_reduced: list[torch.Tensor] | None
    phase: object  # [Note: named phases] (zero/hooks.py): measure/bench.py sets a timer here

    def param_steps(self) -> dict[str, int]: ...
    def master_extent(self, u: FlatUnit) -> slice: ...
    def working_extent(self, u: FlatUnit) -> tuple[torch.Tensor, slice]: ...
    def partial_peak(self, u: FlatUnit) -> int: ...
    def unit_specs(self) -> list[list[tuple[str, tuple[int, ...]]]]: ...
    def memory_split(self) -> dict[str, dict[str, int]]: ...
    def released_grads(self) -> list[str]: ...


class Introspection:
    """ZeroEngine's side of Introspect: the reads other code goes through.
    A mixin of ZeroEngine, kept beside the protocol it implements; its methods use the engine's
    `at`, `impl`, `stage_of` and `accounting`."""

    # -- reads -------------------------------------------------------------------------------

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
        return self.accounting.extra_partials.get(u.index, 0)

    def memory_report(self) -> dict[str, int]:
        """Resident bytes by category, each storage counted once, wherever they live
        ([Note: counting storages]; memory_split() tells device from host)."""
        split = self.memory_split()
        return {k: sum(at.get(k, 0) for at in split.values()) for k in split["device"]}

    def memory_split(self) -> dict[str, dict[str, int]]:
        """memory_report's categories split by placement: {"device": {...}, "host": {...}}."""
        return memory_split(self)

    def released_grads(self) -> list[str]:
        """The units whose gradient buffer is released now ([Note: gradients live within a
        step], zero/unit.py): between steps, those ZeroConfig.release_grads lets go."""
        return [u.name for u in self.units if u.grad_released]

    def unit_specs(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """The units as the reference describes them: [[(param name, shape)], ...]."""
        return [[(s.name, s.shape) for s in u.part.layout.slots] for u in self.units]

    def gather_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """The full fp32 master and optimizer states by parameter name, on every rank (an
        all-gather of the shards, counted as control traffic)."""
        self.at("gather")
        return gather_state(self)

    def param_steps(self) -> dict[str, int]:
        """t_p: the optimizer steps each parameter has taken ([Note: unused parameters])."""
        return {n: t for u in self.units for (n, _), t in zip(u.params, u.steps, strict=True)}

    def load_full_state(
        self, master, opt, *, t: int, data_step: int, scaler=None, steps=None
    ) -> None:
        """Set every model state from full fp32 arrays by parameter name, and each
        parameter's step count from `steps` (None: t). No communication: each rank takes its
        own extent. Verification runs fast mode in lock-step with it."""
        load_full_state(self, master, opt)
        self.t, self.data_step, self.scaler = t, data_step, scaler
        for u in self.units:
            u.steps = [t if steps is None else int(steps[n]) for n, _ in u.params]


def resident(engine) -> dict[str, list[torch.Tensor]]:
    """The resident tensors by category. With offload_optimizer: host gradient buffers
    under grads, and the compute-dtype upload staging as its own category. Frozen parameters
    (zero/build.py) are their own category, "frozen", when the model has any; hpZ's
    secondary parts (ZeroConfig.hpz) theirs, "hpz"."""
    units = engine.units
    grads = [u.grad for u in units if not u.grad_released]  # reading it would allocate it
    out = {
        "params": [engine.working_extent(u)[0] for u in units],
        "grads": grads,
        "master": [u.master for u in units],
        "optimizer": [t for u in units for t in u.opt.values()],
    }
    frozen = getattr(engine, "frozen_units", [])
    if frozen:
        out["frozen"] = [engine.working_extent(u)[0] for u in frozen]
    if engine.config.hpz:  # ZeRO++'s secondary parts (zero/stages/hpz.py)
        out["hpz"] = [u.secondary for u in units if hasattr(u, "secondary")]
    if engine.placement.offload is not None:
        grads += [t for u in units for t in (u.host_grad, u.host_stage) if t is not None]
        if engine.placement.offload.slots:  # [Note: bounded upload staging]
            out["staging"] = list(engine.placement.offload.slots)
    return out


def memory_split(engine) -> dict[str, dict[str, int]]:
    """Resident bytes by category and placement, {"device": {...}, "host": {...}}, and with
    the disk tier "disk": {...}, its state files ([Note: counting storages])."""
    seen: set[int] = set()
    placement = engine.placement

    def where(t: torch.Tensor) -> str:
        return "disk" if placement.is_disk(t) else "host" if placement.is_host(t) else "device"

    def owned(tensors, at: str) -> int:
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if where(t) == at and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    extra = sum(
        engine.partial_peak(u) * u.part.shard_numel * engine.config.grad_dtype.itemsize
        for u in engine.units
    )
    tensors = resident(engine)
    device = {k: owned(v, "device") for k, v in tensors.items()}
    host = {k: owned(v, "host") for k, v in tensors.items()}
    disk = {k: owned(v, "disk") for k, v in tensors.items()}
    # a buffer released between steps counts with the bytes it holds within one: reports
    # are of the step's model states ([Note: gradients live within a step] in zero/unit.py)
    device["grads"] += extra + sum(u.grad_nbytes for u in engine.units if u.grad_released)
    device["comm_buffers"], host["comm_buffers"] = engine.accounting.transient_peak, 0
    order = ["params", "frozen", "grads", "master", "optimizer", "hpz", "comm_buffers", "staging"]
    out = {
        "device": {k: device[k] for k in order if k in device},
        "host": {k: host[k] for k in order if k in host},
    }
    if any(disk.values()):  # the disk tier's state files (zero/zero_r/disk.py)
        out["disk"] = {k: disk.get(k, 0) for k in out["host"]}
    return out


# -- Full model states by parameter name: gathered on every rank, or set from full arrays. ---------
# Legend: u a FlatUnit; a unit's padded flat buffer has N·L elements; the master and optimizer
# states cover this rank's extent of it (whole at stage 0 and for persistent units, the shard
# otherwise). Verification (verify/) compares these with the reference and drives fast mode in
# lock-step with them; checkpoints do not use them (zero/checkpoint/ reshards by layout).


def _full(engine, u: FlatUnit, t: torch.Tensor) -> torch.Tensor:
    if t.numel() == u.part.padded_numel:
        return t
    every = control.gather_control(
        t.to(engine.device).contiguous(),
        group=engine.shard_group,
        counter=engine.counter,
        phase="gather_state",
    )
    return every.reshape(-1)


def gather_state(engine):
    """The full fp32 master and optimizer states by parameter name, on every rank (an
    all-gather of the shards, counted as control traffic)."""
    cfg = engine.config
    master: dict[str, torch.Tensor] = {}
    opt: dict[str, dict[str, torch.Tensor]] = {pn: {} for pn in engine.group_index}
    for u in engine.units:
        for key, t in {"master": u.master, **u.opt}.items():
            full = _full(engine, u, t)
            for s, (pn, _) in zip(u.part.layout.slots, u.params, strict=True):
                v = full[s.offset : s.offset + s.numel].view(s.shape).clone()
                if key == "master":
                    master[pn] = v
                elif key in state_names(cfg.optimizer, cfg.groups[engine.group_index[pn]]):
                    opt[pn][key] = v
    return master, opt


def load_full_state(engine, master, opt) -> None:
    """Set every model state from full fp32 arrays by parameter name. No communication:
    each rank takes its own extent."""

    def padded(u: FlatUnit, arrays) -> torch.Tensor:
        full = torch.zeros(u.part.padded_numel, device=u.working.device)
        u.part.flatten_into(full, {k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()})
        return full

    engine.placement.synchronize()  # no upload may still read a host buffer written here
    for u in engine.units:
        ext = engine.master_extent(u)
        full = padded(u, {k: master[k] for k, _ in u.params})
        resident, held = engine.working_extent(u)
        resident.copy_(full[held])  # the master rounded to the compute dtype
        if u.master.untyped_storage().data_ptr() != resident.untyped_storage().data_ptr():
            u.master.copy_(full[ext])
        for x, state in u.opt.items():
            zeros = {k: np.zeros(tuple(p.shape), np.float32) for k, p in u.params}
            state.copy_(padded(u, {k: opt[k].get(x, zeros[k]) for k, _ in u.params})[ext])
