"""Full model states by parameter name: gathered on every rank, or set from full arrays.

Legend: u a FlatUnit; a unit's padded flat buffer has N·L elements; the master and optimizer
states cover this rank's extent of it (whole at stage 0 and for persistent units, the shard
otherwise). Verification (verify/) compares these with the reference and drives fast mode in
lock-step with them; checkpoints do not use them (zero/checkpoint/ reshards by layout).
"""

from __future__ import annotations

import numpy as np
import torch

from reference.optim import state_names

from . import collectives as C
from .unit import FlatUnit


def _full(engine, u: FlatUnit, t: torch.Tensor) -> torch.Tensor:
    if t.numel() == u.part.padded_numel:
        return t
    every = C.gather_control(
        t.to(engine.device).contiguous(),
        group=engine.group,
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
