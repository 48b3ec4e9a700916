"""reference/zeropp.py (ZeRO++'s qwZ values and qgZ's two-hop sum) and the engine's torch
quantizer (zero/stages/zeropp.py) against it, bit for bit.

What is shown here:
- the engine's quantize/encode/decode give reference/quantize.py's bits, for int8 and int4, on
  random values and on the edge cases the reference defines (zeros, subnormals, inf, NaN, the
  largest float32), whatever the wire's packing;
- qgZ's sum is within its derived bound of the exact sum (computed in float64, exact for these
  magnitudes), at every node shape, and the bound is not vacuous;
- with one node the sum is one quantized hop, with one rank per node one hop across nodes;
- a non-finite gradient anywhere reaches the sum (the loss scaler still sees it);
- qwZ's values do not depend on N and are within quantize.py's bound of the exact values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.layout import unit_layout
from reference.quantize import error_bound, quantize
from reference.step import ModelSpec
from reference.tree import tree_sum
from reference.zeropp import (
    ZeroPP,
    qgz_error_bound,
    qgz_sum,
    quantized_working,
    qwz_values,
    roundtrip,
)
from zero.stages import zeropp as engine

F32 = np.float32


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32).view(np.uint32)


def same(got, want) -> bool:
    """Bits equal, NaN matching NaN (payloads differ between libraries)."""
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    nan = np.isnan(got)
    return np.array_equal(nan, np.isnan(want)) and np.array_equal(bits(got)[~nan], bits(want)[~nan])


def edge_values(n: int, seed: int) -> np.ndarray:
    """n values (a multiple of 64): normal draws over 40 binades, then blocks of zeros, of
    subnormals, of the largest float32, with an inf and with a NaN."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(F32)
    x[:16] = 0
    x[16:32] = (rng.standard_normal(16) * 2.0**-140).astype(F32)
    x[32:48] = np.finfo(F32).max * np.sign(rng.standard_normal(16)).astype(F32)
    x[50] = np.inf
    x[60] = np.nan
    return x


@pytest.mark.parametrize("bits_", [8, 4])
@pytest.mark.parametrize("block", [16, 64])
def test_the_engine_quantizes_as_the_reference(bits_, block):
    x = edge_values(1024, seed=bits_ * block)
    want = quantize(x, block=block, bits=bits_)
    q, scale = engine.quantize(torch.from_numpy(x.copy()), block, bits_)
    assert np.array_equal(q.numpy(), want.q)
    assert same(scale.numpy(), want.scale)
    # through the wire: packed (int4: two to a byte), in rows of whole blocks
    rows = torch.from_numpy(x.copy()).view(4, 256)
    wire = engine.encode(rows, block, bits_)
    assert wire.dtype == torch.uint8 and wire.shape == (4, 256 * bits_ // 8 + 4 * 256 // block)
    assert same(
        engine.decode(wire, 256, block, bits_).numpy().reshape(-1),
        roundtrip(x, block=block, bits=bits_),
    )


@given(
    per_node=st.sampled_from([1, 2, 4]),
    nodes=st.sampled_from([1, 2, 3]),
    bits_=st.sampled_from([8, 4]),
    seed=st.integers(0, 2**31),
    spread=st.integers(0, 12),
)
@settings(max_examples=60, deadline=None)
def test_qgz_sum_is_within_its_bound_of_the_exact_sum(per_node, nodes, bits_, seed, spread):
    rng = np.random.default_rng(seed)
    n, size, block = per_node * nodes, 512, 32
    xs = [
        (rng.standard_normal(size) * 2.0 ** rng.integers(-spread, spread + 1, size)).astype(F32)
        for _ in range(n)
    ]
    got = qgz_sum(xs, per_node=per_node, block=block, bits=bits_).astype(np.float64)
    exact = np.sum(
        [x.astype(np.float64) for x in xs], axis=0
    )  # exact: 24-bit values over 2^±12 and 12 terms fit in 53 bits
    bound = qgz_error_bound(xs, per_node=per_node, block=block, bits=bits_)
    assert np.all(np.abs(got - exact) <= bound)


def test_the_qgz_bound_is_not_vacuous():
    """Each quantization's rounding error of x/s spreads over [0, s/2]; over 4096 values per
    hop the largest error is above a quarter of its bound unless every one of them is below it
    (for uniform errors, probability 2^-4096). So the worst ratio error/bound is above 1/4 for
    the single-hop sums (one node of 4; 4 nodes of 1), where the bound has no slack from
    a second hop."""
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(4096).astype(F32) for _ in range(4)]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for per_node in (4, 1):
        got = qgz_sum(xs, per_node=per_node, block=64, bits=4).astype(np.float64)
        bound = qgz_error_bound(xs, per_node=per_node, block=64, bits=4)
        assert 0.25 < np.max(np.abs(got - exact) / bound) <= 1


def test_hops_over_one_rank_quantize_nothing():
    """One node: S = T(q(x_0), ..., q(x_3)). Four nodes of one rank: the same sum, one hop
    across nodes. Two nodes of two: q(T(q(x_0), q(x_1))) + q(T(q(x_2), q(x_3))). One rank: x."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(256).astype(F32) for _ in range(4)]
    q = [roundtrip(x, block=32, bits=8) for x in xs]
    one_hop = tree_sum(q)
    assert same(qgz_sum(xs, per_node=4, block=32, bits=8), one_hop)
    assert same(qgz_sum(xs, per_node=1, block=32, bits=8), one_hop)
    two = [roundtrip(q[0] + q[1], block=32, bits=8), roundtrip(q[2] + q[3], block=32, bits=8)]
    assert same(qgz_sum(xs, per_node=2, block=32, bits=8), two[0] + two[1])
    assert same(qgz_sum(xs[:1], per_node=1, block=32, bits=8), xs[0])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_gradient_reaches_the_sum(bad):
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(256).astype(F32) for _ in range(4)]
    xs[3][100] = bad
    out = qgz_sum(xs, per_node=2, block=32, bits=4)
    assert np.isnan(out[96:128]).all() and np.isfinite(out[:96]).all()


def _spec():
    params = [("w", (40, 7)), ("b", (7,)), ("v", (300,))]
    return ModelSpec(layouts=(unit_layout(params, chunk=128),), group_of={"w": 0, "b": 0, "v": 0})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qwz_values_do_not_depend_on_n_and_keep_their_bound(precision):
    """W' is q_B of the unit's buffer, blocks B-aligned and B dividing every shard: the same at
    N = 1, 2, 4 (the padding adds zero blocks). In fp32 it is within error_bound of W."""
    rng = np.random.default_rng(11)
    spec = _spec()
    from reference.precision import cast

    w = {k: cast(rng.standard_normal(s).astype(F32), precision) for k, s in spec.shapes.items()}
    z = ZeroPP(block=64, qwz_bits=8, units=(True,))
    outs = [quantized_working(w, spec, z, n, precision) for n in (1, 2, 4)]
    for k in w:
        assert same(outs[1][k].astype(F32), outs[0][k].astype(F32))
        assert same(outs[2][k].astype(F32), outs[0][k].astype(F32))
    lay = spec.layouts[0]
    flat = lay.flatten(w, 1, F32)
    if precision == "fp32":
        got = qwz_values(flat, block=64, bits=8, precision="fp32").astype(np.float64)
        assert np.all(np.abs(got - flat) <= error_bound(flat, block=64, bits=8))
    assert not all(np.array_equal(outs[0][k], w[k]) for k in w)  # it did quantize


def test_wire_bytes_are_the_values_and_the_scales():
    for n, block, b in ((256, 32, 8), (256, 32, 4), (4096, 256, 4)):
        x = torch.randn(n)
        assert engine.encode(x, block, b).numel() == math.ceil(n * b / 8) + 4 * (n // block)
