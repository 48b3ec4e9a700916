"""Traffic per link on real gloo ranks: a stage-3 step of four ranks simulated as 2 nodes x 2
(ZeroConfig.ranks_per_node=2) sends, from each node's last rank, exactly the 3Ψ volume of the
ring across nodes ([Note: traffic per link] in zero/common/traffic.py), derived here by hand from
the model's parameter count; and a layout that differs between ranks is refused at construction.

Legend: N = 4 ranks, R = 2 per node, k = M/N micro-steps per rank, C = 128-element chunks, L_u a
unit's shard length, Ψ_padded = N·ΣL_u.
"""

from __future__ import annotations

import pytest
from engine_tools import one_step

from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.local import get_pool
from zero.workloads.models import MLP, MLPConfig

pytestmark = pytest.mark.timeout(300)

N, K = 4, 2
UNITS = ("layers.0", "layers.1", "layers.2")


def stage3_step(rank, n, ranks_per_node):
    """One stage-3 step of the MLP 16 -> 48 -> 48 -> 4, every layer a unit (no root), fp32,
    M = N·K; what the counter says of it, per link and kind."""
    model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3))
    cfg = ZeroConfig(
        stage=3, micro_batches=n * K, units=UNITS, chunk=128, ranks_per_node=ranks_per_node
    )
    eng = ZeroEngine(model, cfg)
    one_step(eng, model, rank, n, K)
    step = eng.counter.step - 1
    ring = [r for r in eng.counter.of_step(step) if r.op in ("all_gather", "reduce_scatter")]
    return {
        "units": [u.name for u in eng.units],
        "params": sum(p.numel() for p in model.parameters()),
        "links": eng.counter.link_volume(step),
        "nbytes": sum(r.nbytes for r in eng.counter.of_step(step)),
        "ring_only": len(ring) == len(eng.counter.of_step(step)),
        "control": eng.counter.link_volume(step, kind="control"),
        "control_nbytes": sum(r.nbytes for r in eng.counter.of_step(step, kind="control")),
    }


def analytic_bytes() -> int:
    """The bytes one rank sends per step at stage 3, by hand from the layers' shapes.

    Each parameter's offset is aligned to 128 elements and a unit is whole 128-element chunks
    (reference/layout.py), split in N shards of L = ceil(chunks / N)·128:
      layers.0  16 -> 48: weight 768 (6 x 128), bias 48 (one 128)  -> 896 = 7 chunks  -> L = 256
      layers.1  48 -> 48: weight 2304 (18 x 128), bias 48 (128)    -> 2432 = 19 chunks -> L = 640
      layers.2  48 -> 4:  weight 192 (2 x 128), bias 4 (128)       -> 384 = 3 chunks  -> L = 128
    ΣL = 1024, Ψ_padded = N·ΣL = 4096 (of which 3,364 are parameters). Stage 3 sends per unit and
    micro-step a forward all-gather, a backward all-gather and a reduce-scatter, each (N-1)·L
    elements from every rank (the ring's N-1 chunks): 3·(N-1)/N·Ψ_padded = 9,216 elements, k = 2
    micro-steps, 4 bytes each (fp32)."""
    shard_sum, psi_padded = 256 + 640 + 128, N * (256 + 640 + 128)
    assert 3 * (N - 1) * shard_sum == 3 * (N - 1) * psi_padded // N == 9216
    return 3 * (N - 1) * shard_sum * K * 4


@pytest.mark.dist
def test_stage3_inter_node_bytes_are_the_rings_3psi():
    """2 x 2: the ring 0 -> 1 -> 2 -> 3 -> 0 crosses nodes at 1 -> 2 and 3 -> 0, so ranks 1 and 3
    send the whole per-step volume inter-node (73,728 B) and ranks 0 and 2 all of it intra-node;
    all ranks together 2 x 73,728 B cross per step. The same step on one node (the default) and
    on four nodes of one rank (every ring step crosses) bracket it."""
    want = analytic_bytes()
    assert want == 73728
    pool = get_pool(N)
    two = pool.run(stage3_step, 2)
    assert two[0]["units"] == list(UNITS)  # no root unit: every layer is gathered twice
    assert two[0]["params"] == 768 + 48 + 2304 + 48 + 192 + 4
    assert [r["links"] for r in two] == [(want, 0), (0, want), (want, 0), (0, want)]
    assert sum(r["links"][1] for r in two) == 2 * want
    for r in two:
        assert r["ring_only"] and r["nbytes"] == want  # the counted bytes, split without loss
        # the step's control exchange (an all-gather) follows the same ring
        intra, inter = r["control"]
        assert intra + inter == r["control_nbytes"] > 0
    assert [r["control"][1] > 0 for r in two] == [False, True, False, True]
    one = pool.run(stage3_step, None)
    assert [r["links"] for r in one] == [(want, 0)] * N
    four = pool.run(stage3_step, 1)
    assert [r["links"] for r in four] == [(0, want)] * N


def subgroup_gathers(rank, n):
    """An all-gather of 10 fp32 elements in the subgroups {0, 2} and {1, 3} (one rank on each
    node of 2 x 2) and in {0, 1} and {2, 3} (one node each), counted with the 2 x 2 layout."""
    import torch
    import torch.distributed as dist

    from zero import collectives as C
    from zero.common.traffic import NodeLayout

    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    within = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for name, groups in (("across", across), ("within", within)):
        group = next(g for g in groups if rank in dist.get_process_group_ranks(g))
        counter = C.CommCounter()
        counter.layout = NodeLayout(n, 2)
        shard = torch.full((10,), float(rank))
        got = torch.empty(20)
        tag = {"phase": "p", "kind": "model", "unit": 0}
        C.all_gather(got, shard, group=group, counter=counter, padding=0, tag=tag).wait()
        out[name] = counter.link_volume()
    return out


@pytest.mark.dist
def test_a_subgroup_is_split_by_its_own_members_nodes():
    """A group's ring runs over its members in group order: {0, 2} and {1, 3} send their one
    chunk (40 B) across nodes, {0, 1} and {2, 3} within one."""
    got = get_pool(N).run(subgroup_gathers)
    assert [r["across"] for r in got] == [(0, 40)] * N
    assert [r["within"] for r in got] == [(40, 0)] * N


def differing_layout(rank, n):
    """Ranks 0-1 configured as 2 x 2, ranks 2-3 as one node of 4: refused, on every rank, by the
    construction's first exchange."""
    cfg = ZeroConfig(stage=1, micro_batches=n, ranks_per_node=2 if rank < 2 else 4)
    try:
        ZeroEngine(MLP(MLPConfig(n_layer=1)), cfg)
    except ValueError as exc:
        return str(exc)
    return "built"


def not_dividing(rank, n):
    try:
        ZeroEngine(MLP(MLPConfig(n_layer=1)), ZeroConfig(micro_batches=n, ranks_per_node=3))
    except ValueError as exc:
        return str(exc)
    return "built"


@pytest.mark.dist
def test_a_layout_that_differs_between_ranks_or_does_not_divide_n_is_refused():
    pool = get_pool(N)
    got = pool.run(differing_layout)
    assert (
        got
        == [
            "ranks_per_node: rank 2 has 4, rank 0 has 2; the node layout must be the same on every "
            "rank (every node runs as many ranks)"
        ]
        * N
    )
    assert (
        pool.run(not_dividing)
        == [
            "ranks_per_node=3: must divide the world size 4 (every node holds the same number of "
            "ranks)"
        ]
        * N
    )
