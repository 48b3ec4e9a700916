"""ZeRO++'s volume by count (paper_figures/zeropp_volume.py) against numbers derived by hand, the
0.75M total, the transcribed bars' consistency, and the two-link model's limits
(paper_figures/performance/throughput_model.two_link_seconds, zeropp_model).

Legend: N ranks, R per node, k = N/R nodes, L a shard, B the quantization block, e = 2 bytes,
M = e·Ψ bytes.
"""

from dataclasses import replace
from fractions import Fraction

import pytest

from paper_figures import paper
from paper_figures import zeropp_volume as zv
from paper_figures.performance import throughput_model as tm
from paper_figures.performance import zeropp_model as zm

# One unit, L = 512, Ψ = N·L = 2,048 (no padding), N = 4 as 2 nodes x 2, B = 128, fp16.
# Ring over the world: every rank sends (N-1)·e·L = 3·2·512 = 3,072 B per fp16 collective, all
# of it from local rank 1 (its next is on the next node) inter-node, from local rank 0 intra.
# qwZ's gathers (forward and backward): 3·(512 + 4·512/128) = 3·528 = 1,584 B each. hpZ's
# backward gather inside the node:
# ·e·k·L = 1·2·2·512 = 2,048 B intra on both ranks. qgZ: hop 1 ·(k·L/2 + 4·k·L/B) =
# 512 + 32 = 544 B intra, hop 2 (k-1)·(L/2 + 4·L/B) = 256 + 16 = 272 B inter, on both ranks.
HAND = {  # (local rank 0, local rank 1) as (intra, inter) bytes, and the node's inter-node bytes
    "ZeRO-3": ([(9216, 0), (0, 9216)], 9216),
    "hpZ": ([(3072 + 2048 + 3072, 0), (2048, 6144)], 6144),
    "qwZ": ([(2 * 1584 + 3072, 0), (0, 2 * 1584 + 3072)], 6240),
    "qgZ": ([(6144 + 544, 272), (544, 6144 + 272)], 6688),
    "ZeRO++": ([(1584 + 2048 + 544, 272), (2048 + 544, 1584 + 272)], 2128),
}


@pytest.mark.parametrize("scheme", list(HAND))
def test_each_scheme_sends_the_hand_derived_bytes(scheme):
    got = zv.step_traffic(scheme, [zv.Unit(512, 2048)], zv.Cluster(4, 2, block=128))
    ranks, node_inter = HAND[scheme]
    assert got["ranks"] == ranks
    assert got["node_inter"] == node_inter
    assert got["m_bytes"] == 4096


def test_zeropp_at_two_by_two_is_three_quarters_and_half_of_the_limits():
    """ZeRO++'s 2,128 B = (N-1)/N·(1/2 + 2/B)·M + (k-1)/k·(1/4 + 2/B)·M = 0.75·0.515625·4096 +
    0.5·0.265625·4096 = 1,584 + 544: below the claim's 0.75M for the two finite factors."""
    assert 3 * 528 == 0.75 * 0.515625 * 4096 and 2 * 272 == 0.5 * 0.265625 * 4096
    assert HAND["ZeRO++"][1] / 4096 < 0.75


def test_the_root_unit_is_not_gathered_in_backward():
    """Gathered once: a forward gather and a reduce-scatter, 2·(N-1)·e·L = 6,144 B."""
    got = zv.step_traffic("ZeRO-3", [zv.Unit(512, 2048, twice=False)], zv.Cluster(4, 2, 128))
    assert got["ranks"] == [(6144, 0), (0, 6144)]


def test_one_node_sends_nothing_across_and_one_rank_per_node_everything():
    one = zv.step_traffic("ZeRO++", [zv.Unit(512, 2048)], zv.Cluster(4, 4, block=128))
    assert all(inter == 0 for _, inter in one["ranks"])
    apart = zv.step_traffic("ZeRO-3", [zv.Unit(512, 2048)], zv.Cluster(4, 1, block=128))
    assert apart["ranks"] == [(0, 9216)]


def test_the_limits_are_the_claim_plus_the_scales():
    """3M for ZeRO-3; 0.75M + 4M/B for ZeRO++, so 0.75M exactly only without scales; qwZ alone
    2·(1/2 + 2/B) + 1 = 2M + 4M/B, both gathers quantized (below its claim of 2.5M)."""
    assert sum(zv.limit("ZeRO-3", 256)) == 3
    assert sum(zv.limit("hpZ", 256)) == 2
    assert zv.limit("qwZ", 256) == (Fraction(1, 2) + Fraction(2, 256),) * 2 + (1,)
    assert sum(zv.limit("qwZ", 256)) == 2 + Fraction(4, 256)
    assert sum(zv.limit("qgZ", 256)) == Fraction(9, 4) + Fraction(2, 256)
    assert sum(zv.limit("ZeRO++", 256)) == Fraction(3, 4) + Fraction(4, 256)
    assert sum(zv.limit("ZeRO++", 2**40)) - Fraction(3, 4) < Fraction(1, 2**37)
    assert zv.claim("ZeRO++") == (0.5, 0.0, 0.25) and sum(zv.claim("ZeRO++")) == 0.75
    assert zv.claim("qwZ") == (0.5, 1.0, 1.0) and zv.claim("ZeRO-3") == (1.0, 1.0, 1.0)


def test_many_nodes_approach_the_limit_by_the_stated_factors():
    """N = 4,096 as 256 x 16, B = 64 dividing L: the node's bytes are exactly
    (N-1)/N·(1/2 + 2/B)·M + (k-1)/k·(1/4 + 2/B)·M."""
    n, r, b, shard = 4096, 16, 64, 64 * 3
    got = zv.step_traffic("ZeRO++", [zv.Unit(shard, n * shard)], zv.Cluster(n, r, block=b))
    want = Fraction(n - 1, n) * Fraction(17, 32) + Fraction(255, 256) * Fraction(9, 32)
    assert Fraction(got["node_inter"], got["m_bytes"]) == want


def test_unit_shards_follow_the_layout_rule():
    """Unit "a": 300 -> 384, 10 -> 128, extent 512 = 2 chunks of 256, N = 2: L = 256; the root
    (x, 5 -> 128): 1 chunk, L = 256."""
    units = zv.unit_shards({"a.w": 300, "a.b": 10, "x": 5}, ["a"], 2, 256)
    assert units == [zv.Unit(256, 310), zv.Unit(256, 5, twice=False)]


def test_the_printed_arrows_agree_with_the_printed_labels():
    """Labels are integers (±0.5): each arrow lies between the extreme ratios they allow."""
    arrows = [b for b in paper.ZEROPP_BARS if b.arrow]
    assert len(arrows) == 4
    for b in arrows:
        lo = (b.zeropp_tflops - 0.5) / (b.zero3_tflops + 0.5)
        hi = (b.zeropp_tflops + 0.5) / (b.zero3_tflops - 0.5)
        assert lo <= b.arrow <= hi, b


P = tm.Params(peak_fraction=0.5, half_work=1e6, overlap=0.0)


def test_equal_bandwidths_make_moving_bytes_between_links_change_nothing():
    hw = replace(paper.HARDWARE, nvswitch_bytes_s=25e9, node_bytes_s=25e9)
    moved = tm.two_link_seconds(3e9, 1e9, P, hw)
    assert moved == pytest.approx(tm.two_link_seconds(1e9, 3e9, P, hw), rel=1e-15)
    assert moved == pytest.approx(4e9 / 25e9, rel=1e-15)
    fast_inside = replace(hw, nvswitch_bytes_s=300e9)
    assert tm.two_link_seconds(3e9, 1e9, P, fast_inside) < tm.two_link_seconds(1e9, 3e9, P, hw)


def _speedup(p, hw, gpus=384):
    return (
        zm.terms("ZeRO-3", label="18B", tokens=1024, gpus=gpus, hw=hw, p=p)["step_s"]
        / zm.terms("ZeRO++", label="18B", tokens=1024, gpus=gpus, hw=hw, p=p)["step_s"]
    )


def test_a_communication_bound_step_speeds_up_by_the_inter_node_ratio():
    """No compute, no optimizer, free intra-node links: the speedup is ZeRO-3's inter-node bytes
    over ZeRO++'s, near 3/0.75 = 4 at 384 GPUs (scales and finite N, k bring it under)."""
    hw = replace(paper.HARDWARE, peak_flops=1e30, hbm_bytes_s=1e30, nvswitch_bytes_s=1e30)
    p = tm.Params(peak_fraction=1.0, half_work=0.0, overlap=0.0)
    base = zm.terms("ZeRO-3", label="18B", tokens=1024, gpus=384, hw=hw, p=p)
    plus = zm.terms("ZeRO++", label="18B", tokens=1024, gpus=384, hw=hw, p=p)
    assert _speedup(p, hw) == pytest.approx(base["inter_bytes"] / plus["inter_bytes"], rel=1e-9)
    assert 3.9 < _speedup(p, hw) < 4


def test_hidden_or_free_communication_gives_no_speedup():
    hidden = tm.Params(peak_fraction=0.5, half_work=1e6, overlap=1.0)
    assert _speedup(hidden, paper.HARDWARE) == pytest.approx(1, rel=1e-12)
    free = replace(paper.HARDWARE, nvswitch_bytes_s=1e30, node_bytes_s=1e30)
    assert _speedup(P, free) == pytest.approx(1, rel=1e-9)


def test_a_slower_inter_node_link_gives_a_larger_speedup():
    slow, fast = (replace(paper.HARDWARE, node_bytes_s=g * 1e9 / 8) for g in (100, 800))
    assert _speedup(P, slow) > _speedup(P, fast) > 1
