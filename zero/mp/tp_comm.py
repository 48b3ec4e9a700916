"""The tensor-parallel collectives: stateless, counted by zero.collectives' CommCounter.

Legend: N = N_m ranks in the model-parallel group; X the elements of the tensor reduced (an
activation of b·s·h elements, or b·s per-token scalars in the cross entropy). Volumes are
elements *sent per rank*, as in zero/collectives.py:
    sum, deterministic   all-gather of the N partials + local tree    (N-1)·X
    sum, fast            the backend's all-reduce (SUM, a ring)        2(N-1)·⌈X/N⌉
    max (either mode)    the backend's all-reduce (MAX; exact)         2(N-1)·⌈X/N⌉
(2(N-1)/N·X when N divides X; the deterministic sum costs N/2 times the ring's: the same at
N_m = 2. An all-to-all + tree + all-gather would cost the ring's volume with the same bits; it is
left for when N_m > 2 matters.)

[Note: mp traffic kind] Every record has kind="mp", so ``counter.volume(kind="model")`` stays
ZeRO's model-state traffic of docs/design.md §2 and the MP traffic is read apart with
kind="mp". Phases: "mp_fwd" (g, the row-parallel sums of forward), "mp_bwd" (f, the input
gradients of column-parallel layers in backward), "mp_embed" (the vocabulary-parallel
embedding), "mp_xent" (the vocabulary-parallel cross entropy). docs/design.md §6 has the table.

[Note: deterministic row-parallel sum] Deterministic mode all-gathers the N partial results and sums
them with the reference's tree T in rank order (reference/tree.py), so the bits depend neither on
the backend's ring nor on timing: two runs give the same bits. Fast mode lets the backend sum in its
own order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.tree import tree_sum

from ..collectives import CommCounter, Pending, all_gather, count_call, launch

KIND = "mp"
"""The counter kind of every tensor-parallel collective ([Note: mp traffic kind])."""

PHASES = ("mp_fwd", "mp_bwd", "mp_embed", "mp_xent")


@dataclass(frozen=True, kw_only=True)
class MPContext:
    """What a tensor-parallel layer needs to communicate; passed in, never global."""

    group: object
    """The model-parallel process group (MeshGroups.mp_group)."""
    size: int
    """N_m, the group's size."""
    rank: int
    """m, this rank's index in the group: which slice it holds."""
    counter: CommCounter
    """Where every MP collective is recorded (kind="mp")."""
    deterministic: bool = True
    """Sum partial results by the tree T in rank order (True) or by the backend (False)."""

    @staticmethod
    def of(group, *, counter: CommCounter, deterministic: bool = True) -> MPContext:
        return MPContext(
            group=group,
            size=dist.get_world_size(group),
            rank=dist.get_rank(group),
            counter=counter,
            deterministic=deterministic,
        )


def _ring(n: int, x: torch.Tensor) -> int:
    return 2 * (n - 1) * math.ceil(x.numel() / n)


def reduce_sum(x: torch.Tensor, *, ctx: MPContext, phase: str) -> torch.Tensor:
    """Σ over the MP group of every rank's x (same shape everywhere); a new tensor.

    Deterministic: T(x_0, ..., x_{N-1}) elementwise, sending (N-1)·X elements per rank; fast:
    the backend's all-reduce, 2(N-1)·⌈X/N⌉ ([Note: deterministic row-parallel sum]).
    """
    n, tag = ctx.size, dict(phase=phase, kind=KIND, unit=None)
    x = x.contiguous()
    if ctx.deterministic:
        out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        all_gather(
            out.view(-1), x.view(-1), group=ctx.group, counter=ctx.counter, padding=0, tag=tag
        ).wait()
        return tree_sum(list(out.unbind(0)))
    out = x.clone()
    rec = count_call(ctx.counter, "all_reduce", _ring(n, x), 0, x, **tag)
    if n > 1:
        launch(dist.all_reduce, out, group=ctx.group, async_op=False, rec=rec)  # watched
    return Pending(None, lambda: out, rec).wait()


def reduce_max(x: torch.Tensor, *, ctx: MPContext, phase: str) -> torch.Tensor:
    """Elementwise max over the MP group (exact in any order): 2(N-1)·⌈X/N⌉ per rank."""
    out = x.detach().clone().contiguous()
    rec = count_call(
        ctx.counter, "all_reduce", _ring(ctx.size, out), 0, out, phase=phase, kind=KIND, unit=None
    )
    if ctx.size > 1:
        launch(dist.all_reduce, out, op=dist.ReduceOp.MAX, group=ctx.group, async_op=False, rec=rec)
    return Pending(None, lambda: out, rec).wait()


class CopyToMP(torch.autograd.Function):
    """f: identity in forward; in backward the input gradient is summed over the MP group
    (each rank's column-parallel layer produced a partial of it). Phase "mp_bwd"."""

    @staticmethod
    def forward(ctx, x, mp: MPContext):
        ctx.mp = mp
        return x.view_as(x)  # a new autograd node over the same storage: no copy

    @staticmethod
    def backward(ctx, grad):
        return reduce_sum(grad, ctx=ctx.mp, phase="mp_bwd"), None


class ReduceFromMP(torch.autograd.Function):
    """g: the sum over the MP group in forward (a row-parallel layer's partial products);
    identity in backward (every rank needs the whole output gradient)."""

    @staticmethod
    def forward(ctx, x, mp: MPContext, phase: str):
        return reduce_sum(x, ctx=mp, phase=phase)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_mp(x: torch.Tensor, mp: MPContext) -> torch.Tensor:
    return CopyToMP.apply(x, mp)


def reduce_from_mp(x: torch.Tensor, mp: MPContext, phase: str = "mp_fwd") -> torch.Tensor:
    return ReduceFromMP.apply(x, mp, phase)
