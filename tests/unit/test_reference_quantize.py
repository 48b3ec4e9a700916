"""reference/quantize.py: ZeRO++'s block quantization, bit for bit on hand-built blocks, and its
worst-case error bound ([Note: quantization error]) on random draws and as a property.

Hand-built blocks have a max |x| of Q·2^k, so that the scale s = m/Q is exact and every expected
value below can be checked by hand. Bits are compared as uint32 views; NaN payloads differ
between libraries, so NaN is compared as NaN-ness (reference/precision.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference.quantize import (
    ETA,
    QMAX,
    U,
    dequantize,
    error_bound,
    quantize,
    quantized_sum,
    sum_error_bound,
)

F32 = np.float32
TINY = 2.0**-149  # the smallest float32 subnormal


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).view(np.uint32)


def same_bits(got, want) -> bool:
    return np.array_equal(bits(got), bits(np.asarray(want, dtype=F32)))


def test_ties_round_to_even_and_the_max_maps_to_q():
    """m = 127, s = 1: x/s is x itself, and halves go to the even neighbour."""
    x = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -2.5], F32)
    qz = quantize(x, block=8, bits=8)
    assert same_bits(qz.scale, [1.0])
    assert qz.q.dtype == np.int8
    assert qz.q.tolist() == [127, 0, 2, 2, 0, -2, 126, -2]
    assert same_bits(dequantize(qz), [127, 0, 2, 2, 0, -2, 126, -2])


def test_a_scale_below_one_and_a_short_last_block():
    """Blocks of 2: [12.7, 0.1] has s = fl(12.7/127); [-0.25, 0.125] has m = 0.25, s = 0.25/127;
    [3.0] (the short last block) s = 3/127. The q are x/s rounded, worked out by hand: 0.1/0.1
    = 1, 0.125 / (0.25/127) = 63.5 -> 64 (ties to even), 3 -> 127."""
    x = np.array([12.7, 0.1, -0.25, 0.125, 3.0], F32)
    qz = quantize(x, block=2, bits=8)
    assert qz.q.tolist() == [127, 1, -127, 64, 127]
    s = np.array([F32(12.7) / F32(127), F32(0.25) / F32(127), F32(3.0) / F32(127)], F32)
    assert same_bits(qz.scale, s)
    want = [F32(127) * s[0], F32(1) * s[0], F32(-127) * s[1], F32(64) * s[1], F32(127) * s[2]]
    assert same_bits(dequantize(qz), want)


def test_int4_uses_seven_levels_each_side():
    x = np.array([7, -7, 3.5, 2.5, 0.4, -6.5, 14, 1], F32)
    qz = quantize(x, block=6, bits=4)
    assert same_bits(qz.scale, [1.0, 2.0])  # 7/7 and 14/7
    assert qz.q.tolist() == [7, -7, 4, 2, 0, -6, 7, 0]  # 1/2 = 0.5 -> 0
    assert same_bits(dequantize(qz), [7, -7, 4, 2, 0, -6, 14, 0])


def test_the_clamp_acts_where_the_scale_underflowed():
    """m = 190·2^-149: m/127 = 1.496·2^-149 rounds to the subnormal 2^-149, so x/s = 190 and q
    is clamped to 127. The error, 63·2^-149, is far above s/2 = 2^-150: that is the (Q + 2)·η
    term of the bound, 129·2^-150, which with s/2 makes 65·2^-149 (4u·m is ~2^-165)."""
    x = np.array([190, 100], F32) * F32(TINY)
    qz = quantize(x, block=2, bits=8)
    assert same_bits(qz.scale, [TINY])
    assert qz.q.tolist() == [127, 100]
    deq = dequantize(qz)
    assert same_bits(deq, np.array([127, 100], F32) * F32(TINY))
    err = np.abs(x.astype(np.float64) - deq)
    assert err.tolist() == [63 * TINY, 0.0]
    bound = error_bound(x, block=2, bits=8)
    assert np.all(err <= bound) and bound[0] < 65.001 * TINY


def test_a_block_whose_scale_rounds_to_zero_is_lost_within_the_bound():
    """m = 2^-149: m/127 rounds to 0, so q = 0 and the block dequantizes to zeros; the loss,
    2^-149, is within the bound's (Q + 2)·η = 129·2^-150."""
    x = np.array([TINY, -TINY], F32)
    qz = quantize(x, block=2, bits=8)
    assert same_bits(qz.scale, [0.0]) and qz.q.tolist() == [0, 0]
    assert same_bits(dequantize(qz), [0.0, 0.0])
    assert np.all(np.abs(x.astype(np.float64)) <= error_bound(x, block=2, bits=8))


def test_a_zero_block_has_scale_zero_and_dequantizes_to_plus_zeros():
    x = np.array([0.0, -0.0, 0.0, 5.0, -0.0], F32)
    qz = quantize(x, block=3, bits=8)
    assert same_bits(qz.scale, [0.0, F32(5) / F32(127)])
    assert qz.q.tolist() == [0, 0, 0, 127, 0]
    assert bits(dequantize(qz))[:3].tolist() == [0, 0, 0]  # -0.0 comes back as +0.0
    assert bits(dequantize(qz))[4] == 0


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_value_makes_its_whole_block_nan_and_no_other(bad):
    """Its block's scale is inf (or NaN), q = 0, and 0·inf = NaN everywhere in it: the loss
    scaler's overflow check sees it. The neighbouring blocks keep their exact values."""
    x = np.array([1.0, 2.0, bad, 3.0, 127.0, 0.5], F32)
    qz = quantize(x, block=4, bits=8)
    assert not np.isfinite(qz.scale[0]) and qz.q[:4].tolist() == [0, 0, 0, 0]
    if not np.isnan(bad):
        assert same_bits(qz.scale[:1], [np.inf])  # never hidden in a finite scale
    deq = dequantize(qz)
    assert np.isnan(deq[:4]).all()
    assert same_bits(deq[4:], [127.0, 0.0])
    assert np.isinf(error_bound(x, block=4, bits=8)[:4]).all()


def test_the_largest_float_saturates_instead_of_overflowing():
    """fl(127 · fl(F/127)) rounds past F to inf; the dequantized value is clamped to F, so a
    finite block never fakes an overflow."""
    big = np.finfo(F32).max
    with np.errstate(over="ignore"):
        assert np.isinf(F32(127) * (big / F32(127)))
    qz = quantize(np.array([big, -1.0], F32), block=2, bits=8)
    assert qz.q.tolist() == [127, 0]
    assert same_bits(dequantize(qz), [big, 0.0])


@pytest.mark.parametrize(
    ("x", "block", "bits", "message"),
    [
        (np.zeros(4, np.float64), 2, 8, r"x: dtype float64, shape \(4,\); allowed is a 1-D"),
        (np.zeros((2, 2), F32), 2, 8, r"x: dtype float32, shape \(2, 2\); allowed is a 1-D"),
        ([1.0], 2, 8, "x: list; allowed is a 1-D numpy float32 array"),
        (np.zeros(4, F32), 0, 8, "block=0: must be an integer >= 1"),
        (np.zeros(4, F32), True, 8, "block=True: must be an integer >= 1"),
        (np.zeros(4, F32), 2, 2, r"bits=2: allowed are \(8, 4\)"),
    ],
)
def test_bad_input_is_refused_by_name(x, block, bits, message):
    with pytest.raises(ValueError, match=message):
        quantize(x, block=block, bits=bits)


def draws(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 values over many magnitudes: normals scaled by 10^k for k in [-40, 38] (the
    smallest reach the subnormals), with zeros and exact ties mixed in."""
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-40, 38, n)
    x[rng.random(n) < 0.05] = 0.0
    with np.errstate(over="ignore"):
        x = x.astype(F32)
    return np.where(np.isfinite(x), x, F32(1.0))


@pytest.mark.parametrize("bits_", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_the_bound_holds_and_is_reached_on_random_draws(bits_, block):
    """|x - deq| <= s/2 + 4u·m + (Q + 2)·η, per element ([Note: quantization error]): x/s is
    rounded to an integer (s/2), the division and the product q·s each round once (<= 2u·m and
    <= u·m(1 + u) + η), and a clamp, only where s underflowed, costs <= u·m + Q·η. The error is
    exact in float64 (x and deq are float32 within a factor 3 of each other, or deq = 0). The
    bound is no looser than needed: some element comes within 1% of s/2, so a bound ten times
    smaller fails."""
    rng = np.random.default_rng(block * 10 + bits_)
    x = draws(rng, 20_000)
    qz = quantize(x, block=block, bits=bits_)
    deq = dequantize(qz)
    assert np.isfinite(deq).all() and np.abs(qz.q).max() <= QMAX[bits_]
    err = np.abs(x.astype(np.float64) - deq.astype(np.float64))
    bound = error_bound(x, block=block, bits=bits_)
    assert np.all(err <= bound), float(np.max(err / bound))
    half = np.repeat(qz.scale.astype(np.float64) / 2, block)[: x.size]
    if block > 1:
        assert np.max(err[half > 0] / half[half > 0]) > 0.99
        assert not np.all(err <= bound / 10)


def exact_difference(total: np.ndarray, xs: list[np.ndarray]) -> np.ndarray:
    """|T - Σ x_i| per element, as math.fsum gives it: the exact value rounded once to float64
    (relative 2^-53, inside sum_error_bound's (1 + 2^-40) allowance)."""
    cols = np.stack([total.astype(np.float64)] + [-x.astype(np.float64) for x in xs])
    return np.abs(np.array([math.fsum(c) for c in cols.T]))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_sum_of_n_quantized_terms_stays_within_the_accumulated_bound(n):
    """N ranks quantize their own vectors (same magnitudes per element, as gradients of one
    parameter), the tree T sums the dequantized terms in float32: |T - Σ x_i| <= Σ e_i +
    γ_d·Σ|deq(x_i)|, d = ceil(log2 N) (the triangle inequality, and each leaf goes through d
    float32 additions)."""
    rng = np.random.default_rng(n)
    scale = (10.0 ** rng.integers(-20, 20, 3000)).astype(np.float64)
    xs = [(rng.standard_normal(3000) * scale).astype(F32) for _ in range(n)]
    total = quantized_sum(xs, block=64, bits=8)
    err = exact_difference(total, xs)
    assert np.all(err <= sum_error_bound(xs, block=64, bits=8))


def test_the_quantization_error_of_a_sum_grows_linearly_in_n():
    """Every rank holds [127, 0.5] (s = 1): 0.5 ties down to 0 on each, so the sum of N terms is
    off by exactly N/2 in that element; the bound, N·(1/2 + 4u·127 + 129η), is reached but for
    its rounding terms. Nothing cancels in the worst case."""
    for n in (1, 2, 4, 8):
        xs = [np.array([127.0, 0.5], F32)] * n
        total = quantized_sum(xs, block=2, bits=8)
        assert same_bits(total, [127.0 * n, 0.0])
        bound = sum_error_bound(xs, block=2, bits=8)[1]
        assert exact_difference(total, xs)[1] == n / 2
        assert n / 2 <= bound <= n * (0.5 + 4 * U * 127 + 129 * ETA) * (1 + 2.0**-39)


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
# Where the bound's float32 terms matter: subnormal blocks k·2^-149, |k| <= 2^13, whose scale is
# a subnormal of at most 65 steps of 2^-149 and so off by up to a third of itself (x/s can pass
# Q + 1/2, and the clamp acts); and halves (k + 1/2)·2^e, the ties.
subnormal_range = st.integers(-(2**13), 2**13).map(lambda k: k * TINY)
halves = st.builds(
    lambda k, e: math.ldexp(k + 0.5, e), st.integers(-255, 255), st.integers(-148, 100)
)
vectors = st.integers(0, 200).flatmap(
    lambda size: st.one_of(
        hnp.arrays(np.float32, size, elements=finite32),
        hnp.arrays(np.float32, size, elements=subnormal_range),
        hnp.arrays(np.float32, size, elements=halves),
    )
)


@given(x=vectors, block=st.integers(1, 64), bits_=st.sampled_from([8, 4]))
def test_property_the_bound_holds_for_every_finite_vector(x, block, bits_):
    """Any finite float32 vector (any magnitude, signed zeros, the subnormals, ties): q within
    [-Q, Q], a finite result, and the per-element bound. Shown to be able to fail: given the
    bound s/2 alone (exact arithmetic's), 5 of 6 runs of 40 examples found a subnormal block
    whose clamped error passes it (test_the_clamp_acts_where_the_scale_underflowed is that
    case, every time)."""
    qz = quantize(x, block=block, bits=bits_)
    deq = dequantize(qz)
    assert deq.dtype == np.float32 and deq.shape == x.shape
    assert np.isfinite(deq).all()
    assert qz.q.size == 0 or np.abs(qz.q.astype(int)).max() <= QMAX[bits_]
    err = np.abs(x.astype(np.float64) - deq.astype(np.float64))
    assert np.all(err <= error_bound(x, block=block, bits=bits_))


@given(
    xs=st.integers(1, 40).flatmap(
        lambda size: st.lists(
            hnp.arrays(np.float32, size, elements=st.floats(-(2.0**100), 2.0**100, width=32)),
            min_size=1,
            max_size=6,
        )
    ),
    block=st.integers(1, 16),
    bits_=st.sampled_from([8, 4]),
)
def test_property_the_sum_bound_holds(xs, block, bits_):
    """Sums of 1 to 6 quantized vectors, elements within ±2^100 so that no float32 sum of six
    overflows (6·2^100 is far below 2^128)."""
    total = quantized_sum(xs, block=block, bits=bits_)
    assert np.all(exact_difference(total, xs) <= sum_error_bound(xs, block=block, bits=bits_))
