"""The engine's model-parallel part: what a step takes over the MP group besides ZeRO's DP step.

Legend (docs/design.md §6): N_d, N_m, rank (d, m); s_m slice m's float64 sum of squares of the
unscaled gradient g (its DP chunk partials summed by T); ‖g‖ the whole model's norm.

``ZeroEngine(model, config, group=groups.dp_group, mp=ctx)`` runs every stage unchanged inside
its DP group on the rank's slice (ctx: the MPContext the TPGPT was built with; its counter
becomes the engine's, so the MP collectives are counted beside ZeRO's, kind "mp"). This adds:
  - the norm mask: at m > 0 the parameters the model says m does not count (a TPGPT's
    replicated ones, ``counts_in_norm``) enter no chunk partial, so Σ_m s_m counts every
    element of the model once;
  - [Note: MP control exchange] after the DP group's exchange (zero/control.py), one small
    all-gather over the MP group of (overflow, s_m, used flags), float64, counted as control
    traffic (phase "mp_step"): overflow and used are the maximum over the group (one slice can
    overflow alone), ‖g‖ = sqrt(T(s_0, ..., s_{N_m-1})) in m order (reference/mp.py). The loss
    needs nothing: every MP rank computes the same value, so the DP mean is the step's.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from reference.tree import tree_sum

from ..collectives import to_device
from ..control import Exchanged, StepControl, gather_control, tree_total
from .tp_comm import MPContext


class MPStep:
    """One engine's model-parallel side: its MPContext, the norm rule and the exchange."""

    def __init__(self, module: nn.Module, mp: MPContext, config):
        if not isinstance(mp, MPContext):
            raise ValueError(f"mp={mp!r}: must be a zero.mp.MPContext (or None)")
        others = {id(x) for x in module.modules() if isinstance(getattr(x, "mp", None), MPContext)}
        if not others or others != {
            id(x) for x in module.modules() if getattr(x, "mp", None) is mp
        }:
            raise ValueError(
                "mp: the module's tensor-parallel layers must hold this same MPContext (the one "
                "the model was built with), or their collectives would go to another counter"
            )
        if mp.deterministic != config.deterministic:
            raise ValueError(
                f"mp.deterministic={mp.deterministic}: must equal config.deterministic="
                f"{config.deterministic} (a fast MP sum would break the deterministic step)"
            )
        rule = getattr(module, "counts_in_norm", None)
        if not callable(rule):
            raise ValueError(
                f"mp: {type(module).__name__} has no counts_in_norm(name) method saying which "
                "parameters this MP rank counts in the global norm (zero.mp.TPGPT has one)"
            )
        self.ctx, self.rule, self._keep, self._placed = mp, rule, None, {}

    @property
    def counter(self):
        return self.ctx.counter

    def keep(self, units, devices) -> list[torch.Tensor | None] | None:
        """Per unit, the mask of this rank's extent that enters the norm (None: all of it), on
        the device of that unit's gradient; moved there once, not in every step (on CUDA a
        copy from the host waits for the device)."""
        if self._keep is None:
            self._keep = [self._unit_keep(u) for u in units]
        key = tuple(devices)
        if key not in self._placed:
            placed = [None if k is None else k.to(d) for k, d in zip(self._keep, key, strict=True)]
            self._placed[key] = placed
        return self._placed[key]

    def _unit_keep(self, u) -> torch.Tensor | None:
        dropped = [s for s in u.part.layout.slots if not self.rule(s.name)]
        if not dropped:
            return None
        mask = torch.ones(u.part.padded_numel, dtype=torch.bool)
        for s in dropped:
            mask[s.offset : s.offset + s.numel] = False
        return mask[u.part.own].clone()

    def combine(self, got: Exchanged, device) -> StepControl:
        """[Note: MP control exchange] What the DP group agreed (`got`), over the whole mesh:
        overflow and used from every MP rank, the norm from every slice's s_m; the loss as the
        DP group's mean, and overflow_here as this rank's."""
        flags = [float(x) for us in got.used for x in us]
        s_m = tree_total(np.concatenate(got.partials) if got.partials else np.zeros(0))
        row = torch.tensor([float(got.overflow), float(s_m), *flags], dtype=torch.float64)
        every = gather_control(
            to_device(row, device), group=self.ctx.group, counter=self.counter, phase="mp_step"
        )
        every = every.cpu().numpy().copy()  # this exchange's one read
        every[self.ctx.rank] = row.numpy()  # a fake process group leaves the rows unwritten
        total = tree_sum([np.float64(x) for x in every[:, 1]])  # N_m values
        seen = [bool(x) for x in every[:, 2:].max(axis=0, initial=0.0) > 0]
        out, at = [], 0
        for us in got.used:
            out.append(seen[at : at + len(us)])
            at += len(us)
        return StepControl(
            overflow=bool(every[:, 0].max() > 0),
            overflow_here=got.overflow_here,
            loss=got.loss,
            norm=np.sqrt(total).astype(np.float64),
            used=out,
        )
