"""SGD, Adam and AdamW as explicit sequences of float32 operations (docs/design.md §2).

Legend:
    p, g    a parameter (fp32 master) and its gradient (fp32, unscaled, averaged, clipped)
    t       the optimizer's step count *after* this step (1 on the first step); skipped steps
            do not advance it, so it drives Adam's bias correction
    m, v    Adam's first and second moments ("exp_avg", "exp_avg_sq", torch's names)
    buf     SGD's momentum buffer ("momentum_buffer")

[Note: op-ordered optimizers] Every function below is elementwise, so applying it to a whole
parameter, to a slice of it, or to a flat shard that holds pieces of many parameters gives the
same bits, which is what lets ZeRO partition the optimizer without changing the result. The
operations are restricted to what means the same thing on NumPy, CPU torch and CUDA torch:
  * tensor-tensor add, subtract, multiply and divide, each correctly rounded in float32;
  * tensor times a float32 scalar; never a division by a scalar (CUDA computes a/b as a*(1/b)),
    so every scalar divisor becomes a float32 reciprocal computed here;
  * a correctly rounded sqrt (torch's float32 CPU sqrt is not; the engine goes through float64);
  * no fused multiply-add, no lerp/addcmul/addcdiv, no `alpha=` arguments.
Each scalar is computed once per step in float64 and rounded once to float32 (`step_scalars`).
The sequence, with "*" a float32 multiply and s(...) a float32 scalar:
  SGD   if wd:        g = g + s(wd) * p
        if momentum:  buf = g (first step) | buf = buf * s(mom) + g * s(1 - dampening)
                      g = g + s(mom) * buf (Nesterov) | g = buf
        p = p - s(lr) * g
  Adam  if wd:        g = g + s(wd) * p                        (L2, coupled)
  AdamW               p = p * s(1 - lr*wd)                     (decoupled, before the moments)
  both  m = m * s(b1) + g * s(1 - b1)
        v = v * s(b2) + (g * g) * s(1 - b2)
        d = sqrt(v) * s(1 / sqrt(1 - b2^t)) + s(eps)
        p = p - s(lr / (1 - b1^t)) * (m / d)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .precision import f32

KINDS = ("sgd", "adam", "adamw")


@dataclass(frozen=True, kw_only=True)
class Hyper:
    """One parameter group's hyper-parameters (each group may differ, e.g. no decay on norms)."""

    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """L2 penalty (SGD, Adam) or decoupled decay (AdamW)."""
    momentum: float = 0.0
    """SGD momentum."""
    dampening: float = 0.0
    """SGD dampening of the new gradient in the momentum buffer."""
    nesterov: bool = False
    """SGD Nesterov momentum (needs momentum > 0 and dampening == 0, as in torch.optim)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (b1, b2)."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""

    def __post_init__(self):
        def real(name: str) -> bool:  # a finite real number (not a bool, not a string)
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        b = self.betas
        checks = {
            "lr": real("lr") and self.lr >= 0,
            "weight_decay": real("weight_decay") and self.weight_decay >= 0,
            "momentum": real("momentum") and self.momentum >= 0,
            "dampening": real("dampening") and 0 <= self.dampening <= 1,
            "eps": real("eps") and self.eps > 0,
            "betas": isinstance(b, (tuple, list))
            and len(b) == 2
            and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in b
            ),
            "nesterov": isinstance(self.nesterov, bool),
        }
        allowed = {
            "lr": "a finite number >= 0",
            "weight_decay": "a finite number >= 0",
            "momentum": "a finite number >= 0",
            "dampening": "a number in [0, 1]",
            "eps": "a finite number > 0",
            "betas": "two numbers in [0, 1)",
            "nesterov": "True or False",
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r}: must be {allowed[field]}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov=True with momentum={self.momentum}, dampening={self.dampening}: "
                "Nesterov needs momentum > 0 and dampening == 0"
            )


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"optimizer={kind!r}: allowed are {KINDS}")


def state_names(kind: str, hp: Hyper) -> tuple[str, ...]:
    """Names of the per-element fp32 state arrays the optimizer keeps."""
    check_kind(kind)
    if kind == "sgd":
        return ("momentum_buffer",) if hp.momentum else ()
    return ("exp_avg", "exp_avg_sq")


def init_state(kind: str, hp: Hyper, shape) -> dict[str, np.ndarray]:
    """Zero-initialised state (SGD's buffer is overwritten with g on the first step)."""
    return {name: np.zeros(shape, np.float32) for name in state_names(kind, hp)}


def step_scalars(kind: str, hp: Hyper, t: int) -> dict[str, np.float32]:
    """Every scalar of step t, computed in float64 and rounded once to float32."""
    check_kind(kind)
    if t < 1:
        raise ValueError(f"t={t}: the step count after this step must be >= 1")
    s = {"lr": f32(hp.lr), "wd": f32(hp.weight_decay)}
    if kind == "sgd":
        s.update(mom=f32(hp.momentum), one_minus_damp=f32(1.0 - hp.dampening))
        return s
    b1, b2 = hp.betas
    s.update(
        b1=f32(b1),
        one_minus_b1=f32(1.0 - b1),
        b2=f32(b2),
        one_minus_b2=f32(1.0 - b2),
        step_size=f32(hp.lr / (1.0 - b1**t)),
        inv_sqrt_bc2=f32(1.0 / math.sqrt(1.0 - b2**t)),
        eps=f32(hp.eps),
        decay=f32(1.0 - hp.lr * hp.weight_decay),
    )
    return s


def step(
    kind: str, p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray], hp: Hyper, t: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One optimizer step on float32 arrays; returns (new p, new state). Inputs are unchanged.

    The exact operation order is [Note: op-ordered optimizers] above; t is the step count after
    this step (1-based).
    """
    assert p.dtype == np.float32 and g.dtype == np.float32, (p.dtype, g.dtype)
    s = step_scalars(kind, hp, t)
    if kind == "sgd":
        return _sgd(p, g, state, hp, s, t)
    if kind == "adamw":
        if hp.weight_decay:
            p = p * s["decay"]
    elif hp.weight_decay:
        g = g + s["wd"] * p
    m = state["exp_avg"] * s["b1"] + g * s["one_minus_b1"]
    v = state["exp_avg_sq"] * s["b2"] + (g * g) * s["one_minus_b2"]
    d = np.sqrt(v) * s["inv_sqrt_bc2"] + s["eps"]
    p = p - s["step_size"] * (m / d)
    return p, {"exp_avg": m, "exp_avg_sq": v}


def _sgd(p, g, state, hp, s, t):
    if hp.weight_decay:
        g = g + s["wd"] * p
    new_state = {}
    if hp.momentum:
        if t == 1:
            buf = g.copy()
        else:
            buf = state["momentum_buffer"] * s["mom"] + g * s["one_minus_damp"]
        g = g + s["mom"] * buf if hp.nesterov else buf
        new_state["momentum_buffer"] = buf
    return p - s["lr"] * g, new_state
