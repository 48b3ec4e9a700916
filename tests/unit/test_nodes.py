"""The node layout (zero/ranks/nodes.py): found from ZeroConfig.ranks_per_node or, under torchrun,
the launcher's LOCAL_WORLD_SIZE and GROUP_RANK; node-major; refused by name where it does not
divide the world, disagrees with the launcher or differs between ranks."""

from __future__ import annotations

import pytest

from zero.common.traffic import NodeLayout
from zero.config import ZeroConfig
from zero.ranks.nodes import check_rows, resolve


def torchrun_env(rank: int, local_world: int, group_rank: int) -> dict[str, str]:
    """What torchrun sets in a worker (the variables nodes.py reads, and those that say it)."""
    return {
        "TORCHELASTIC_RUN_ID": "t",
        "RANK": str(rank),
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group_rank),
    }


def test_a_local_world_is_one_node_unless_told():
    assert resolve(None, rank=3, world_size=4, env={}) == (NodeLayout(4, 4), 0)
    assert resolve(2, rank=3, world_size=4, env={}) == (NodeLayout(4, 2), 1)
    layout, node = resolve(4, rank=5, world_size=8, env={})
    assert (layout.nodes, node, [layout.node(r) for r in range(8)]) == (2, 1, [0] * 4 + [1] * 4)


def test_torchrun_sets_the_layout_and_refuses_a_config_that_disagrees():
    env = torchrun_env(rank=2, local_world=2, group_rank=1)
    assert resolve(None, rank=2, world_size=4, env=env) == (NodeLayout(4, 2), 1)
    assert resolve(2, rank=2, world_size=4, env=env) == (NodeLayout(4, 2), 1)
    with pytest.raises(ValueError) as e:
        resolve(4, rank=2, world_size=4, env=env)
    assert str(e.value) == (
        "ranks_per_node=4: under torchrun the launcher sets it (LOCAL_WORLD_SIZE=2); "
        "allowed are None or 2"
    )
    uneven = {**env, "LOCAL_WORLD_SIZE": "3"}  # 3 + 1: torchrun's nodes of unequal sizes
    with pytest.raises(ValueError) as e:
        resolve(None, rank=2, world_size=4, env=uneven)
    assert str(e.value) == (
        "LOCAL_WORLD_SIZE=3: must divide the world size 4 (every node runs as many ranks; "
        "torchrun --nproc-per-node the same on every node)"
    )
    bad = {**env, "LOCAL_WORLD_SIZE": "two"}
    with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE='two': must be an integer >= 1"):
        resolve(None, rank=2, world_size=4, env=bad)


def test_ranks_per_node_must_divide_the_world():
    with pytest.raises(ValueError) as e:
        resolve(3, rank=0, world_size=4, env={})
    assert str(e.value) == (
        "ranks_per_node=3: must divide the world size 4 (every node holds the same number of ranks)"
    )
    with pytest.raises(ValueError, match=r"^ranks_per_node=8: must divide the world size 4"):
        resolve(8, rank=0, world_size=4, env={})


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "2"])
def test_the_config_refuses_what_is_not_a_positive_integer(value):
    with pytest.raises(ValueError) as e:
        ZeroConfig(ranks_per_node=value)
    assert str(e.value) == f"ranks_per_node={value!r}: must be None or an integer >= 1"


def test_every_rank_must_report_one_layout():
    check_rows([[0, 2, 0], [1, 2, 0], [2, 2, 1], [3, 2, 1]])  # 2 x 2, agreed
    with pytest.raises(ValueError) as e:
        check_rows([[0, 2, 0], [1, 2, 0], [2, 4, 0], [3, 4, 0]])
    assert str(e.value) == (
        "ranks_per_node: rank 2 has 4, rank 0 has 2; the node layout must be the same on every "
        "rank (every node runs as many ranks)"
    )
    with pytest.raises(ValueError) as e:  # a launcher numbering the ranks across nodes
        check_rows([[0, 2, 0], [1, 2, 1], [2, 2, 0], [3, 2, 1]])
    assert str(e.value) == (
        "node: rank 1 reports node 1, but ranks are node-major and with ranks_per_node=2 it is "
        "on node 0"
    )
