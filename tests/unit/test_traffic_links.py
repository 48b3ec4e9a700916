"""Traffic per link ([Note: traffic per link] in zero/common/traffic.py): the bytes each rank sends
within its node and across nodes, for every collective kind, at N = 4 as 2 x 2 and N = 8 as 2 x 4.

The expected splits are written out by hand below from the algorithms as the Note states them,
never computed by the code's own formula: a ring sends all of member i's chunks to member i + 1,
a broadcast is a chain from member 0, an all-to-all sends chunk j straight to member j.

Legend: L = 10 fp32 elements per chunk, so a chunk is 40 bytes; R ranks per node.
"""

from __future__ import annotations

import pytest

from zero.common.traffic import CommCounter, NodeLayout, link_bytes

CHUNK = 40  # bytes: L = 10 fp32 elements

# The bytes each rank's record counts (nbytes), by op, at world size n: a ring all-gather or
# reduce-scatter sends N-1 chunks, an all-reduce 2(N-1), an all-to-all N-1 (one to each other
# rank); a broadcast's record counts the payload (one chunk) on every rank.
NBYTES = {
    "all_gather": lambda n: (n - 1) * CHUNK,
    "reduce_scatter": lambda n: (n - 1) * CHUNK,
    "all_reduce": lambda n: 2 * (n - 1) * CHUNK,
    "broadcast": lambda n: CHUNK,
    "all_to_all": lambda n: (n - 1) * CHUNK,
}

# 2 x 2: nodes [0, 0, 1, 1]. Ring 0 -> 1 -> 2 -> 3 -> 0: the steps 1 -> 2 and 3 -> 0 cross, so
# ranks 1 and 3 send every chunk inter-node (3 chunks: 120 B; all-reduce 6 chunks: 240 B), ranks
# 0 and 2 everything intra-node. Broadcast chain 0 -> 1 -> 2 -> 3: rank 0 sends intra, rank 1
# inter (1 -> 2), rank 2 intra, rank 3 (last) nothing. All-to-all: each rank has 1 peer on its
# own node and 2 on the other: 40 B intra, 80 B inter.
TWO_BY_TWO = {
    "all_gather": [(120, 0), (0, 120), (120, 0), (0, 120)],
    "reduce_scatter": [(120, 0), (0, 120), (120, 0), (0, 120)],
    "all_reduce": [(240, 0), (0, 240), (240, 0), (0, 240)],
    "broadcast": [(40, 0), (0, 40), (40, 0), (0, 0)],
    "all_to_all": [(40, 80), (40, 80), (40, 80), (40, 80)],
}

# 2 x 4: nodes [0, 0, 0, 0, 1, 1, 1, 1]. The ring crosses at 3 -> 4 and 7 -> 0: ranks 3 and 7
# send their 7 chunks (280 B; all-reduce 14: 560 B) inter-node, the rest intra. Broadcast chain
# 0 -> ... -> 7: rank 3 sends inter (3 -> 4), rank 7 nothing, the others intra. All-to-all: 3
# peers on the own node (120 B), 4 on the other (160 B).
TWO_BY_FOUR = {
    "all_gather": [(280, 0)] * 3 + [(0, 280)] + [(280, 0)] * 3 + [(0, 280)],
    "reduce_scatter": [(280, 0)] * 3 + [(0, 280)] + [(280, 0)] * 3 + [(0, 280)],
    "all_reduce": [(560, 0)] * 3 + [(0, 560)] + [(560, 0)] * 3 + [(0, 560)],
    "broadcast": [(40, 0)] * 3 + [(0, 40)] + [(40, 0)] * 3 + [(0, 0)],
    "all_to_all": [(120, 160)] * 8,
}

LAYOUTS = [
    pytest.param(NodeLayout(4, 2), [0, 0, 1, 1], TWO_BY_TWO, id="2x2"),
    pytest.param(NodeLayout(8, 4), [0, 0, 0, 0, 1, 1, 1, 1], TWO_BY_FOUR, id="2x4"),
]


def split_on(layout: NodeLayout, op: str, me: int) -> tuple[int, int]:
    """One record of `op`, counted by a counter that knows `layout`, split for member `me` of
    the world group: what the engine's collectives do at launch (zero/ranks/nodes.py's place)."""
    counter = CommCounter()
    counter.layout = layout
    nbytes = NBYTES[op](layout.world_size)
    rec = counter.add(
        op=op, phase="p", kind="model", unit=0, elements=nbytes // 4, padding=0, nbytes=nbytes
    )
    assert rec.layout is layout
    rec.place([layout.node(r) for r in range(layout.world_size)], me)
    return rec.intra_bytes, rec.inter_bytes


@pytest.mark.parametrize(("layout", "nodes", "table"), LAYOUTS)
@pytest.mark.parametrize("op", list(NBYTES))
def test_each_collective_splits_as_derived_by_hand(layout, nodes, table, op):
    assert [layout.node(r) for r in range(layout.world_size)] == nodes  # node-major
    got = [split_on(layout, op, r) for r in range(layout.world_size)]
    assert got == table[op]


@pytest.mark.parametrize(("layout", "nodes", "table"), LAYOUTS)
def test_ring_crossings_are_one_per_node(layout, nodes, table):
    """Summed over ranks, a ring collective sends (number of nodes) x (one rank's bytes) across
    nodes: 2 x 120 B at 2 x 2, 2 x 280 B at 2 x 4; a ring op's two parts add up to nbytes."""
    n = layout.world_size
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        inter = sum(b for _, b in table[op])
        assert inter == 2 * NBYTES[op](n)
        assert all(a + b == NBYTES[op](n) for a, b in table[op])
    # the chain moves the payload N-1 times in all, once across the node boundary
    assert sum(a + b for a, b in table["broadcast"]) == (n - 1) * CHUNK
    assert sum(b for _, b in table["broadcast"]) == CHUNK


def test_one_node_sends_everything_intra_and_one_rank_nothing():
    """ranks_per_node = N (the default layout): nothing crosses; N = 1: nothing moves."""
    for op in NBYTES:
        for me in range(4):
            intra, inter = link_bytes(op, NBYTES[op](4), [0, 0, 0, 0], me)
            assert inter == 0
            assert intra == (0 if op == "broadcast" and me == 3 else NBYTES[op](4))
        assert link_bytes(op, 0, [0], 0) == (0, 0)


def test_one_rank_per_node_sends_everything_inter():
    """4 x 1: every ring step crosses; an all-to-all's every chunk does."""
    nodes = [0, 1, 2, 3]
    assert link_bytes("all_gather", 120, nodes, 0) == (0, 120)
    assert link_bytes("all_to_all", 120, nodes, 2) == (0, 120)


def test_a_record_never_launched_sends_nothing_on_either_link():
    counter = CommCounter()
    counter.layout = NodeLayout(4, 2)
    rec = counter.add(
        op="all_gather", phase="p", kind="model", unit=0, elements=30, padding=0, nbytes=120
    )
    assert (rec.intra_bytes, rec.inter_bytes) == (0, 0)


def test_totals_per_link_are_exact_after_records_are_dropped():
    """Three steps of one all-gather each on rank 1 of 2 x 2 (inter-node, 120 B) and a control
    broadcast (rank 1 -> 2 crosses: 40 B); the counter keeps one step, yet the totals per link
    are the three steps' sums, and the older fields (calls, elements, padding, nbytes) are as
    before."""
    counter = CommCounter(keep_steps=1)
    counter.layout = layout = NodeLayout(4, 2)
    nodes = [layout.node(r) for r in range(4)]
    for step in range(3):
        counter.step = step
        rec = counter.add(
            op="all_gather", phase="g", kind="model", unit=0, elements=30, padding=3, nbytes=120
        )
        rec.place(nodes, 1)
        rec = counter.add(
            op="broadcast", phase="b", kind="control", unit=None, elements=10, padding=0, nbytes=40
        )
        rec.place(nodes, 1)
    assert counter.dropped_below == 2
    assert counter.link_totals == {
        ("model", "all_gather", "g"): [0, 360],
        ("control", "broadcast", "b"): [0, 120],
    }
    assert counter.total_links("model") == {"intra": 0, "inter": 360}
    assert counter.total_links("control", phase="b") == {"intra": 0, "inter": 120}
    assert counter.total_links("control", phase="g") == {"intra": 0, "inter": 0}
    assert counter.link_volume(2) == (0, 120)
    assert counter.totals[("model", "all_gather", "g")] == [3, 90, 9, 360]
    with pytest.raises(ValueError, match="step=1"):
        counter.link_volume(1)


def test_an_op_without_a_link_model_is_refused_by_name():
    with pytest.raises(ValueError, match=r"op='d2h': no link model; allowed are"):
        link_bytes("d2h", 8, [0, 0], 0)
    with pytest.raises(ValueError, match=r"me=2: must be a member index in \[0, 2\)"):
        link_bytes("all_gather", 8, [0, 0], 2)
