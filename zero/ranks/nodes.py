"""Nodes: which machine each rank runs on, found once at construction, and every collective's
bytes split by link ([Note: traffic per link] in zero/common/traffic.py).

Legend: N the world size, R ranks per node, N/R nodes. Ranks are node-major: rank r is on node
r // R, which is how torchrun numbers them (a node's ranks are consecutive, the nodes in
GROUP_RANK order).
- Under torchrun, R is the launcher's LOCAL_WORLD_SIZE and a rank's node its GROUP_RANK; a
  configured ZeroConfig.ranks_per_node that differs is refused.
- Elsewhere (spawn, WorkerPool, a simulated rank) R is ZeroConfig.ranks_per_node, None meaning
  every rank on one node, so that one machine simulates 2 x 2 or 2 x 4.
The engine exchanges every rank's (rank, R, node) once, in its construction's first agreement
exchange (zero/build.py's check_ranks_agree), and check_rows refuses a layout that differs
between ranks or is not node-major.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ..common.traffic import CommRecord, NodeLayout

_ONE_NODE = NodeLayout(1, 1)  # a record counted without a layout: every member on node 0


def check_ranks_per_node(value: object) -> None:
    """ZeroConfig.ranks_per_node: None or an integer >= 1 (not a bool, not 2.0)."""
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"ranks_per_node={value!r}: must be None or an integer >= 1")


def _env_int(env, key: str) -> int:
    text = env[key]
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or (key == "LOCAL_WORLD_SIZE" and value < 1):
        low = 1 if key == "LOCAL_WORLD_SIZE" else 0
        raise ValueError(f"{key}={text!r}: must be an integer >= {low} (torchrun sets it)")
    return value


def _from_launcher(env) -> bool:
    """Whether torchrun (or a launcher like it) started this process and said how many ranks
    share its node."""
    launched = "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)
    return launched and "LOCAL_WORLD_SIZE" in env


def resolve(
    ranks_per_node: int | None, *, rank: int, world_size: int, env=None
) -> tuple[NodeLayout, int]:
    """(the world's NodeLayout, the node this rank reports) from the configured ranks_per_node
    and, under torchrun, the launcher's LOCAL_WORLD_SIZE and GROUP_RANK. Refuses, by name, a
    ranks_per_node that does not divide the world size or disagrees with the launcher."""
    env = os.environ if env is None else env
    if _from_launcher(env):
        local = _env_int(env, "LOCAL_WORLD_SIZE")
        if ranks_per_node is not None and ranks_per_node != local:
            raise ValueError(
                f"ranks_per_node={ranks_per_node!r}: under torchrun the launcher sets it "
                f"(LOCAL_WORLD_SIZE={local}); allowed are None or {local}"
            )
        if world_size % local:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={local}: must divide the world size {world_size} (every node "
                "runs as many ranks; torchrun --nproc-per-node the same on every node)"
            )
        layout = NodeLayout(world_size, local)
        node = _env_int(env, "GROUP_RANK") if "GROUP_RANK" in env else layout.node(rank)
        return layout, node
    layout = NodeLayout(world_size, world_size if ranks_per_node is None else ranks_per_node)
    return layout, layout.node(rank)


def check_rows(rows: list[list[int]]) -> None:
    """Refuse (ValueError, one line) a node layout that differs between ranks: rows holds every
    rank's [rank, ranks_per_node, node], in group order, as the construction exchange gathered
    them. Every rank must report group rank 0's ranks_per_node, and the node that node-major
    numbering gives its rank."""
    first = rows[0][1]
    for rank, per_node, node in rows:
        if per_node != first:
            raise ValueError(
                f"ranks_per_node: rank {rank} has {per_node}, rank {rows[0][0]} has {first}; "
                "the node layout must be the same on every rank (every node runs as many ranks)"
            )
        if node != rank // per_node:
            raise ValueError(
                f"node: rank {rank} reports node {node}, but ranks are node-major and with "
                f"ranks_per_node={per_node} it is on node {rank // per_node}"
            )


def place(rec: CommRecord | None, group) -> None:
    """Split rec's bytes by link for its group ([Note: traffic per link]): called as the
    collective launches (zero/collectives.py's launch, the watchdog's checks), the one point
    where both the record and its group are known. None: an uncounted collective."""
    if rec is None:
        return
    n, me = dist.get_world_size(group), dist.get_rank(group)
    layout = rec.layout or _ONE_NODE
    if layout.nodes == 1:
        rec.place((0,) * n, me)
        return
    if group is None or group is dist.group.WORLD:
        members = range(n)
    else:
        members = dist.get_process_group_ranks(group)
    rec.place([layout.node(r) for r in members], me)
