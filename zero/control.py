"""The step's one control exchange, and the float64 chunk partials of the global norm.

Legend: N ranks, R the reduced gradient, g = fp32(R)·s(1/(S·M)) the unscaled gradient, C the
clipping-chunk size. Everything a step needs from the other ranks besides R (the loss, the
overflow flag, which parameters had a gradient, the norm's chunk partials) travels in one
all-gather of float64 values, counted as control traffic ([Note: one control exchange] below).
The engine (zero/engine.py) calls `exchange` once per step; the arithmetic follows
reference/tree.py and docs/design.md §2.
"""

from __future__ import annotations

import numpy as np
import torch

from reference.tree import global_norm

from . import collectives as C
from . import optim_native
from .unit import FlatUnit


def chunk_sumsq(x: torch.Tensor, chunk: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """reference.tree.chunk_sumsq in torch: float64 squares, pairwise halving per chunk. In
    place on one float64 copy: the same elementwise additions as the reference, no temporaries.
    keep (bool, x's length): the elements outside it count as +0 (a replicated parameter on a
    model-parallel rank m > 0, zero/mp/control.py), as the reference's zeros do. On the CPU
    the compiled loop does the same additions chunk by chunk (zero/optim_native.py)."""
    fused = optim_native.chunk_sumsq(x, chunk, keep)
    if fused is not None:
        return fused
    s = x.to(torch.float64, copy=True).view(-1, chunk)
    if keep is not None:
        s.masked_fill_(~keep.to(s.device).view(-1, chunk), 0.0)
    s.mul_(s)
    while s.shape[1] > 1:
        h = s.shape[1] // 2
        s[:, :h].add_(s[:, h:])
        s = s[:, :h]
    return s[:, 0].clone()


def own(u: FlatUnit, x: torch.Tensor) -> torch.Tensor:
    """The part of a unit-sized or shard-sized buffer that this rank alone accounts for."""
    return x[u.part.own] if x.numel() == u.part.padded_numel else x


def exchange(
    units, losses, held, g, inv: np.float32, chunk: int, device, group, counter, keep=None
):
    """[Note: one control exchange] Everything a step needs from the other ranks besides
    R travels in one small all-gather of float64 values: this rank's loss sum and count, its
    overflow flag, and the chunk partials of the part of g it alone holds (its shard; at
    stage 0 the shard's extent of the whole). Chunks never straddle shards and shards are
    in rank order, so rank-major order is the global chunk order (reference/layout.py).
    The flag: g = fp32(R)·inv, and with inv ≤ 1 g is finite exactly where R is; the
    squares of finite float32 values cannot overflow float64, so a non-finite partial
    means a non-finite R ([Note: overflow detection]). With inv > 1 (a loss scale below
    1/M) g could overflow where R did not, so R itself is checked.
    [Note: unused parameters] One flag per parameter rides along: whether it had a
    gradient in any micro-batch of this rank; the step takes the maximum over ranks.
    Returns (overflow anywhere, on this rank, global mean loss, per-unit partials,
    per-unit lists of used flags), and clears this rank's flags for the next step.
    keep: None, or per unit a bool mask of this rank's extent (zero/mp/control.py): elements
    outside it enter no partial, but still count for the overflow flag."""
    keep = keep or [None] * len(units)
    mine = [chunk_sumsq(own(u, x), chunk, k) for u, x, k in zip(units, g, keep)]
    partials = torch.cat(mine).to(device)  # host partials with offload_optimizer
    if inv <= 1:
        bad = not bool(torch.isfinite(partials).all())
        bad = bad or any(
            not bool(torch.isfinite(own(u, x)[~k.to(x.device)]).all())
            for u, x, k in zip(units, g, keep)
            if k is not None
        )
    else:
        bad = any(not bool(torch.isfinite(h).all()) for h in held)
    flags = [float(x) for u in units for x in u.used]
    head = torch.tensor(
        [sum(losses), len(losses), float(bad), *flags],
        dtype=torch.float64,
        device=device,
    )
    every = C.gather_control(
        torch.cat([head, partials]), group=group, counter=counter, phase="step"
    )
    loss = float(every[:, 0].sum() / every[:, 1].sum())
    overflow = bool(every[:, 2].max() > 0)
    # this rank's own flags count as they are (its row of `every` holds them; a fake process
    # group, measure/simulate.py, leaves the gathered rows unwritten)
    seen = (every[:, 3 : 3 + len(flags)].amax(dim=0) > 0).tolist()
    anywhere = [bool(a) or b > 0 for a, b in zip(seen, flags, strict=True)]
    used = []
    for u in units:
        used.append(anywhere[: len(u.used)])
        anywhere = anywhere[len(u.used) :]
        u.used = [False] * len(u.used)
    per_unit, at = [], len(head)
    for u, x in zip(units, mine, strict=True):
        per_unit.append(
            every[:, at : at + x.numel()].reshape(-1)[: u.part.layout.num_chunks].cpu().numpy()
        )
        at += x.numel()
    return overflow, bad, loss, per_unit, used


def step_exchange(engine, held, g, inv: np.float32):
    """The engine's step: `exchange` in its DP group, then, with model parallelism, the [Note:
    MP control exchange] (zero/mp/control.py). Returns (overflow, bad, loss, norm, used)."""
    mp, args = engine.mp, (engine.config.chunk, engine.device, engine.group, engine.counter)
    keep = None if mp is None else mp.keep(engine.units)
    overflow, bad, loss, partials, used = exchange(
        engine.units, engine._losses, held, g, inv, *args, keep=keep
    )
    if mp is None:
        return overflow, bad, loss, global_norm(partials), used
    overflow, norm, used = mp.combine(overflow, partials, used, engine.device)
    return overflow, bad, loss, norm, used
