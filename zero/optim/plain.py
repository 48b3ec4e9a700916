"""torch.optim's own optimizers with this project's hyper-parameters (reference.optim.Hyper):
what a consolidated checkpoint's optimizer state is for (zero/checkpoint/consolidate.py), what
plain-PyTorch comparisons build, and the keyword arguments the fast SGD path hands torch's
single-tensor kernel (zero/optim/update.py). The engine's own update never builds one.
"""

from __future__ import annotations

import torch

from reference.optim import Hyper

TORCH_OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}  # torch.optim class names


def torch_kwargs(kind: str, hp) -> dict:
    """torch.optim's constructor arguments for one group with hyper-parameters `hp` (a Hyper,
    or its dict form as a checkpoint stores it). Every argument is spelled out, because
    torch's defaults are not ours (its AdamW decays by 0.01 unless told otherwise)."""
    get = hp.get if isinstance(hp, dict) else lambda k: getattr(hp, k)
    if kind == "sgd":
        keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    else:
        keys = ("lr", "betas", "eps", "weight_decay")
    return {k: tuple(get(k)) if k == "betas" else get(k) for k in keys}


def torch_optimizer(kind: str, groups: list[tuple[list, Hyper]], **options):
    """A torch.optim optimizer of `kind` over (params, hyper-parameters) groups; `options`
    go to its constructor (e.g. foreach=False for the single-tensor kernel)."""
    cls = getattr(torch.optim, TORCH_OPTIMIZERS[kind])
    return cls([{"params": ps, **torch_kwargs(kind, hp)} for ps, hp in groups], **options)
