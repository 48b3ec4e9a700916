"""Mixed precision: dtypes, round-to-nearest-even casts, and the dynamic loss scaler.

Legend:
    compute dtype    the working copy's and the gradients' dtype: fp32, bf16 or fp16
    reduction dtype  the dtype gradients are summed in: fp32 (default) or the compute dtype
    S                the loss scale (1 without fp16)

NumPy has no bfloat16; ml_dtypes supplies one whose casts round to nearest, ties to even, like
torch's. NaN payloads differ between libraries, so tests compare NaN-ness, not NaN bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

DTYPES = {
    "fp32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp16": np.dtype(np.float16),
}
# Unit roundoff u = 2^-p of each dtype, p the significand precision in bits (implicit bit included).
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
# Integer views with the same width, for bitwise comparison.
BITS = {"fp32": np.uint32, "bf16": np.uint16, "fp16": np.uint16}


def dtype_name(dtype) -> str:
    """The short name ('fp32', 'bf16', 'fp16') of a NumPy dtype."""
    for name, dt in DTYPES.items():
        if np.dtype(dtype) == dt:
            return name
    raise ValueError(f"dtype={dtype!r}: allowed are {sorted(DTYPES)}")


def cast(x: np.ndarray, name: str) -> np.ndarray:
    """Round x to dtype `name` (nearest, ties to even); the identity when it already has it."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: allowed are {sorted(DTYPES)}")
    with np.errstate(over="ignore"):  # overflow to ±inf is the cast's defined result
        return np.asarray(x).astype(DTYPES[name])


def bits(x: np.ndarray) -> np.ndarray:
    """The raw bits of a float array, as unsigned integers of the same width."""
    return np.ascontiguousarray(x).view(BITS[dtype_name(x.dtype)])


def f32(x: float) -> np.float32:
    """A scalar computed in float64 (Python float), rounded once to float32 (docs/design.md §2)."""
    return np.float32(x)


@dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """Dynamic loss scaling for fp16 (Micikevicius et al., 2018)."""

    init_scale: float = 2.0**16
    """Scale of the first step."""
    backoff: float = 0.5
    """Factor applied on overflow."""
    growth: float = 2.0
    """Factor applied after growth_interval consecutive clean steps."""
    growth_interval: int = 2000
    """Clean steps before the scale grows."""
    min_scale: float = 1.0
    """Floor: the scale never drops below it."""

    def __post_init__(self):
        def real(name: str) -> bool:  # a finite real number: inf would skip every step forever
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for field in ("init_scale", "min_scale"):
            if not (real(field) and getattr(self, field) > 0):
                raise ValueError(f"{field}={getattr(self, field)!r}: must be a finite number > 0")
        if not (real("backoff") and 0 < self.backoff < 1):
            raise ValueError(f"backoff={self.backoff!r}: must be a number in (0, 1)")
        if not (real("growth") and self.growth > 1):
            raise ValueError(f"growth={self.growth!r}: must be a finite number > 1")
        gi = self.growth_interval
        if isinstance(gi, bool) or not isinstance(gi, int) or gi < 1:
            raise ValueError(f"growth_interval={gi!r}: must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class ScalerState:
    scale: float
    clean_steps: int = 0  # consecutive steps without overflow since the last change


def scaler_init(cfg: ScalerConfig) -> ScalerState:
    return ScalerState(scale=max(cfg.init_scale, cfg.min_scale))


def scaler_update(state: ScalerState, overflow: bool, cfg: ScalerConfig) -> ScalerState:
    """The scaler's state machine, applied once per step after the overflow decision.

    overflow: scale <- max(scale * backoff, min_scale), counter <- 0 (the step is skipped).
    clean:    counter <- counter + 1; when it reaches growth_interval, scale <- scale * growth
              and counter <- 0.
    """
    if overflow:
        return ScalerState(scale=max(state.scale * cfg.backoff, cfg.min_scale), clean_steps=0)
    if state.clean_steps + 1 >= cfg.growth_interval:
        return ScalerState(scale=state.scale * cfg.growth, clean_steps=0)
    return replace(state, clean_steps=state.clean_steps + 1)
