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
"""

from __future__ import annotations

import math

import numpy as np

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11, "fp64": 2.0**-53}
LINE_ROUNDINGS = 5
IMPLEMENTATIONS = 2
ETA = {"fp32": 2.0**-150, "fp64": 2.0**-1075}  # half the smallest subnormal


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


def optimizer_step_error(kind, hp, t, p, g, state, err, *, u=UNIT_ROUNDOFF["fp32"]):
    """Propagate a bound on |A - B| through one optimizer step (reference/optim.py's math).

    p, g, state: float32 inputs of the step (one implementation's values, used as magnitudes).
    err: dict of elementwise error bounds on the inputs ("p", "g" and each state name); missing
    entries are 0. Returns (new err dict, new p, new state) with p and state advanced by the
    reference's exact sequence, so that the bound can be iterated along a trajectory.
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
    ep, eg, Gw = e["p"], e["g"], G
    if kind == "adamw" and wd:
        ep = (1 - lr * wd) * ep + c * P + a
    elif wd:
        eg, Gw = eg + wd * ep + c * (G + wd * P) + a, G + wd * P
    m0, v0 = np.abs(state["exp_avg"].astype(f)), state["exp_avg_sq"].astype(f)
    M = np.abs(new_state["exp_avg"].astype(f))
    V = new_state["exp_avg_sq"].astype(f)
    em = b1 * e["exp_avg"] + (1 - b1) * eg + c * (b1 * m0 + (1 - b1) * Gw) + a
    ev = b2 * e["exp_avg_sq"] + (1 - b2) * 2 * Gw * eg + c * (b2 * v0 + (1 - b2) * Gw * Gw) + a
    s2 = 1.0 / math.sqrt(1.0 - b2**t)
    root = np.sqrt(V)
    with np.errstate(divide="ignore", invalid="ignore"):
        esqrt = np.where(root > 0, np.minimum(ev / (2 * root), np.sqrt(ev)), np.sqrt(ev))
    D = root * s2 + hp.eps
    ed = s2 * esqrt + c * D
    Q = M / D
    with np.errstate(divide="ignore", invalid="ignore"):
        eq = np.where(D > ed, (em + Q * ed) / (D - ed), np.inf) + c * Q
    step = lr / (1.0 - b1**t)
    out.update(exp_avg=em, exp_avg_sq=ev)
    out["p"] = ep + step * eq + c * (np.abs(new_p.astype(f)) + step * Q) + a
    return out, new_p, new_state
