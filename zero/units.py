"""Choosing units: `auto(model)` names the repeated blocks of common model structures.

    ZeroConfig(units="auto")               # the engine calls auto(model)
    ZeroConfig(units=tuple(auto(model)))   # the same, spelled out

Legend (docs/design.md §3, docs/models.md): a unit is a submodule whose parameters are flattened,
reduced and (stage 3) gathered together; it must be a module that is called in forward, so a
container (nn.ModuleList, nn.ModuleDict) is never a unit, its children are.
"""

from __future__ import annotations

from torch import nn


def auto(model: nn.Module) -> list[str]:
    """The children of the largest nn.ModuleList or nn.Sequential whose children (at least two)
    are all of one class: transformer blocks, residual stages, MLP layers. Largest by
    parameters, then by children; ties go to the first in module order. [] when there is none
    (everything is then the root unit)."""
    best, best_key = None, (0, 0)
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList | nn.Sequential):
            continue
        kids = list(mod.named_children())
        if len(kids) < 2 or len({type(m) for _, m in kids}) != 1:
            continue
        key = (sum(p.numel() for _, m in kids for p in m.parameters()), len(kids))
        if key[0] and key > best_key:
            best, best_key = [f"{name}.{k}" if name else k for k, _ in kids], key
    return best or []
