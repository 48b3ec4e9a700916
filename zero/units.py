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


class CalledCheck:
    """Watches which units' forward runs, and refuses a unit whose parameters got a gradient
    in a backward although its forward never ran: its hooks (stage 3's gather, the activation
    checkpoint) never fired, so its parameters were used through its submodules or directly
    (docs/models.md). A unit is watched until its forward is seen once; a unit a backward
    did not use at all (a branch that step skips) is simply not judged yet."""

    def __init__(self, names: list[str], modules: dict[str, nn.Module]):
        self.names, self.called = [n for n in names if n], set()
        self.hooks = {
            n: modules[n].register_forward_pre_hook(lambda _m, _a, n=n: self.called.add(n))
            for n in self.names
        }

    def stop(self) -> None:
        """Remove the hooks still watching (the engine is gone)."""
        while self.hooks:
            self.hooks.popitem()[1].remove()

    def check(self, used: set[str]) -> None:
        """At the end of a backward; `used`: the units some of whose parameters had a
        gradient in it."""
        for n in [n for n in self.hooks if n in self.called]:
            self.hooks.pop(n).remove()  # seen called: stop watching
        missing = [n for n in self.names if n in self.hooks and n in used]
        if missing:
            raise ValueError(
                f"units: the forward of unit {missing[0]!r} was never called, yet its "
                "parameters got gradients (they were used through its submodules or "
                "directly); a unit must be a module that is called: name the modules that are "
                "called, or pass units='auto'"
            )
