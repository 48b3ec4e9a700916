"""Derived error bounds: how far two correct implementations of the same math may drift apart.

Every tolerance in this project comes from here, never from tuning. Legend: u is the unit
roundoff of a dtype (2^-24 for fp32, 2^-8 bf16, 2^-11 fp16, 2^-53 float64); γ_k = k·u / (1 - k·u)
(Higham, "Accuracy and Stability of Numerical Algorithms", §3.1).

Summation. Any order of summing n terms x_i in a dtype with unit roundoff u satisfies
    |ŝ - s| <= γ_{n-1} · Σ|x_i|
(Higham, eq. 4.4). Two different orders therefore differ by at most 2·γ_{n-1}·Σ|x_i|, and an
order against the exact sum by γ_{n-1}·Σ|x_i|. Fast mode's reduced gradient is checked this way.

Optimizer steps (first-order running-error analysis). Each elementary float32 operation rounds
once with relative error <= u; a fused kernel (lerp, addcmul, addcdiv, FMA) rounds at most as
often as the unfused sequence; torch's CPU float32 sqrt may be one more ulp (2u) off. So each
line of the sequence in reference/optim.py ("m = m*b1 + g*(1-b1)", say) carries at most
LINE_ROUNDINGS = 5 roundings of the magnitudes it combines, in *each* of two implementations:
the bound for their difference charges 2·LINE_ROUNDINGS·u per line. Input differences propagate
through each line by its derivative, e.g. e_m' = b1·e_m + (1-b1)·e_g, and for the quotient
q = m/d, e_q <= (e_m + |q|·e_d) / (d - e_d). For sqrt, sqrt(v + e) - sqrt(v) <=
min(e / (2·sqrt(v)), sqrt(e)), which stays finite at v = 0. Magnitudes are taken from one of the
two trajectories (the reference's); the bound is first order in u, which is exact enough when
it is ~1e-6 relative (second-order terms are ~1e-12).

Underflow. The relative model fl(x op y) = (x op y)(1 + δ) fails where a result falls among
the subnormals: there the rounding error is absolute, at most half the smallest subnormal, η =
2^-150 in float32 (Higham §2.1: fl(x op y) = (x op y)(1 + δ) + η'). Gradients drawn down to the
subnormal range make g·g and m·b1 underflow, so every line is also charged
IMPLEMENTATIONS·LINE_ROUNDINGS·η absolutely (about 1.4e-44: nothing next to any normal value).

[Note: kernel scalars] The count above assumes each implementation holds every scalar of a step
(b1, 1 - b1, b2, 1 - b2, the step size lr/(1 - b1^t), 1/sqrt(1 - b2^t), eps) within one rounding
of its exact value, as the reference's s(...) does. The CPU's fused Adam/AdamW kernel and torch's
single-tensor Adam/AdamW (on any device) do. CUDA's fused Adam/AdamW does not: it rounds lr,
b1, b2, wd and eps to float32 first and computes the rest from those in float32
(docs/verification.md, "Fast mode on CUDA"):
  * 1 - b enters as 1 - fl32(b), exact from the rounded b but |fl32(b) - b| away from 1 - b:
    for b2 = 0.999 that is 1.3e-5 relative (216 u), because the subtraction cancels;
  * the bias corrections come from powf(fl32(b), t) in float32; powf is charged POW_ULPS ulp,
    and 1 - b^t cancels again (at t = 1, b2 = 0.999: a 4-ulp powf is 2.4e-4 relative of 1 - b2).
Such a difference cannot be folded into a per-line rounding count, so it is modelled explicitly:
`scalar_gaps` gives, per scalar, the worst relative distance of the kernel's value from the exact
one beyond the one rounding already charged, from intervals computed here; each line is charged
gap · coefficient · (magnitude + its error), which is exact, not first order. An older CUDA
kernel kept these scalars in float64 (one rounding at most, an extra one on the step size and on
sqrt(1 - b2^t)); the gaps take the larger of the two, so the bound covers both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11, "fp64": 2.0**-53}
LINE_ROUNDINGS = 5
IMPLEMENTATIONS = 2
ETA = {"fp32": 2.0**-150, "fp64": 2.0**-1075}  # half the smallest subnormal
POW_ULPS = 4
"""The largest error, in float32 ulps, the CUDA C++ Programming Guide lists for powf (its table of
maximum ulp errors of the single-precision standard functions). One ulp of x is at most 2u·|x|."""
KERNEL_SCALARS = ("rounded", "cuda_fused")
"""How an optimizer kernel holds its step's scalars ([Note: kernel scalars]): "rounded", each
within one rounding of exact (the reference, the CPU's fused kernel, torch's single-tensor
kernels); "cuda_fused", CUDA's fused Adam/AdamW."""


def gamma(k: int, u: float) -> float:
    """γ_k = k·u / (1 - k·u); requires k·u < 1."""
    if k * u >= 1:
        raise ValueError(f"gamma: k*u = {k * u} >= 1, the bound is void")
    return k * u / (1 - k * u)


def sum_bound(abs_sum: np.ndarray, n: int, dtype: str) -> np.ndarray:
    """Largest |ŝ - s| for any summation order of n terms with Σ|x_i| = abs_sum, elementwise."""
    return gamma(max(n - 1, 0), UNIT_ROUNDOFF[dtype]) * np.asarray(abs_sum, np.float64)


def _c(u: float) -> float:
    return IMPLEMENTATIONS * LINE_ROUNDINGS * u


@dataclass(frozen=True)
class ScalarGaps:
    """Per scalar of an Adam step: the worst relative distance of a kernel's value from the exact
    one, beyond the one rounding LINE_ROUNDINGS charges ([Note: kernel scalars]). 0 everywhere
    for a kernel that rounds each scalar once."""

    one_minus_b1: float = 0.0
    one_minus_b2: float = 0.0
    step_size: float = 0.0
    inv_sqrt_bc2: float = 0.0


def _f32(x: float) -> float:
    return float(np.float32(x))


def _bias_correction(b: float, t: int) -> tuple[float, float]:
    """[lo, hi] of CUDA's float32 1 - powf(fl32(b), t): powf within POW_ULPS ulp (2u·|x| each)
    of fl32(b)^t, which float64 computes to t·2^-52 relative, then one float32 rounding."""
    u = UNIT_ROUNDOFF["fp32"]
    power = _f32(b) ** t
    k = 2 * POW_ULPS * u + t * 2.0**-52
    lo, hi = (1 - power * (1 + k)) * (1 - u), (1 - power * (1 - k)) * (1 + u)
    if lo <= 0:
        raise ValueError(
            f"betas: b = {b!r} at step {t}: CUDA's fused kernel computes 1 - b^t in float32 from "
            "fl32(b), which may be 0 or below there; no bound can be derived (allowed: betas whose "
            "float32 rounding stays below 1 by more than powf's error)"
        )
    return lo, hi


def _relative_gap(exact: float, lo: float, hi: float) -> float:
    """Worst relative distance of [lo, hi] from exact, less the one rounding already charged."""
    u = UNIT_ROUNDOFF["fp32"]
    return max(0.0, max(hi - exact, exact - lo) / abs(exact) - u)


def scalar_gaps(kernel: str, hp, t: int) -> ScalarGaps:
    """The gaps of `kernel` ("rounded" or "cuda_fused", KERNEL_SCALARS) at step count t.

    cuda_fused, as torch's CUDA kernel computes in float32 (docs/verification.md, "Fast mode on
    CUDA"): m's gradient coefficient is 1 - fl32(b1) exactly (fma(-b1, g, g) rounds the product
    once, which the line's count holds), |b1 - fl32(b1)| from 1 - b1; likewise v's. The step size
    is fl(fl32(lr) / bc1) and the divisor fl(sqrt(bc2)), with bc1, bc2 in _bias_correction's
    intervals. The older kernel's float64 scalars are one rounding more on the step size and
    on sqrt(bc2): a gap of u each, which the larger of the two covers."""
    if kernel not in KERNEL_SCALARS:
        raise ValueError(f"kernel={kernel!r}: must be one of {KERNEL_SCALARS}")
    if kernel == "rounded":
        return ScalarGaps()
    u = UNIT_ROUNDOFF["fp32"]
    b1, b2 = hp.betas
    lr = hp.lr
    lo1, hi1 = _bias_correction(b1, t)
    exact_step = lr / (1.0 - b1**t)
    step = _relative_gap(exact_step, lr * (1 - u) ** 2 / hi1, lr * (1 + u) ** 2 / lo1)
    lo2, hi2 = _bias_correction(b2, t)
    exact_root = 1.0 / math.sqrt(1.0 - b2**t)
    root_lo = 1.0 / (math.sqrt(hi2) * (1 + u))
    root_hi = 1.0 / (math.sqrt(lo2) * (1 - u))
    return ScalarGaps(
        one_minus_b1=max(0.0, abs(b1 - _f32(b1)) / (1.0 - b1) - u),
        one_minus_b2=max(0.0, abs(b2 - _f32(b2)) / (1.0 - b2) - u),
        step_size=max(step, u),
        inv_sqrt_bc2=max(_relative_gap(exact_root, root_lo, root_hi), u),
    )


def kernel_for(device) -> str:
    """The KERNEL_SCALARS model of the fused Adam/AdamW that zero.optim.update.fast_step runs on a
    tensor of `device` (a torch.device or its type's name)."""
    return "cuda_fused" if getattr(device, "type", device) == "cuda" else "rounded"


def optimizer_step_error(
    kind, hp, t, p, g, state, err, *, u=UNIT_ROUNDOFF["fp32"], kernel: str = "rounded"
):
    """Propagate a bound on |A - B| through one optimizer step (reference/optim.py's math).

    p, g, state: float32 inputs of the step (one implementation's values, used as magnitudes).
    err: dict of elementwise error bounds on the inputs ("p", "g" and each state name); missing
    entries are 0. Returns (new err dict, new p, new state) with p and state advanced by the
    reference's exact sequence, so that the bound can be iterated along a trajectory.
    kernel: how the other implementation holds its scalars (KERNEL_SCALARS); Adam and AdamW
    lines are charged `scalar_gaps(kernel, hp, t)` on top ([Note: kernel scalars]).
    """
    from reference import optim

    f = np.float64
    P, G = np.abs(p.astype(f)), np.abs(g.astype(f))
    e = {k: np.asarray(err.get(k, 0.0), f) for k in ("p", "g", *state)}
    new_p, new_state = optim.step(kind, p, g, state, hp, t)
    c, lr, wd = _c(u), hp.lr, hp.weight_decay
    a = IMPLEMENTATIONS * LINE_ROUNDINGS * (ETA["fp32"] if u >= 2.0**-24 else ETA["fp64"])
    out = {}
    if kind == "sgd":
        eg = e["g"] + (wd * e["p"] + c * (G + wd * P) + a if wd else 0.0)
        Gw = G + wd * P
        h, eh = Gw, eg
        if hp.momentum:
            mom, keep = hp.momentum, 1.0 - hp.dampening
            B = np.abs(new_state["momentum_buffer"].astype(f))
            if t == 1:
                eb = eg
            else:
                prev = np.abs(state["momentum_buffer"].astype(f))
                eb = mom * e["momentum_buffer"] + keep * eg + c * (mom * prev + keep * Gw) + a
            out["momentum_buffer"] = eb
            h, eh = (
                (Gw + mom * B, eg + mom * eb + c * (Gw + mom * B) + a) if hp.nesterov else (B, eb)
            )
        out["p"] = e["p"] + lr * eh + c * (np.abs(new_p.astype(f)) + lr * h) + a
        return out, new_p, new_state

    b1, b2 = hp.betas
    gap = scalar_gaps(kernel, hp, t)
    ep, eg, Gw = e["p"], e["g"], G
    if kind == "adamw" and wd:
        ep = (1 - lr * wd) * ep + c * P + a
    elif wd:
        eg, Gw = eg + wd * ep + c * (G + wd * P) + a, G + wd * P
    m0, v0 = np.abs(state["exp_avg"].astype(f)), state["exp_avg_sq"].astype(f)
    M = np.abs(new_state["exp_avg"].astype(f))
    V = new_state["exp_avg_sq"].astype(f)
    Gb = Gw + eg  # the other trajectory's magnitude, for its roundings
    em = b1 * e["exp_avg"] + (1 - b1) * eg + c * (b1 * m0 + (1 - b1) * Gb) + a
    em = em + gap.one_minus_b1 * (1 - b1) * (Gw + eg)
    # |g_A² - g_B²| = |g_A - g_B|·|g_A + g_B| <= eg·(2·Gw + eg): exact, not first order, for
    # an input error that is not small (qgZ's quantized gradient: verify/checks/lockstep.py)
    ev = (
        b2 * e["exp_avg_sq"]
        + (1 - b2) * (2 * Gw + eg) * eg
        + c * (b2 * v0 + (1 - b2) * Gb * Gb)
        + a
    )
    ev = ev + gap.one_minus_b2 * (1 - b2) * (Gw + eg) ** 2
    s2 = 1.0 / math.sqrt(1.0 - b2**t)
    root = np.sqrt(V)
    with np.errstate(divide="ignore", invalid="ignore"):
        esqrt = np.where(root > 0, np.minimum(ev / (2 * root), np.sqrt(ev)), np.sqrt(ev))
    D = root * s2 + hp.eps
    ed = s2 * esqrt + c * D + gap.inv_sqrt_bc2 * s2 * (root + esqrt)
    Q = M / D
    with np.errstate(divide="ignore", invalid="ignore"):
        eq = np.where(D > ed, (em + Q * ed) / (D - ed), np.inf) + c * Q
    step = lr / (1.0 - b1**t)
    out.update(exp_avg=em, exp_avg_sq=ev)
    # |S_A·q_A - S_B·q_B| <= S·|q_A - q_B|·(1 + gap) + gap·S·|q|, S_A = S_B·(1 ± gap)
    moved = step * eq * (1 + gap.step_size) + gap.step_size * step * Q
    out["p"] = ep + moved + c * (np.abs(new_p.astype(f)) + step * Q) + a
    return out, new_p, new_state
