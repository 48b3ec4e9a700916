"""A model with a branch that whole steps skip: unused parameters ([Note: unused parameters]).

`BranchMLP` is the verification MLP plus a side branch (`side`, one Linear layer, its own unit)
whose output is added only when the micro-batch's flag says so. The data sets the flag:
  branch_microbatches  on even data steps micro-batches j with j % 2 == 0 use the branch (so
                       at N >= 2 some ranks have no gradient for it: zeros there, as DDP
                       reduces them), on odd data steps none does;
  skip_microbatches    every micro-batch of an even data step uses it, none of an odd one (the
                       ranks agree, as stage 3 needs: docs/models.md).
On odd data steps the branch's parameters are unused: the optimizer skips them, as torch.optim skips
a parameter whose .grad is None, and their step count falls behind t. At stage 3 the side unit is
then never gathered nor run in that step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zero.workloads.models import MLP, MLPConfig, mlp_microbatches, stable_seed


class BranchMLP(nn.Module):
    """MLP(cfg) with `side`: out = mlp(x) (+ side(x) where the batch's flag is set)."""

    def __init__(self, cfg: MLPConfig | None = None, *, seed: int = 0):
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else MLPConfig()
        self.mlp = MLP(cfg, seed=seed)
        self.side = nn.Linear(cfg.d_in, cfg.d_out)
        g = torch.Generator().manual_seed(stable_seed("branch-side", seed))
        with torch.no_grad():  # values from the seed alone: the same in every process
            self.side.weight.copy_(0.25 * torch.randn(self.side.weight.shape, generator=g))
            self.side.bias.copy_(0.25 * torch.randn(self.side.bias.shape, generator=g))

    def unit_names(self) -> list[str]:
        return [f"mlp.{u}" for u in self.mlp.unit_names()] + ["side"]

    def forward(self, x, targets=None, use_side=None):
        out, _ = self.mlp(x)
        if use_side is not None and bool(use_side):
            out = out + self.side(x)
        loss = None if targets is None else F.mse_loss(out, targets)
        return out, loss


def uses_side(data_step: int, j: int, *, every_rank: bool = False) -> bool:
    """Whether micro-batch j of data step `data_step` runs the side branch."""
    return data_step % 2 == 0 and (every_rank or j % 2 == 0)


def branch_microbatches(
    cfg: MLPConfig, *, seed: int, data_step: int, count: int, batch_size: int, every_rank=False
):
    """mlp_microbatches with each micro-batch's branch flag (a bool tensor) appended."""
    batches = mlp_microbatches(
        cfg, seed=seed, data_step=data_step, count=count, batch_size=batch_size
    )
    return [
        (x, y, torch.tensor(uses_side(data_step, j, every_rank=every_rank)))
        for j, (x, y) in enumerate(batches)
    ]


def skip_microbatches(cfg: MLPConfig, **kw):
    """branch_microbatches where every micro-batch of a step agrees (whole steps skip)."""
    return branch_microbatches(cfg, **kw, every_rank=True)
