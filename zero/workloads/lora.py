"""LoRA: a frozen base model with trainable low-rank adapters, the frozen-parameter workload.

    names = add_lora(model, rank=4)          # freeze every parameter, wrap the linears
    engine = ZeroEngine(model, config)       # wrapped unchanged: frozen base, trainable A, B

Legend (Hu et al., "LoRA", arXiv 2106.09685): a linear map y = W x + b with W (out × in) frozen
gains y = W x + b + s·B(A x), A (r × in), B (out × r), s = alpha / r; only A and B train. B
starts at zero, so the first forward equals the base model's. Works on nn.Linear and on the
Conv1D of Hugging Face's GPT-2 (weight stored in × out, y = x W + b). The engine holds the
frozen part in its own flat buffers (zero/build.py, docs/models.md "Parameters").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..materialize import fail, generator, stable_seed


def _dims(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or a GPT-2 Conv1D (which has `nf`, weight in × out)."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if hasattr(base, "nf") and getattr(base, "weight", None) is not None:
        return base.weight.shape[0], base.nf
    raise fail("base", type(base).__name__, "an nn.Linear or a GPT-2 Conv1D")


class LoRALinear(nn.Module):
    """base(x) + s·B(A x), the base frozen (requires_grad=False), A and B trainable."""

    def __init__(self, base: nn.Module, rank: int, *, alpha: float | None = None, seed: int = 0,
                 name: str = ""):  # fmt: skip
        """A ~ N(0, 1/in) drawn from (seed, name) alone (any rank, any order); B = 0;
        s = alpha / rank (alpha defaults to rank: s = 1)."""
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise fail("rank", rank, "an integer >= 1")
        d_in, d_out = _dims(base)
        self.base, self.rank = base, rank
        self.scaling = float(alpha if alpha is not None else rank) / rank
        for p in base.parameters():
            p.requires_grad_(False)
        w = base.weight
        a = torch.randn(rank, d_in, generator=generator(stable_seed("lora", seed, name)))
        if w.is_meta:
            a = a.to("meta")
        self.lora_a = nn.Parameter((a / math.sqrt(d_in)).to(device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = F.linear(F.linear(x, self.lora_a), self.lora_b)
        return self.base(x) + (delta if self.scaling == 1.0 else delta * self.scaling)


def _tied(model: nn.Module) -> set[int]:
    """ids of Parameters that more than one module holds (a tied head)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, c in seen.items() if c > 1}


def add_lora(model: nn.Module, rank: int = 4, *, alpha: float | None = None, seed: int = 0,
             targets=None) -> list[str]:  # fmt: skip
    """Freeze every parameter of `model` and wrap linear maps in LoRALinear, in place.

    targets(name, module) -> bool picks the modules to wrap; by default every nn.Linear and
    GPT-2 Conv1D whose weight is not tied to another module's (so not a head tied to the token
    embedding). Returns the wrapped modules' names; raises ValueError when none is found."""
    tied = _tied(model)
    for p in model.parameters():
        p.requires_grad_(False)

    def default(_name, m):
        try:
            _dims(m)
        except ValueError:
            return False
        return id(m.weight) not in tied

    pick = targets or default
    chosen = [(n, m) for n, m in model.named_modules() if n and pick(n, m)]
    if not chosen:
        raise fail("targets", targets, "a rule that picks at least one linear module")
    for name, m in chosen:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, leaf, LoRALinear(m, rank, alpha=alpha, seed=seed, name=name))
    return [n for n, _ in chosen]
