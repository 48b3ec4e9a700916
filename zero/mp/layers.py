"""Megatron-style tensor-parallel operators, as functions of (input, local weights, MPContext).

Legend: N = N_m, m this rank's MP index, k a linear layer's input width, V the vocabulary.
    column-parallel  y_m = f(x)·W_mᵀ + b_m       W_m: rows m of W (output features split)
    row-parallel     y = g(Σ_m x_m·W_mᵀ) + b     W_m: columns m of W (input features split)
    vocab embedding  e = g(Σ_m masked lookup in rows m of the table)
    vocab xent       ℓ = log Σ_v exp(z_v - max) - (z_t - max), max and Σ taken over the group
f (copy_to_mp) and g (reduce_from_mp) are the conjugate operators of zero/mp/tp_comm.py: f is
the identity forward and a sum backward, g the reverse. A column-parallel layer followed by a
row-parallel one (QKV then attention-out, MLP-in then MLP-out) needs one f and one g, so a block
costs two sums of b·s·h in forward and two in backward (docs/design.md §6).

Biases of row-parallel layers are added once, after the sum, so the N ranks do not add N copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tp_comm as _mpc  # module access: tests plant errors in its functions
from .tp_comm import MPContext


def column_linear(x: torch.Tensor, weight, bias, mp: MPContext) -> torch.Tensor:
    """x (.., k) replicated -> (.., out/N): this rank's output features; no forward traffic."""
    return F.linear(_mpc.copy_to_mp(x, mp), weight, bias)


def row_linear(x: torch.Tensor, weight, bias, mp: MPContext) -> torch.Tensor:
    """x (.., k/N) this rank's input features -> (.., out) replicated: one g sum."""
    y = _mpc.reduce_from_mp(F.linear(x, weight), mp, "mp_fwd")
    return y if bias is None else y + bias


def vocab_range(vocab_size: int, mp: MPContext) -> tuple[int, int]:
    """[start, end) of the token ids whose rows this rank holds."""
    per = vocab_size // mp.size
    return mp.rank * per, (mp.rank + 1) * per


def vocab_embedding(idx: torch.Tensor, weight: torch.Tensor, mp: MPContext) -> torch.Tensor:
    """idx (..) int64 in [0, V) -> (.., h). weight: this rank's V/N rows of the table.

    Each id is in exactly one rank's range; the others contribute +0, so the sum has the
    looked-up row's value (a -0.0 entry comes back as +0.0, the only change).
    """
    start = mp.rank * weight.shape[0]
    outside = (idx < start) | (idx >= start + weight.shape[0])
    local = (idx - start).masked_fill(outside, 0)
    rows = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return _mpc.reduce_from_mp(rows, mp, "mp_embed")


class VocabCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from vocabulary-split logits, without gathering them.

    Forward: the max over the group (exact), Σ exp over the group ([Note: deterministic row-parallel
    sum]) and the target's logit (one rank holds it, the others send 0): three reductions of b·s
    values, phase "mp_xent". Backward needs no traffic: ∂ℓ/∂z_v = softmax_v - [v = t] on this rank's
    own columns."""

    @staticmethod
    def forward(ctx, logits, targets, mp: MPContext):
        start = mp.rank * logits.shape[-1]
        top = _mpc.reduce_max(logits.max(dim=-1).values, ctx=mp, phase="mp_xent")
        z = logits - top.unsqueeze(-1)
        e = torch.exp(z)
        total = _mpc.reduce_sum(e.sum(dim=-1), ctx=mp, phase="mp_xent")
        outside = (targets < start) | (targets >= start + logits.shape[-1])
        local = (targets - start).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_z = _mpc.reduce_sum(picked, ctx=mp, phase="mp_xent")
        ctx.save_for_backward(e / total.unsqueeze(-1), local, outside)
        return torch.log(total) - target_z

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
        return (softmax - onehot) * grad.unsqueeze(-1), None, None


def vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mp: MPContext):
    """Mean cross entropy over the tokens; logits (T, V/N) this rank's columns, targets (T)."""
    return VocabCrossEntropy.apply(logits, targets, mp).mean()
