"""Fast mode, checked in lock-step against the reference (docs/design.md §2).

Comparing K-step trajectories is not a derivable check: errors feed back through the model, and
Adam's 1/sqrt(v) amplifies them near v ≈ 0. So every step starts the engine from the reference's
state (ZeroEngine.load_full_state), runs one step on the same data, and checks two things on each
rank's extent, each within a bound derived here (u_r, u: unit roundoffs of the reduction dtype
and of fp32; γ_k = k·u/(1-k·u); verify/checks/bounds.py):

1. The reduced gradient. Both the backend's order and the reference's tree are summation orders
   of the same M terms, so |R_fast - R_ref| <= 2·γ_{M-1}(u_r)·Σ_j|g_j| =: e_R (Higham eq. 4.4).

2. The optimizer step, from the same state, with the gradient error carried through:
     g0 = fp32(R)·c with c = s(1/(S·M)):   e_g0 = c·e_R + 2u·c·|R| + 2η   (one rounding each
     side; η = 2^-150 is the absolute error of a result among the subnormals, bounds.py)
     the norm of g0 moves by at most ‖e_g0‖₂ (triangle inequality; the float64 norm's own
     rounding is ~1e-15 relative, covered by a 1e-12 relative term)
     coef = s(clip / (norm + eps)):  Δcoef <= clip·Δnorm / ((norm - Δnorm + eps)(norm + eps)) + 2u
     (min(1, ·) is 1-Lipschitz, so the same holds where clipping is off on one side)
     g = g0·coef:                    e_g = coef·e_g0 + |g0|·Δcoef + 2u·|g| + 2η
   then verify/checks/bounds.optimizer_step_error propagates e_g through the optimizer's lines,
   charging
   each line the roundings of two implementations (torch's functional kernels vs the reference's
   op order), at each parameter's own step count, and on CUDA the fused kernel's float32
   scalars too ([Note: kernel scalars]: each unit is charged the kernel of the device its
   master lives on, so an offloaded unit gets the host's). A parameter that no micro-batch has a
   gradient for is skipped by both ([Note: unused parameters]): its bound is 0, bits. The new
   master and every optimizer state must lie within the resulting bounds.
   The working copy rounds both masters to the compute dtype: |fl(a) - fl(b)| <= (1+u_c)·|a-b|
   + 2·u_c·|b| + η, where η is the dtype's smallest subnormal (rounding near zero has an
   absolute error floor of η/2: 2^-25 in fp16, which a relative term cannot cover).

Each check reports its worst ratio diff/bound, with that element's measured error and bound;
a cell passes when every ratio is <= 1.
"""

from __future__ import annotations

import math

import numpy as np

from reference.precision import UNIT_ROUNDOFF, cast, f32
from reference.step import CLIP_EPS, used_names

from .bounds import ETA, gamma, kernel_for, optimizer_step_error
from .compare import to_numpy
from .expect import expected_extents
from .expect_hsdp import shard_world

U32 = UNIT_ROUNDOFF["fp32"]
ETA32 = ETA["fp32"]  # absolute rounding error of a float32 result among the subnormals
SMALLEST_SUBNORMAL = {"fp32": 2.0**-149, "bf16": 2.0**-133, "fp16": 2.0**-24}


def _flat(lay, arrays, n) -> np.ndarray:
    return lay.flatten({k: np.asarray(v, np.float64) for k, v in arrays.items()}, n, np.float64)


def _worst(diff: np.ndarray, bound: np.ndarray) -> tuple[float, float, float]:
    """(worst diff/bound, that element's diff, its bound); a zero bound admits only a zero
    difference."""
    if not diff.size:
        return 0.0, 0.0, 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(bound > 0, diff / bound, np.where(diff > 0, np.inf, 0.0))
    r = np.where(np.isnan(r), np.inf, r)  # a NaN difference is no agreement
    i = int(np.argmax(r))
    return float(r[i]), float(diff[i]), float(bound[i])


def _perturbed(ours: np.ndarray, bound: np.ndarray, factor: float) -> np.ndarray:
    """ours with factor·bound added at the element whose bound is largest ([Note: non-vacuity])."""
    if not factor or not ours.size:
        return ours
    out = ours.copy()
    i = int(np.argmax(bound))
    out[i] += factor * bound[i]
    return out


def qgz_errors(config, spec, rcfg, grads) -> dict:
    """Per parameter, what qgZ adds to e_R (item 1 with qgZ): its micro-step sums y_k are
    reference/zeropp.py's, each within b_k = qgz_error_bound of the exact sum of its N terms,
    and the engine sums the K = M/N of them in some order, so
        |R_q - R_ref| <= 2·γ_{M-1}·Σ_j|g_j| + (1 + γ_{K-1})·Σ_k b_k
    (|Σ_k y_k - Σ_j g_j| <= Σ_k b_k; the order of the y_k adds γ_{K-1}·Σ_k |y_k| <=
    γ_{K-1}·(Σ_j|g_j| + Σ_k b_k); the reference's own order γ_{M-1}·Σ_j|g_j|). Returns the
    second term; {} without qgZ. Units stage 3 keeps whole (persistent) have no qgZ."""
    if not getattr(config, "qgz_bits", None):
        return {}
    from reference.step import complete
    from reference.zeropp import qgz_error_bound

    from .expect_memory import persistent

    n, m = rcfg.world_size, rcfg.micro_batches
    full = [
        {k: cast(v, "fp32") for k, v in complete(g, spec, rcfg.precision).items()} for g in grads
    ]
    out = {}
    for lay in spec.layouts:
        if persistent(config, lay):
            continue
        total = np.zeros(lay.padded_numel(n))
        for k in range(m // n):
            xs = [lay.flatten(g, n, np.float32) for g in full[k * n : (k + 1) * n]]
            total += qgz_error_bound(
                xs, per_node=config.ranks_per_node, block=config.quant_block, bits=config.qgz_bits
            )
        total *= 1 + gamma(m // n - 1, U32)
        out.update({k: np.asarray(v) for k, v in lay.unflatten(total).items()})
    return out


def gradient_errors(spec, rcfg, before, info, grads, config=None):
    """(c, e_R, |g0|, e_g0, Δnorm) of one lock-step (items 1-2 of the module docstring): the
    unscaling constant, the reduced gradient's bound, the unscaled gradient's magnitude and
    bound per parameter, and the bound on the global norm's difference. config: the engine's
    ZeroConfig as the reference side reads it, for qgZ's term (qgz_errors)."""
    quantized = qgz_errors(config, spec, rcfg, grads)
    m = rcfg.micro_batches
    scale = 1.0 if before.scaler is None else before.scaler.scale
    c = float(f32(1.0 / (scale * m)))
    e_r, g0, e_g0 = {}, {}, {}
    u_r = UNIT_ROUNDOFF[rcfg.reduction]
    for name in spec.names:
        # a micro-batch without this parameter's gradient adds zeros ([Note: unused parameters])
        zero = np.zeros(spec.shapes[name])
        abs_sum = sum((np.abs(np.asarray(g[name], np.float64)) for g in grads if name in g), zero)
        e_r[name] = 2 * gamma(m - 1, u_r) * abs_sum + quantized.get(name, 0.0)
        abs_r = np.abs(np.asarray(info.reduced[name], np.float64))
        g0[name] = abs_r * c
        e_g0[name] = c * e_r[name] + 2 * U32 * c * abs_r + 2 * ETA32
    norm = float(info.norm)
    d_norm = math.sqrt(sum(float((e * e).sum()) for e in e_g0.values())) + 1e-12 * norm
    return c, e_r, g0, e_g0, d_norm


def clip_errors(rcfg, norm: float, d_norm: float) -> tuple[float, float]:
    """(coef, Δcoef): the clipping coefficient s(clip / (norm + eps)) and the bound on its
    difference (item 2 of the module docstring); (1, 0) without clipping."""
    if rcfg.clip_norm is None:
        return 1.0, 0.0
    coef = min(1.0, rcfg.clip_norm / (norm + CLIP_EPS))
    low = max(norm - d_norm, 0.0) + CLIP_EPS
    return coef, rcfg.clip_norm * d_norm / (low * (norm + CLIP_EPS)) + 2 * U32


def optimizer_errors(spec, rcfg, before, info, c: float, e_g: dict, used, kernel: str):
    """(err_p, err_state): bounds on the new master and on every optimizer state, per
    parameter, from the clipped gradient's bound e_g, against the fused kernel `kernel`. A
    parameter outside `used` is skipped by both: the engine must leave it exactly as it was."""
    err_p, err_state = {}, {}
    for name in spec.names:
        if name not in used:
            err_p[name] = np.zeros(spec.shapes[name])
            err_state[name] = {k: err_p[name] for k in before.opt[name]}
            continue
        hp = rcfg.groups[spec.group_of[name]]
        g_ref = (np.asarray(info.reduced[name], np.float32) * np.float32(c)).astype(np.float32)
        if info.clip_coef is not None:
            g_ref = g_ref * info.clip_coef
        err, _, _ = optimizer_step_error(
            rcfg.optimizer,
            hp,
            before.step_of(name) + 1,
            before.master[name],
            g_ref,
            before.opt[name],
            {"g": e_g[name]},
            kernel=kernel,
        )
        err_p[name] = err["p"]
        err_state[name] = {k: v for k, v in err.items() if k not in ("p", "g")}
    return err_p, err_state


def check_fast_step(
    eng, spec, rcfg, before, after, info, grads, *, detail=False, perturb=None
) -> dict:
    """Ratios diff/bound of this rank's extents after one lock-step (see the module docstring).

    detail: return {check: (ratio, error, bound)} at each check's worst element instead of
    {check: ratio}, so a report can print the measured error beside its bound.
    perturb: {check: factor} adds factor × the bound to the engine's value at one element
    before comparing. [Note: non-vacuity] A check that still passes with an error of 10× its
    bound proves nothing; tests inject exactly that and require the cell to fail.
    """
    perturb = perturb or {}
    n, rank = shard_world(eng.config, eng.world_size, eng.rank)  # HSDP: a world of G's shards
    c, e_r, g0, e_g0, d_norm = gradient_errors(spec, rcfg, before, info, grads, eng.config)
    coef, d_coef = clip_errors(rcfg, float(info.norm), d_norm)
    e_g = {  # the clipped gradient's bound
        k: coef * e_g0[k] + g0[k] * d_coef + 2 * U32 * g0[k] * coef + 2 * ETA32 for k in e_g0
    }
    used = used_names(grads, spec)
    # each unit's update ran where its master lives (offloaded: the host's kernel)
    kernels = {id(u): kernel_for(u.master.device) for u in eng.units}
    errors = {
        k: optimizer_errors(spec, rcfg, before, info, c, e_g, used, k)
        for k in sorted(set(kernels.values()))
    }

    worst = {k: (0.0, 0.0, 0.0) for k in ("reduced", "master", "optimizer", "working")}

    def note(key, ours, theirs, bound):
        got = _worst(np.abs(_perturbed(ours, bound, perturb.get(key, 0.0)) - theirs), bound)
        if got[0] >= worst[key][0]:
            worst[key] = got

    u_c = UNIT_ROUNDOFF[rcfg.precision]
    work_ref = {k: cast(v, rcfg.precision) for k, v in after.master.items()}
    stage, persist = eng.config.stage, eng.config.persist_below
    for u, held, lay in zip(eng.units, eng.last_reduced, spec.layouts, strict=True):
        err_p, err_state = errors[kernels[id(u)]]
        # the reference's layout and the stage's extents, not the engine's (verify/checks/expect.py)
        ext, held_ext = expected_extents(stage, persist, lay, rank, n)
        theirs = _flat(lay, info.reduced, n)[ext]
        note("reduced", to_numpy(held).astype(np.float64), theirs, _flat(lay, e_r, n)[ext])
        ours = to_numpy(u.master).astype(np.float64)
        note("master", ours, _flat(lay, after.master, n)[ext], _flat(lay, err_p, n)[ext])
        for x, t in u.opt.items():
            zeros = {s.name: np.zeros(s.shape) for s in lay.slots}
            want = _flat(lay, {k: after.opt[k].get(x, zeros[k]) for k in zeros}, n)[ext]
            bound = _flat(lay, {k: err_state[k].get(x, zeros[k]) for k in zeros}, n)[ext]
            note("optimizer", to_numpy(t).astype(np.float64), want, bound)
        resident, held = eng.working_extent(u)[0], held_ext
        full_p = _flat(lay, err_p, n)[held]
        master_abs = np.abs(_flat(lay, after.master, n))[held]
        bound = (1 + u_c) * full_p + 2 * u_c * master_abs + SMALLEST_SUBNORMAL[rcfg.precision]
        ours = to_numpy(resident).astype(np.float64)
        note("working", ours, _flat(lay, work_ref, n)[held], bound)
    if detail:
        return worst
    return {k: v[0] for k, v in worst.items()}
