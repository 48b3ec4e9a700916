"""The reduction order: T, its streaming form, the micro-batch assignment and the chunked norm."""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference.layout import unit_layout
from reference.tree import (
    StreamingTree,
    chunk_sumsq,
    global_norm,
    microbatch_owner,
    reduce_microbatches,
    tree_sum,
)
from verify.checks.bounds import UNIT_ROUNDOFF, gamma
from zero.control import tree_total


def f32(x):
    return np.array(x, np.float32)


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


# Values whose sums depend on the order: 1 + 2^-24 is lost against 1 but not against 2^-24.
ORDER_SENSITIVE = [f32(1.0), f32(2.0**-24), f32(2.0**-24), f32(-1.0), f32(3.0), f32(2.0**-23)]


def test_tree_shapes_written_out():
    a, b, c, d, e, f, g = [f32(v) for v in (1.0, 2.0**-24, 2.0**-24, 3.0, 2.0**-23, -1.0, 7.0)]
    assert bits(tree_sum([a])) == bits(a)
    assert bits(tree_sum([a, b])) == bits(a + b)
    assert bits(tree_sum([a, b, c])) == bits((a + b) + c)
    assert bits(tree_sum([a, b, c, d])) == bits((a + b) + (c + d))
    assert bits(tree_sum([a, b, c, d, e])) == bits(((a + b) + (c + d)) + e)
    assert bits(tree_sum([a, b, c, d, e, f])) == bits(((a + b) + (c + d)) + (e + f))
    assert bits(tree_sum([a, b, c, d, e, f, g])) == bits(((a + b) + (c + d)) + ((e + f) + g))


def test_order_sensitive_data_really_is():
    """The data above would expose a wrong tree: a left-to-right sum gives other bits."""
    seq = ORDER_SENSITIVE[0]
    for x in ORDER_SENSITIVE[1:4]:
        seq = seq + x
    assert bits(seq) != bits(tree_sum(ORDER_SENSITIVE[:4]))


def test_tree_starts_from_leaves_keeping_negative_zero():
    z = f32(-0.0)
    assert bits(tree_sum([z, z, z])) == bits(z)  # a +0 accumulator would give +0
    s = StreamingTree()
    for _ in range(5):
        s.push(z)
    assert bits(s.result()) == bits(z)


wide_floats = st.floats(
    min_value=-1e6, max_value=1e6, allow_nan=False, allow_subnormal=True, width=32
)


@given(st.lists(wide_floats, min_size=1, max_size=70))
def test_streaming_equals_tree(xs):
    leaves = [f32(x) for x in xs]
    s = StreamingTree()
    for x in leaves:
        s.push(x)
    assert bits(s.result()) == bits(tree_sum(leaves))
    # extra buffers needed while streaming n leaves: max popcount(j), 1 <= j < n = floor(log2 n)
    assert s.peak_partials == (len(leaves).bit_length() - 1)


def test_microbatch_owner():
    # docs/design.md §2: micro-batch j on rank j mod N at micro-step j div N
    assert [microbatch_owner(j, 4) for j in range(6)] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (0, 1),
        (1, 1),
    ]


@given(
    st.integers(0, 3),  # log2 N
    st.integers(0, 3),  # log2 (M/N)
    st.integers(0, 2**32 - 1),
)
def test_power_of_two_world_sizes_give_the_same_bits(log_n, log_k, seed):
    n_max = 8
    m = n_max * 2**log_k  # a multiple of every N up to 8
    rng = np.random.default_rng(seed)
    # magnitudes spanning 2^-20..2^20 so that the order of additions shows in the bits
    grads = [
        (rng.standard_normal(16) * 2.0 ** rng.integers(-20, 20, 16)).astype(np.float32)
        for _ in range(m)
    ]
    base = reduce_microbatches(grads, 1)
    got = reduce_microbatches(grads, 2**log_n)
    assert np.array_equal(bits(got), bits(base))


def test_world_size_three_is_its_own_tree():
    """N=3: B_k over 3 ranks, then the stream; equals the explicit formula, differs from N=1."""
    # N=1 sums ((g0+g1)+(g2+g3)) + (g4+g5): 1 + 2^-24 ties to 1, twice. N=3 sums
    # ((g0+g1)+g2) + ((g3+g4)+g5): the two 2^-24 meet first and survive as 2^-23.
    g = [f32(v) for v in (1.0, 0.0, 0.0, 2.0**-24, 2.0**-24, 0.0)]
    b0 = (g[0] + g[1]) + g[2]
    b1 = (g[3] + g[4]) + g[5]
    assert bits(reduce_microbatches(g, 3)) == bits(b0 + b1)
    assert bits(reduce_microbatches(g, 3)) != bits(reduce_microbatches(g, 1))


def test_reduce_rejects_m_not_multiple_of_n():
    with pytest.raises(ValueError, match="multiple of world_size"):
        reduce_microbatches([f32(1.0)] * 6, 4)


@given(st.integers(0, 2**32 - 1), st.sampled_from([128, 256, 1024]), st.integers(1, 6))
def test_chunk_sumsq_is_pairwise_halving_in_numpy_and_torch(seed, chunk, nchunks):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(chunk * nchunks) * 2.0 ** rng.integers(-30, 30)).astype(np.float32)
    got = chunk_sumsq(x, chunk)
    # the same halving written out with torch's float64 elementwise adds
    t = torch.from_numpy(x).double().reshape(nchunks, chunk) ** 2
    while t.shape[1] > 1:
        h = t.shape[1] // 2
        t = t[:, :h] + t[:, h:]
    assert np.array_equal(got.view(np.uint64), t[:, 0].numpy().view(np.uint64))


@given(st.integers(0, 2**32 - 1), st.lists(st.integers(1, 700), min_size=1, max_size=6))
def test_norm_same_bits_for_every_partition(seed, sizes):
    """Cut a unit's padded buffer into N shards (N = 1, 2, 3, 4, 8), take each shard's chunk
    partials, concatenate in rank order and drop the N-padding chunks: the norm is the same bits
    for every N. Also check it against an exactly rounded norm within its derived bound."""
    rng = np.random.default_rng(seed)
    lay = unit_layout([(f"p{i}", (n,)) for i, n in enumerate(sizes)], chunk=128)
    vals = {
        f"p{i}": (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
        for i, n in enumerate(sizes)
    }
    norms = []
    for n in (1, 2, 3, 4, 8):
        flat, shard = lay.flatten(vals, n, np.float32), lay.shard_numel(n)
        parts = np.concatenate(
            [chunk_sumsq(flat[r * shard : (r + 1) * shard], lay.chunk) for r in range(n)]
        )
        norms.append(global_norm([parts[: lay.num_chunks]]))
    assert len({float(x).hex() for x in norms}) == 1, norms
    # float32 squares are exact in float64 (24+24 < 53 bits); only the tree's additions round,
    # at most depth = log2(C) + ceil(log2(chunks)) times along any path: relative error of the
    # sum <= γ_depth; the sqrt halves it and adds one rounding.
    exact = math.sqrt(math.fsum(float(v) ** 2 for a in vals.values() for v in a))
    depth = int(math.log2(lay.chunk)) + math.ceil(math.log2(max(lay.num_chunks, 1)))
    tol = (gamma(depth, UNIT_ROUNDOFF["fp64"]) / 2 + UNIT_ROUNDOFF["fp64"]) * exact
    assert abs(float(norms[0]) - exact) <= tol
    # twin: an error of 10x the bound must fail the same check
    assert not abs(float(norms[0]) + 10 * tol - exact) <= tol


# -- the engine's vectorised T (zero/control.py's tree_total) ----------------------------------


def tree_bits(x) -> int:
    return int(np.float64(x).view(np.uint64))


@settings(deadline=None, max_examples=60)
@given(
    st.one_of(st.integers(1, 5000), st.integers(5000, 10**6)),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["spread", "specials"]),
)
@example(2**19, 1, "spread")
@example(2**19 - 1, 2, "spread")
@example(2**19 + 1, 3, "specials")
@example(10**6, 4, "spread")
def test_vectorised_tree_equals_tree_sum(n, seed, kind):
    """tree_total = reference.tree.tree_sum bit for bit at every count from 1 to 10^6 (powers
    of two, one more and one less, and arbitrary counts), on values whose sums depend on the
    tree's shape: magnitudes over 120 binades, and in half the draws signed zeros, a
    subnormal, infinities and NaNs (NaN compared as NaN: its payload is not pinned)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)
    if kind == "specials":
        where = rng.integers(0, n, min(n, 6))
        x[where] = np.array([0.0, -0.0, np.inf, 1e-310, -np.inf, np.nan])[: len(where)]
    got, want = tree_total(x), tree_sum(list(x))
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert tree_bits(got) == tree_bits(want), (n, kind)


def test_vectorised_tree_shapes_written_out():
    """Small counts against their trees written by hand, on order-sensitive values."""
    a, b, c, d, e = 1.0, 2.0**-53, 2.0**-53, 3.0, -1.0
    assert tree_bits(tree_total(np.array([a]))) == tree_bits(a)
    assert tree_bits(tree_total(np.array([a, b, c]))) == tree_bits((a + b) + c)
    assert tree_bits(tree_total(np.array([a, b, c, d, e]))) == tree_bits(((a + b) + (c + d)) + e)
    six = tree_total(np.array([a, b, c, d, e, b]))
    assert tree_bits(six) == tree_bits(((a + b) + (c + d)) + (e + b))
    seven = tree_total(np.array([a, b, c, d, e, b, c]))
    assert tree_bits(seven) == tree_bits(((a + b) + (c + d)) + ((e + b) + c))
    assert tree_total(np.zeros(0)) == 0.0
    # T's shape matters: 1 + 2^-53 rounds to 1 (ties to even), so a left-to-right sum of
    # these seven loses every small term, and T keeps two of them
    u = 2.0**-53
    small = tree_total(np.array([1.0, u, u, 0.0, 0.0, u, u]))
    assert small == ((1.0 + u) + (u + 0.0)) + ((0.0 + u) + u) == 1.0 + 2 * u
    assert ((((((1.0 + u) + u) + 0.0) + 0.0) + u) + u) == 1.0
