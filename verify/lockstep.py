"""Fast mode, checked in lock-step against the reference (DESIGN.md §2).

Comparing K-step trajectories is not a derivable check: errors feed back through the model, and
Adam's 1/sqrt(v) amplifies them near v ≈ 0. So every step starts the engine from the reference's
state (ZeroEngine.load_full_state), runs one step on the same data, and checks two things on each
rank's extent, each within a bound derived here (u_r, u: unit roundoffs of the reduction dtype
and of fp32; γ_k = k·u/(1-k·u); verify/bounds.py):

1. The reduced gradient. Both the backend's order and the reference's tree are summation orders
   of the same M terms, so |R_fast - R_ref| <= 2·γ_{M-1}(u_r)·Σ_j|g_j| =: e_R (Higham eq. 4.4).

2. The optimizer step, from the same state, with the gradient error carried through:
     g0 = fp32(R)·c with c = s(1/(S·M)):   e_g0 = c·e_R + 2u·c·|R|   (one rounding each side)
     the norm of g0 moves by at most ‖e_g0‖₂ (triangle inequality; the float64 norm's own
     rounding is ~1e-15 relative, covered by a 1e-12 relative term)
     coef = s(clip / (norm + eps)):  Δcoef <= clip·Δnorm / ((norm - Δnorm + eps)(norm + eps)) + 2u
     (min(1, ·) is 1-Lipschitz, so the same holds where clipping is off on one side)
     g = g0·coef:                    e_g = coef·e_g0 + |g0|·Δcoef + 2u·|g|
   then verify/bounds.optimizer_step_error propagates e_g through the optimizer's lines, charging
   each line the roundings of two implementations (torch's functional kernels vs the reference's
   op order). The new master and every optimizer state must lie within the resulting bounds.
   The working copy rounds both masters to the compute dtype: |fl(a) - fl(b)| <= (1+u_c)·|a-b|
   + 2·u_c·|b| + η, where η is the dtype's smallest subnormal (rounding near zero has an
   absolute error floor of η/2: 2^-25 in fp16, which a relative term cannot cover).

Each check reports its worst ratio diff/bound; a cell passes when every ratio is <= 1.
"""

from __future__ import annotations

import math

import numpy as np

from reference.precision import UNIT_ROUNDOFF, cast, f32
from reference.step import CLIP_EPS

from .bounds import gamma, optimizer_step_error
from .compare import to_numpy

U32 = UNIT_ROUNDOFF["fp32"]
SMALLEST_SUBNORMAL = {"fp32": 2.0**-149, "bf16": 2.0**-133, "fp16": 2.0**-24}


def _flat(lay, arrays, n) -> np.ndarray:
    return lay.flatten({k: np.asarray(v, np.float64) for k, v in arrays.items()}, n, np.float64)


def _ratio(diff: np.ndarray, bound: np.ndarray) -> float:
    """Worst diff/bound; a zero bound admits only a zero difference."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(bound > 0, diff / bound, np.where(diff > 0, np.inf, 0.0))
    return float(r.max()) if r.size else 0.0


def check_fast_step(eng, spec, rcfg, before, after, info, grads) -> dict:
    """Ratios diff/bound of this rank's extents after one lock-step (see the module docstring)."""
    n, m = eng.world_size, rcfg.micro_batches
    scale = 1.0 if before.scaler is None else before.scaler.scale
    c = float(f32(1.0 / (scale * m)))
    e_r, abs_r, g0, e_g0 = {}, {}, {}, {}
    u_r = UNIT_ROUNDOFF[rcfg.reduction]
    for name in spec.names:
        abs_sum = sum(np.abs(np.asarray(g[name], np.float64)) for g in grads)
        e_r[name] = 2 * gamma(m - 1, u_r) * abs_sum
        abs_r[name] = np.abs(np.asarray(info.reduced[name], np.float64))
        g0[name] = abs_r[name] * c
        e_g0[name] = c * e_r[name] + 2 * U32 * c * abs_r[name]
    norm = float(info.norm)
    d_norm = math.sqrt(sum(float((e * e).sum()) for e in e_g0.values())) + 1e-12 * norm
    if rcfg.clip_norm is None:
        coef, d_coef = 1.0, 0.0
    else:
        coef = min(1.0, rcfg.clip_norm / (norm + CLIP_EPS))
        low = max(norm - d_norm, 0.0) + CLIP_EPS
        d_coef = rcfg.clip_norm * d_norm / (low * (norm + CLIP_EPS)) + 2 * U32
    err_p, err_state = {}, {}
    for name in spec.names:
        e_g = coef * e_g0[name] + g0[name] * d_coef + 2 * U32 * g0[name] * coef
        hp = rcfg.groups[spec.group_of[name]]
        g_ref = (np.asarray(info.reduced[name], np.float32) * np.float32(c)).astype(np.float32)
        if info.clip_coef is not None:
            g_ref = g_ref * info.clip_coef
        err, _, _ = optimizer_step_error(
            rcfg.optimizer,
            hp,
            before.t + 1,
            before.master[name],
            g_ref,
            before.opt[name],
            {"g": e_g},
        )
        err_p[name] = err["p"]
        err_state[name] = {k: v for k, v in err.items() if k not in ("p", "g")}

    ratios = {"reduced": 0.0, "master": 0.0, "optimizer": 0.0, "working": 0.0}
    u_c = UNIT_ROUNDOFF[rcfg.precision]
    work_ref = {k: cast(v, rcfg.precision) for k, v in after.master.items()}
    for u, held in zip(eng.units, eng.last_reduced, strict=True):
        lay, ext = u.part.layout, eng.impl.master_extent(u)
        ours = to_numpy(held).astype(np.float64)
        theirs = _flat(lay, info.reduced, n)[ext]
        ratios["reduced"] = max(
            ratios["reduced"], _ratio(np.abs(ours - theirs), _flat(lay, e_r, n)[ext])
        )
        bound_p = _flat(lay, err_p, n)[ext]
        diff = np.abs(to_numpy(u.master).astype(np.float64) - _flat(lay, after.master, n)[ext])
        ratios["master"] = max(ratios["master"], _ratio(diff, bound_p))
        for x, t in u.opt.items():
            zeros = {s.name: np.zeros(s.shape) for s in lay.slots}
            want = _flat(lay, {k: after.opt[k].get(x, zeros[k]) for k in zeros}, n)[ext]
            bound = _flat(lay, {k: err_state[k].get(x, zeros[k]) for k in zeros}, n)[ext]
            diff = np.abs(to_numpy(t).astype(np.float64) - want)
            ratios["optimizer"] = max(ratios["optimizer"], _ratio(diff, bound))
        resident, held = eng.impl.working_extent(u)
        full_p = _flat(lay, err_p, n)[held]
        master_abs = np.abs(_flat(lay, after.master, n))[held]
        diff = np.abs(to_numpy(resident).astype(np.float64) - _flat(lay, work_ref, n)[held])
        bound = (1 + u_c) * full_p + 2 * u_c * master_abs + SMALLEST_SUBNORMAL[rcfg.precision]
        ratios["working"] = max(ratios["working"], _ratio(diff, bound))
    return ratios
