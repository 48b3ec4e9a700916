"""The counted rows of ZeRO++'s volume table (paper_figures/zeropp_volume.py): a stage-3 step of
its GPT on four gloo ranks simulated as two nodes of two sends, per rank and link, the bytes
derived here by hand, which are also what the table's analytic rows say: ZeRO-3, hpZ, qwZ, qgZ
and the three together (ZeRO++).

Legend: N = 4 ranks, R = 2 per node, k = 2 nodes, C = 128-element chunks, L_u a unit's shard,
e = 2 bytes (bf16), M = N micro-batches (one micro-step per rank), B = 128 the quantization
block, q_b(n) = n·b/8 + 4·n/B the bytes of n values quantized to b bits with their fp32 scales.
"""

from __future__ import annotations

import pytest

from paper_figures import zeropp_volume as zv
from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(300)

N, R = 4, 2


def hand_bytes() -> tuple[int, int, int]:
    """(L of a block, L of the root, the bytes every rank sends in one step), by hand.

    GPT(vocab 64, block 32, 4 layers, n_embd 64), every offset aligned to 128 elements:
      a block: ln_1 64 + 64 -> 128 + 128; c_attn 12,288 + 192 -> 12,288 + 256; c_proj 4,096 +
      64 -> 4,096 + 128; ln_2 -> 128 + 128; c_fc 16,384 + 256; mlp c_proj 16,384 + 64 -> 128:
      50,432 = 394 chunks, L = ceil(394/4)·128 = 12,672 (Ψ_block = 49,984)
      the root: wte 4,096, wpe 2,048, ln_f 64 + 64 -> 128 + 128: 6,400 = 50 chunks,
      L = ceil(50/4)·128 = 1,664 (Ψ_root = 6,272)
    Each rank sends (N-1)·L per collective: per block a forward gather, a backward gather and a
    reduce-scatter, the root (kept gathered to the end of backward) a gather and a
    reduce-scatter: 3·(3·4·12,672 + 2·1,664) = 466,176 elements, 932,352 bytes."""
    block, root = 99 * 128, 13 * 128
    return block, root, 2 * (N - 1) * (3 * 4 * block + 2 * root)


@pytest.mark.dist
def test_two_simulated_nodes_count_the_hand_derived_bytes_per_link():
    """Ranks 0 -> 1 -> 2 -> 3 -> 0: ranks 1 and 3 send every ring byte to the other node, ranks
    0 and 2 inside theirs; the table's analytic row says the same."""
    block, root, want = hand_bytes()
    assert want == 932352
    got = get_pool(N).run(zv.counted_step, R, timeout_s=240)
    assert [r["links"] for r in got] == [[want, 0], [0, want], [want, 0], [0, want]]
    assert all(r["nbytes"] == want and r["ops"] == ["all_gather", "reduce_scatter"] for r in got)
    units = zv.model_units(N)
    assert [(u.shard, u.twice) for u in units] == [(block, True)] * 4 + [(root, False)]
    exact = zv.step_traffic("ZeRO-3", units, zv.Cluster(N, R))
    assert exact["ranks"] == [(want, 0), (0, want)]
    assert exact["m_bytes"] == 2 * (4 * 49984 + 6272)


@pytest.mark.dist
def test_hpz_keeps_the_backward_gather_inside_each_node():
    """hpZ: each block's backward gather becomes a ring of the node's two ranks over secondary
    shards of k·L = 2·12,672 elements: (R-1)·2·25,344 = 50,688 B per block, 202,752 B in all,
    intra-node on every rank. What is left on the world ring, 628,224 B, is the forward gathers
    and reduce-scatters, 2·(N-1)·2·(4·12,672 + 1,664), all inter-node from ranks 1 and 3."""
    block, root, _ = hand_bytes()
    inside = (R - 1) * 2 * (N // R) * block * 4
    ring = 2 * (N - 1) * 2 * (4 * block + root)
    assert (inside, ring) == (202752, 628224)
    got = get_pool(N).run(zv.counted_step, R, zv.ENGINE_FLAGS["hpZ"], timeout_s=240)
    want = [[ring + inside, 0], [inside, ring]] * 2
    assert [r["links"] for r in got] == want
    exact = zv.step_traffic("hpZ", zv.model_units(N), zv.Cluster(N, R))
    assert [list(x) for x in exact["ranks"]] == want[:2]


def q(n: int, bits: int) -> int:
    """q_b(n) by hand: n values of b bits, one 4-byte scale per 128 (B divides n here)."""
    assert n % 128 == 0
    return n * bits // 8 + 4 * (n // 128)


def _counted(scheme: str) -> list[list[int]]:
    got = get_pool(N).run(zv.counted_step, R, zv.ENGINE_FLAGS[scheme], timeout_s=240)
    return [r["links"] for r in got]


def _analytic(scheme: str) -> list[list[int]]:
    exact = zv.step_traffic(scheme, zv.model_units(N), zv.Cluster(N, R, block=128))
    return [list(x) for x in exact["ranks"]] * (N // R)


@pytest.mark.dist
def test_qwz_quantizes_both_gathers_on_the_world_ring():
    """qwZ int8: every gather (each block's forward and backward, the root's forward) sends
    (N-1)·q_8(L) = 3·L·33/32 bytes on the world ring (block 3·13,068, root 3·1,716): 318,780 B;
    the reduce-scatters stay bf16, 2·3·(4·12,672 + 1,664) = 314,112 B. Ranks 1 and 3 send it all
    across nodes, ranks 0 and 2 inside theirs."""
    block, root, _ = hand_bytes()
    assert (q(block, 8), q(root, 8)) == (13068, 1716)
    ring = 3 * (8 * q(block, 8) + q(root, 8)) + 2 * 3 * (4 * block + root)
    assert ring == 632892
    want = [[ring, 0], [0, ring]] * 2
    assert _counted("qwZ") == want
    assert _analytic("qwZ") == want


@pytest.mark.dist
def test_qgz_sends_two_int4_hops_inside_then_across_nodes():
    """qgZ int4, per unit on every rank: hop 1 to its R-1 = 1 node peer, q_4(k·L) =
    2·L·17/32 bytes inside the node (block 13,464, root 1,768: 55,624 B in all); hop 2 to
    the k-1 = 1 other node, q_4(L) = L·17/32 across (block 6,732, root 884: 27,812 B). The
    gathers stay bf16 on the world ring: 2·3·(8·12,672 + 1,664) = 618,240 B."""
    block, root, _ = hand_bytes()
    inside = 4 * q(2 * block, 4) + q(2 * root, 4)
    across = 4 * q(block, 4) + q(root, 4)
    ring = 2 * 3 * (8 * block + root)
    assert (inside, across, ring) == (55624, 27812, 618240)
    want = [[ring + inside, across], [inside, ring + across]] * 2
    assert _counted("qgZ") == want
    assert _analytic("qgZ") == want


@pytest.mark.dist
def test_zeropp_crosses_nodes_only_with_int8_forward_gathers_and_int4_second_hops():
    """ZeRO++ (qwZ int8 + hpZ + qgZ int4): the forward gathers on the world ring, quantized,
    3·(4·13,068 + 1,716) = 161,964 B from ranks 1 and 3 across nodes; hpZ's bf16 backward
    gathers inside the node, (R-1)·2·k·L per block, 202,752 B; qgZ's hops as above, 55,624 B
    inside and 27,812 B across, on every rank."""
    block, root, _ = hand_bytes()
    ring = 3 * (4 * q(block, 8) + q(root, 8))
    hpz = (R - 1) * 2 * (N // R) * block * 4
    inside, across = 4 * q(2 * block, 4) + q(2 * root, 4), 4 * q(block, 4) + q(root, 4)
    assert (ring, hpz) == (161964, 202752)
    want = [[ring + hpz + inside, across], [hpz + inside, ring + across]] * 2
    assert want[:2] == [[420340, 27812], [258376, 189776]]
    assert _counted("ZeRO++") == want
    assert _analytic("ZeRO++") == want
