"""The counted rows of ZeRO++'s volume table (paper_figures/zeropp_volume.py): a stage-3 step of
its GPT on four gloo ranks simulated as two nodes of two sends, per rank and link, the bytes
derived here by hand, which are also what the table's analytic rows say: ZeRO-3, and hpZ
(ZeroConfig.hpz), the one ZeRO++ technique the engine has.

Legend: N = 4 ranks, R = 2 per node, k = 2 nodes, C = 128-element chunks, L_u a unit's shard,
e = 2 bytes (bf16), M = N micro-batches (one micro-step per rank).
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
