"""What code outside the engine may read of it: the Introspect protocol, and memory accounting.

Legend: u a FlatUnit (zero/unit.py); "extent" a range of a unit's padded flat buffer (N·L
elements); R the reduced gradient. Checkpoints (zero/checkpoint/), verification (verify/),
figures and teaching read an engine only through the members Introspect lists, never a stage
or a policy: so the stages and policies can change without their readers changing.

[Note: counting storages] Memory is reported by storage, each counted once: a view owns
nothing new, so the gradient arenas of contiguous_memory count once, whole, and a master that is
a view of the working copy (pure fp32) counts under params alone. A gradient buffer released
between steps counts with what it holds within a step ([Note: gradients live within a step]).
Host bytes are what offload_optimizer placed there; partial sums and communication buffers are
device memory.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .collectives import CommCounter
from .config import ZeroConfig
from .unit import FlatUnit


class Introspect(Protocol):
    """The read-only surface of a ZeroEngine (plus t, data_step, scaler, which load sets)."""

    module: nn.Module  # the wrapped model (its parameters are views of the units' buffers)
    config: ZeroConfig
    group: object  # the data-parallel process group
    rank: int
    world_size: int
    device: torch.device  # where control tensors and the working copy live
    fake: bool  # a simulated rank (fake process group): values are void
    units: list[FlatUnit]  # in construction order, root first
    frozen_units: list[FlatUnit]  # each unit's frozen parameters (zero/frozen.py), after them
    group_index: dict[str, int]  # parameter name -> optimizer parameter group
    counter: CommCounter  # every collective and host<->device copy, by step
    microstep: int  # micro-steps run of the current step (0 between steps)
    t: int  # optimizer steps taken
    data_step: int  # the next data step
    mp: object  # None, or a model-parallel engine's MPStep (zero/mp/control.py; .ctx)

    def param_steps(self) -> dict[str, int]: ...
    def master_extent(self, u: FlatUnit) -> slice: ...
    def working_extent(self, u: FlatUnit) -> tuple[torch.Tensor, slice]: ...
    def partial_peak(self, u: FlatUnit) -> int: ...
    def unit_specs(self) -> list[list[tuple[str, tuple[int, ...]]]]: ...
    def memory_split(self) -> dict[str, dict[str, int]]: ...


def resident(engine) -> dict[str, list[torch.Tensor]]:
    """The resident tensors by category. With offload_optimizer: host gradient buffers
    under grads, and the compute-dtype upload staging as its own category. Frozen parameters
    (zero/frozen.py) are their own category, "frozen", when the model has any."""
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
    if engine.placement.offload is not None:
        grads += [t for u in units for t in (u.host_grad, u.host_stage) if t is not None]
        staging = [u.staging for u in units if u.staging is not None]
        if staging:
            out["staging"] = staging
    return out


def memory_split(engine) -> dict[str, dict[str, int]]:
    """Resident bytes by category and placement, {"device": {...}, "host": {...}}
    ([Note: counting storages])."""
    seen: set[int] = set()
    is_host = engine.placement.is_host

    def owned(tensors, host: bool) -> int:
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if is_host(t) == host and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    extra = sum(
        engine.partial_peak(u) * u.part.shard_numel * engine.config.grad_dtype.itemsize
        for u in engine.units
    )
    tensors = resident(engine)
    device = {k: owned(v, False) for k, v in tensors.items()}
    host = {k: owned(v, True) for k, v in tensors.items()}
    # a buffer released between steps counts with the bytes it holds within one: reports
    # are of the step's model states ([Note: gradients live within a step] in zero/unit.py)
    device["grads"] += extra + sum(u.grad_nbytes for u in engine.units if u.grad_released)
    device["comm_buffers"], host["comm_buffers"] = engine.accounting.transient_peak, 0
    order = ["params", "frozen", "grads", "master", "optimizer", "comm_buffers", "staging"]
    return {
        "device": {k: device[k] for k in order if k in device},
        "host": {k: host[k] for k in order if k in host},
    }
