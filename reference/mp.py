"""One step of a model split over N_m model-parallel ranks: reference/step.py on every slice.

Legend (docs/design.md §6): slices m = 0 .. N_m - 1, each with its own ModelSpec (the slice's
units: the same names, split shapes); grads[m][j] micro-batch j's gradient on slice m (the
MP-sliced model's backward); counts(name, m) whether slice m's copy of `name` enters the
clipping norm (a split parameter on every m, a replicated one on m = 0 only).

The step is reference/step.py's on each slice (R, unscaling, the optimizer are elementwise or
per element, so a slice updates alone), with three things taken over all slices:
  - overflow: any non-finite value in any slice's g_j or R (one slice can overflow alone); the
    step is then skipped on every slice;
  - used: a parameter is used when any micro-batch of any slice has a gradient for it;
  - the norm: s_m = T(chunk partials of slice m's g, the parameters m does not count as zeros),
    ‖g‖ = sqrt(T(s_0, ..., s_{N_m-1})) (reference/tree.py's mp_norm), one clip coefficient.
At N_m = 1 this is train_step exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .step import (
    Grads,
    ModelSpec,
    StepConfig,
    StepInfo,
    TrainState,
    clip_coefficient,
    norm_partials,
    reduce_and_unscale,
    skip_step,
    update,
)
from .tree import mp_norm


def mp_train_step(
    states: Sequence[TrainState],
    grads: Sequence[Sequence[Grads]],
    specs: Sequence[ModelSpec],
    cfg: StepConfig,
    counts: Callable[[str, int], bool],
) -> tuple[list[TrainState], StepInfo]:
    """One step of every slice; returns the slices' new states and slice 0's StepInfo with
    the whole model's norm (cfg.world_size is N_d, the DP degree)."""
    n = len(specs)
    for what, xs in (("states", states), ("grads", grads)):
        if len(xs) != n:
            raise ValueError(f"{what}: {len(xs)} slices; specs has N_m = {n}")
    if n == 0:
        raise ValueError("specs: empty; a model has at least one slice")
    parts = [reduce_and_unscale(s, g, sp, cfg) for s, g, sp in zip(states, grads, specs)]
    used = set().union(*(p[0] for p in parts))
    scale = parts[0][3]
    if any(p[2] for p in parts):
        out = [skip_step(s, cfg, p[1], scale) for s, p in zip(states, parts)]
        return [o[0] for o in out], out[0][1]
    per_slice = []
    for m, (p, spec) in enumerate(zip(parts, specs)):
        g = {k: (x if counts(k, m) else np.zeros_like(x)) for k, x in p[4].items()}
        per_slice.append(norm_partials(g, spec))
    norm = mp_norm(per_slice)
    coef = clip_coefficient(norm, cfg.clip_norm)
    new = [update(s, p[4], used, sp, cfg, coef) for s, p, sp in zip(states, parts, specs)]
    info = StepInfo(
        overflow=False, skipped=False, scale=scale, norm=norm, clip_coef=coef, reduced=parts[0][1]
    )
    return new, info
