"""Comparisons: bitwise, in ULPs, and against a bound. Every verdict compares bits or a bound.

ULP distance: floats of one sign map to integers monotonically by their bit patterns, so with
signed-magnitude bits turned into two's-complement order (negative x -> -(bits & 0x7fff...)),
the integer difference of two floats is how many representable values lie between them.
"""

from __future__ import annotations

import numpy as np
import torch

from reference.precision import BITS, dtype_name


def to_numpy(t) -> np.ndarray:
    """A torch tensor (any of fp32/bf16/fp16) or array as NumPy, with the same bits."""
    if isinstance(t, np.ndarray):
        return t
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def ordered(x: np.ndarray) -> np.ndarray:
    """Bits as integers in the floats' numeric order (see the module docstring)."""
    width = BITS[dtype_name(x.dtype)]
    b = np.ascontiguousarray(x).view(width).astype(np.int64)
    sign = 1 << (8 * np.dtype(width).itemsize - 1)
    return np.where(b & sign, -(b & (sign - 1)), b)


def bitwise_equal(a, b, *, nan_equal: bool = False) -> bool:
    """Same shape, dtype and bits. nan_equal: a NaN matches any NaN, whatever its payload
    (torch and NumPy/ml_dtypes make different NaN bits, docs/machine_notes.md); every other value,
    signed zeros and infinities included, must still match bit for bit."""
    a, b = to_numpy(a), to_numpy(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = BITS[dtype_name(a.dtype)]
    same = np.ascontiguousarray(a).view(width) == np.ascontiguousarray(b).view(width)
    if nan_equal:
        with np.errstate(invalid="ignore"):
            same |= np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return bool(same.all())


def max_ulp(a, b) -> int:
    """Largest ULP distance between corresponding elements (0 when bitwise equal)."""
    a, b = to_numpy(a), to_numpy(b)
    if a.size == 0:
        return 0
    return int(np.max(np.abs(ordered(a) - ordered(b))))


def max_abs_diff(a, b) -> float:
    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    return float(np.nanmax(d)) if not np.isnan(d).all() else float("nan")
