"""The step's one control exchange, and the float64 chunk partials of the global norm.

Legend: N ranks, R the reduced gradient, g = fp32(R)·s(1/(S·M)) the unscaled gradient, C the
clipping-chunk size. Everything a step needs from the other ranks besides R (the loss, the
overflow flag, which parameters had a gradient, the norm's chunk partials) travels in one
all-gather of float64 values, counted as control traffic ([Note: one control exchange] below).
The engine (zero/engine.py) calls `exchange` once per step; the arithmetic follows
reference/tree.py and docs/design.md §2.

[Note: overflow detection] The reference checks every micro-batch gradient and R. Once a
non-finite value enters an IEEE sum, the sum stays non-finite (inf + x is inf or NaN; NaN
propagates), and casting to a wider dtype cannot overflow, so "some g_j is non-finite" implies "R
is non-finite". Each rank checks the part of R it alone accounts for, through its norm partials,
and the step's one control exchange tells every rank ([Note: one control exchange]).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from . import collectives as C
from .optim import native as optim_native
from .optim import triton_kernels as optim_triton
from .unit import FlatUnit


@dataclass(frozen=True, kw_only=True)
class Exchanged:
    """What one rank knows after the control exchange in its DP group (`exchange`)."""

    overflow: bool
    """Some rank of the group found a non-finite value ([Note: overflow detection])."""
    overflow_here: bool
    """This rank found one, in the part it alone accounts for (the error message's rank)."""
    loss: float
    """The mean loss over the step's M micro-batches, every rank of the group's included."""
    partials: list[np.ndarray]
    """Per unit, the float64 chunk partials of g over the whole group, in global chunk order."""
    used: list[list[bool]]
    """Per unit, per parameter: whether any rank of the group had a gradient for it."""


@dataclass(frozen=True, kw_only=True)
class StepControl:
    """What the step takes from the other ranks besides R (`step_exchange`): over the DP group,
    and with model parallelism over the whole mesh ([Note: MP control exchange])."""

    overflow: bool
    """Some rank found a non-finite value: the step is skipped on every rank."""
    overflow_here: bool
    """This rank found one in its DP group's exchange (the error message's rank)."""
    loss: float
    """The mean loss over the step's M micro-batches (every MP rank computes the same)."""
    norm: np.float64
    """The global gradient norm ‖g‖ before clipping (not finite when `overflow`)."""
    used: list[list[bool]]
    """Per unit, per parameter: whether any rank had a gradient for it ([Note: unused
    parameters]); the update skips the others."""


def chunk_sumsq(x: torch.Tensor, chunk: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """reference.tree.chunk_sumsq in torch: float64 squares, pairwise halving per chunk. In
    place on one float64 copy: the same elementwise additions as the reference, no temporaries.
    keep (bool, x's length): the elements outside it count as +0 (a replicated parameter on a
    model-parallel rank m > 0, zero/mp/step.py), as the reference's zeros do. On CUDA a
    Triton kernel does them, one program per chunk (zero/optim/triton_kernels.py); on the CPU the
    compiled loop, chunk by chunk (zero/optim/native.py)."""
    for kernel in (optim_triton.chunk_sumsq, optim_native.chunk_sumsq):
        fused = kernel(x, chunk, keep)
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
) -> Exchanged:
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
    The loss sum, the flag and the partials stay on the device until the exchange's one read
    ([Note: host work flat in Ψ], measure/hostwork.py): the step's only device→host copy.
    losses: this rank's micro-batch losses, 0-dim tensors in the order they were run.
    Returns what the group agreed (Exchanged), and clears this rank's flags for the next step.
    keep: None, or per unit a bool mask of this rank's extent (zero/mp/step.py): elements
    outside it enter no partial, but still count for the overflow flag."""
    keep = keep or [None] * len(units)
    mine = [chunk_sumsq(own(u, x), chunk, k) for u, x, k in zip(units, g, keep)]
    partials = torch.cat(mine).to(device)  # host partials with offload_optimizer
    if inv <= 1:
        finite = [torch.isfinite(partials).all()]
        finite += [  # outside the mask (no boolean indexing: its size would need a read)
            (torch.isfinite(own(u, x)) | k).all().to(device)
            for u, x, k in zip(units, g, keep)
            if k is not None
        ]
    else:
        finite = [torch.isfinite(h).all().to(device) for h in held]
    bad = ~torch.stack(finite).all() if finite else torch.zeros((), dtype=torch.bool)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for x in losses:  # sum(losses) in run order, as Python's sum of floats would
        loss_sum = loss_sum + x.to(device, torch.float64)
    flags = [float(x) for u in units for x in u.used]
    host = C.to_device(torch.tensor([len(losses), *flags], dtype=torch.float64), device)
    head = torch.cat([loss_sum.view(1), host[:1], bad.to(torch.float64).view(1), host[1:]])
    every = gather_control(torch.cat([head, partials]), group=group, counter=counter, phase="step")
    # the one read: this rank's own row too (a fake process group, measure/fake_rank.py,
    # leaves the gathered rows unwritten)
    both = torch.cat([head, every.reshape(-1)]).cpu().numpy()
    own_head, rows = both[: len(head)], both[len(head) :].reshape(every.shape)
    loss = float(rows[:, 0].sum() / rows[:, 1].sum())
    overflow = bool(rows[:, 2].max() > 0)
    seen = rows[:, 3 : 3 + len(flags)].max(axis=0, initial=0.0) > 0
    anywhere = [bool(a) or b > 0 for a, b in zip(seen, flags, strict=True)]
    used = []
    for u in units:
        used.append(anywhere[: len(u.used)])
        anywhere = anywhere[len(u.used) :]
        u.used = [False] * len(u.used)
    per_unit, at = [], len(head)
    for u, x in zip(units, mine, strict=True):
        per_unit.append(rows[:, at : at + x.numel()].reshape(-1)[: u.part.layout.num_chunks])
        at += x.numel()
    here = bool(own_head[2] > 0)
    return Exchanged(overflow=overflow, overflow_here=here, loss=loss, partials=per_unit, used=used)


def tree_total(x: np.ndarray) -> np.float64:
    """reference.tree.tree_sum over the float64 values of x, the same bits, in
    O(log2 n) whole-array operations instead of n Python additions (0.0 for no values, as
    reference.tree.sumsq_total). [Note: the tree T] splits n leaves into power-of-two blocks,
    one per set bit of n, largest first, each block a balanced tree, and folds the blocks'
    sums from the right: T = B_1 + (B_2 + (... + B_k)). Each block starts at a multiple of its
    size, so pairing neighbours (x_0 + x_1, x_2 + x_3, ...) over the whole array is one level
    of every block at once; when the count at a level is odd, its last value is the finished
    block of that size. tests/unit/test_reference_tree.py compares it with tree_sum."""
    s = np.asarray(x, dtype=np.float64).reshape(-1)
    if s.size == 0:
        return np.float64(0.0)
    blocks = []  # smallest first
    with np.errstate(all="ignore"):  # non-finite partials are the overflow flag's business
        while s.size > 1:
            if s.size & 1:
                blocks.append(s[-1])
                s = s[:-1]
            s = s[0::2] + s[1::2]
        blocks.append(s[0])  # B_1, the largest
        acc = blocks[0]
        for b in blocks[1:]:  # B_k, then B_{k-1} + B_k, ..., B_1 + (...)
            acc = b + acc
    return np.float64(acc)


class ScaledGrads:
    """[Note: one unit's fp32 gradient at a time] g_u = fp32(R_u)·c of each unit (clipped, g_u·coef,
    once `coef` is set), made when read and not kept: the exchange reads each once, the update
    once per batch (update_batches). On a host a batch is one unit: one unit's 4 bytes per
    parameter at a time, not the extent's (with offload: past the host's floor). With every master
    on CUDA the batch is every unit (one fused launch), so all exist at once in device memory, as
    [Note: the memory bound] (measure/bench_table.py) charges; not yet measured on a GPU."""

    def __init__(self, held: list[torch.Tensor], c: torch.Tensor):
        self.held, self.c, self.coef = held, c, None

    def __iter__(self):
        return (self[i] for i in range(len(self.held)))

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.held[i].float() * self.c
        return x if self.coef is None else x.mul_(self.coef)


def step_exchange(engine, held, g, inv: np.float32) -> StepControl:
    """The engine's step: `exchange` in its DP group, then, with model parallelism, the [Note:
    MP control exchange] (zero/mp/step.py)."""
    mp, args = engine.mp, (engine.config.chunk, engine.device, engine.group, engine.counter)
    keep = None if mp is None else mp.keep(engine.units, [x.device for x in held])
    got = exchange(engine.units, engine.step_losses, held, g, inv, *args, keep=keep)
    if mp is not None:
        return mp.combine(got, engine.device)
    flat = np.concatenate(got.partials) if got.partials else np.zeros(0)
    return StepControl(
        overflow=got.overflow,
        overflow_here=got.overflow_here,
        loss=got.loss,
        norm=np.sqrt(tree_total(flat)),
        used=got.used,
    )


def gather_control(
    values: torch.Tensor, *, group, counter: C.CommCounter, phase: str, unit=None
) -> torch.Tensor:
    """Control: all-gather a small tensor (equal sizes) from every rank; returns (N, *shape)."""
    n = dist.get_world_size(group)
    elements = (n - 1) * values.numel()
    rec = C.count_call(
        counter, "all_gather", elements, 0, values, phase=phase, kind="control", unit=unit
    )
    out = torch.empty((n, *values.shape), dtype=values.dtype, device=values.device)
    if n == 1:
        out[0].copy_(values)
    else:
        mine = values.reshape(-1).contiguous()
        C.launch(C.all_gather_flat, out.view(-1), mine, group=group, async_op=False, rec=rec)
    rec.end = time.perf_counter()
    return out


def broadcast_control(tensors, *, group, counter: C.CommCounter, phase: str = "buffers") -> None:
    """Control: every tensor set in place to group rank 0's value (DDP's broadcast_buffers).
    One broadcast per dtype of a flat copy; each call is counted with the payload's elements
    (what every other rank receives once), none at N = 1, where nothing moves."""
    n = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        elements = flat.numel() if n > 1 else 0
        rec = C.count_call(
            counter, "broadcast", elements, 0, flat, phase=phase, kind="control", unit=None
        )
        if n > 1:
            src = dist.get_global_rank(group, 0)
            C.launch(dist.broadcast, flat, src=src, group=group, async_op=False, rec=rec)
            at = 0
            with torch.no_grad():
                for t in ts:
                    t.copy_(flat[at : at + t.numel()].view_as(t))
                    at += t.numel()
        rec.end = time.perf_counter()
