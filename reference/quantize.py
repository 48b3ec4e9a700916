"""Block quantization as ZeRO++ uses it (Wang et al., "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training", arXiv 2306.10209): symmetric, one fp32 scale per block,
int8 or int4 values; and the worst-case error it makes, alone and through a sum.

Legend:
    x       a flat float32 vector, cut into blocks of B elements (the last may be shorter)
    b       bits per value, 8 or 4; Q = 2^(b-1) - 1 the largest magnitude (127, or 7)
    m       a block's max |x|
    s       its scale, float32
    u       float32's unit roundoff, 2^-24
    η       half the spacing of float32's subnormals, 2^-150: the most a rounding in the
            subnormal range can be off by

[Note: block quantization] Per block, in float32, each operation rounded once to nearest-even:
    s = m / Q                                   (one division)
    q = clamp(rint(x / s), -Q, Q)               (rint: round half to even; q an int8, |q| <= Q)
    dequantized = clamp(q · s, -F, F)           (F the largest finite float32)
- An all-zero block (m = 0) has s = 0 and q = 0, and dequantizes to zeros; so does a block whose
  m / Q rounds to 0 (m <= Q·η, all subnormal), whose values are then lost (|x| <= Q·η).
- A block holding a non-finite value has a non-finite s (m is inf, or NaN where a NaN is present),
  q = 0 everywhere, and dequantizes to NaN everywhere (0 · inf and 0 · NaN are NaN): the overflow
  is carried, never hidden in a finite scale, so a loss scaler's check for a non-finite reduced
  gradient still finds it and skips the step.
- The clamp of q acts only where s underflowed into the subnormals and lost precision (then
  x / s can exceed Q + 1/2); the clamp of q · s only where m is within a rounding of F (then
  Q·s can round past F to inf, which would fake an overflow). Both are projections onto an
  interval holding the exact value, so neither adds error.
- -0.0 dequantizes to +0.0 (q is an integer).
The wire holds q (b bits each) and one float32 s per block; everything else follows from them.

[Note: quantization error] For every element x of a block with finite m:
    |x - dequantized| <= s/2 + 4u·m + (Q + 2)·η.
In exact arithmetic it is s/2 = m/(2Q): q is x/s rounded to the nearest integer. Float32 adds
(each step's rounding is δ relative or, below the normal range, η absolute):
- x / s is off by at most u·|x/s| + η, so |x - q·s| <= s/2 + u·|x| + η·s <= s/2 + 2u·m where q
  is not clamped; where it is, |t| > Q + 1/2 so |x| > Q·s, and |x - Q·s| <= m - Q·s =
  m - Q·fl(m/Q) <= u·m + Q·η;
- q·s is off by at most u·Q·s + η <= u·m·(1 + u) + η (Q·s <= m·(1 + u) + Q·η), and the final
  clamp only moves it towards x.
Summing, s/2 + 2u·m + Q·η + u·m(1 + u) + u·Q·η + η <= s/2 + 4u·m + (Q + 2)·η. An all-zero
block is exact; a block with s = 0 loses |x| <= m <= Q·η. As s <= (m/Q)(1 + u) + η, in terms of
m alone the bound is m/(2Q) + 5u·m + (Q + 3)·η: for int8 about m/254, for int4 m/14.

Through a sum: N vectors x_i, each quantized on its own (its own scales), summed in float32 by
the tree T (reference/tree.py) as a reduce-scatter does. Per element, with e_i the bound above
for x_i and d = ceil(log2 N) the depth of T (each leaf goes through at most d additions):
    |T(deq(x_0) ... deq(x_{N-1})) - Σ x_i| <= Σ_i e_i + γ_d · Σ_i |deq(x_i)|,
    γ_d = d·u / (1 - d·u),
the first term from the triangle inequality, the second the tree's own rounding (float32
additions that land in the subnormals are exact). The quantization part grows linearly in N:
nothing cancels in the worst case, so N ranks with equal scales can be off by N·s/2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .precision import UNIT_ROUNDOFF
from .tree import tree_sum

QMAX = {8: 127, 4: 7}
"""Q per bit width: the symmetric range [-Q, Q] of the quantized values."""
U = UNIT_ROUNDOFF["fp32"]
ETA = 2.0**-150
"""Half the spacing of float32's subnormals: the largest error of a rounding below 2^-126."""
F32_MAX = np.finfo(np.float32).max
MAX_TERMS = 4096
"""The most vectors sum_error_bound takes: its float64 rounding allowance (1 + 2^-40) covers the
N + 2 additions of its own sums up to here ((N + 2)·2^-53 <= 2^-40)."""


@dataclass(frozen=True)
class Quantized:
    """A quantized vector as it travels: q (int8, one per element; int4 values in [-7, 7] are
    held one per int8 here) and one float32 scale per block of `block` elements."""

    q: np.ndarray
    scale: np.ndarray
    block: int
    bits: int


def _check(x, block: object, bits: object) -> np.ndarray:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r}: must be an integer >= 1")
    if isinstance(bits, bool) or bits not in QMAX:
        raise ValueError(f"bits={bits!r}: allowed are {tuple(QMAX)}")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
        what = (
            f"dtype {x.dtype}, shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        )
        raise ValueError(f"x: {what}; allowed is a 1-D numpy float32 array")
    return x


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """x as rows of `block` elements, the last row padded with zeros (which change no max)."""
    rows = max(1, math.ceil(x.size / block))
    out = np.zeros(rows * block, dtype=x.dtype)
    out[: x.size] = x
    return out.reshape(rows, block)


def quantize(x: np.ndarray, *, block: int, bits: int) -> Quantized:
    """[Note: block quantization]: q and the per-block scales of x (1-D float32)."""
    x = _check(x, block, bits)
    qmax = QMAX[bits]
    xb = _blocks(x, block)
    m = np.max(np.abs(xb), axis=1)  # NaN where a block holds a NaN, inf where an inf
    scale = m / np.float32(qmax)
    live = (np.isfinite(scale) & (scale > 0))[:, None]
    t = np.divide(xb, scale[:, None], out=np.zeros_like(xb), where=live)
    q = np.clip(np.rint(t), -qmax, qmax).astype(np.int8)
    rows = math.ceil(x.size / block)
    return Quantized(q=q.reshape(-1)[: x.size], scale=scale[:rows], block=block, bits=bits)


def dequantize(qz: Quantized) -> np.ndarray:
    """clamp(q · s, -F, F) in float32 per block ([Note: block quantization]); NaN throughout a
    block whose scale is not finite."""
    qb = _blocks(qz.q.astype(np.float32), qz.block)[: qz.scale.size]
    with np.errstate(over="ignore", invalid="ignore"):  # Q·s past F (clamped), 0·inf (NaN)
        d = qb * qz.scale[:, None]
    return np.clip(d, -F32_MAX, F32_MAX).reshape(-1)[: qz.q.size]


def error_bound(x: np.ndarray, *, block: int, bits: int) -> np.ndarray:
    """Per element of x (float64): s/2 + 4u·m + (Q + 2)·η of its block ([Note: quantization
    error]); inf for the elements of a block with a non-finite value (no bound: they dequantize
    to NaN by design). The three terms are exact in float64 (s/2 and Q·η are powers of two
    times float32 values, 4u·m likewise); their sum is rounded up by one float64 ulp per
    addition, so the bound returned is never below the one derived."""
    x = _check(x, block, bits)
    qmax = QMAX[bits]
    xb = _blocks(x, block)
    m32 = np.max(np.abs(xb), axis=1)
    m, scale = m32.astype(np.float64), (m32 / np.float32(qmax)).astype(np.float64)  # quantize's
    with np.errstate(invalid="ignore"):
        per_block = np.nextafter(scale / 2 + 4 * U * m, np.inf)
        per_block = np.nextafter(per_block + (qmax + 2) * ETA, np.inf)
    per_block[~np.isfinite(m)] = np.inf
    return np.repeat(per_block, block)[: x.size]


def sum_error_bound(xs: Sequence[np.ndarray], *, block: int, bits: int) -> np.ndarray:
    """Per element (float64), the bound on |T(deq(x_0), ..., deq(x_{N-1})) - Σ x_i| of
    [Note: quantization error]: Σ_i e_i + γ_d·Σ_i |deq(x_i)|, d = ceil(log2 N), times
    (1 + 2^-40), which covers the float64 roundings of its own sums (at most N + 2 additions
    of nonnegative terms, each off by at most 2^-53 relative, and N <= MAX_TERMS)."""
    if not 1 <= len(xs) <= MAX_TERMS:
        raise ValueError(f"xs: {len(xs)} vectors; allowed are 1 to {MAX_TERMS}")
    depth = math.ceil(math.log2(len(xs))) if len(xs) > 1 else 0
    gamma = depth * U / (1 - depth * U)
    e = sum(error_bound(x, block=block, bits=bits) for x in xs)
    mags = sum(
        np.abs(dequantize(quantize(x, block=block, bits=bits)).astype(np.float64)) for x in xs
    )
    return (e + gamma * mags) * (1 + 2.0**-40)


def quantized_sum(xs: Sequence[np.ndarray], *, block: int, bits: int) -> np.ndarray:
    """T(deq(x_0), ..., deq(x_{N-1})) in float32: every term quantized on its own, then summed
    by the reference's tree in rank order."""
    return tree_sum([dequantize(quantize(x, block=block, bits=bits)) for x in xs])
