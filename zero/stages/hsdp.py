"""Hierarchical sharding (FSDP2's HSDP, DeepSpeed's MiCS; ZeroConfig.shard_group_size): the
model states are sharded inside groups of G consecutive ranks and replicated across the K = N/G
groups (docs/design.md §3.13, "Hierarchical sharding").

Legend: N ranks, G ranks per shard group (group g = ranks [g·G, (g+1)·G)), K = N/G replicas,
rank r holds shard s = r mod G of every unit, L a unit's shard length at a world of G (its padded
buffer G·L). The stages see only the shard group: StageContext's group, rank and world_size are
its own (G, s), so every partition, reduce-scatter and all-gather of stages 1-3 is a world of G.
What is left is the sum across the replicas, added where a unit's reduce-scatter completes
(Replicas.after): each replica group (the K ranks with the same s, in group order) all-reduces
the partial shards.

[Note: the sum over replicas] Deterministic mode must give the bits of plain ZeRO at N: each
micro-step's B = T(g_0, ..., g_{N-1}), the reference's tree over the N ranks in rank order
(reference/tree.py). For G a power of two dividing N, the tree over N leaves is the tree over
the K groups of the trees over G inside them: every power-of-two block of T is a whole number of
aligned groups. So the shard group's tree reduce-scatter gives T_G of group g, and the replicas
all-gather their K partials ((K-1)·L elements sent per rank, counted as an all_gather of phase
"grad_replicas") and sum them with tree_sum in group order: every replica ends with the same
bits, those of T_N. Fast mode takes the backend's all-reduce (2(K-1)/K·L per rank, ring cost).

What stays the world's: the data (rank r runs micro-batch k·N + r), the watchdog, and the step's
control exchange over the engine's group (zero/control.py): the loss, the overflow flag and the
used-parameter flags of every rank; the norm's chunk partials are cut to each unit's chunks in
rank-major order, which takes exactly the first group's rows, and every group holds all of R.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.tree import tree_sum

from .. import collectives as C
from ..unit import FlatUnit

PHASE = "grad_replicas"
"""The traffic phase of the all-reduce across replicas ([Note: the sum over replicas])."""


def check(config, world_size: int, mp) -> None:
    """What shard_group_size needs from this world (the config alone checks the rest,
    zero/config.py's check_nodes): a G that divides N, the whole world as the engine's group, no
    model parallelism. Refused by name, before any collective."""
    g = config.shard_group_size
    if g is None:
        return
    if world_size % g:
        allowed = [d for d in range(1, world_size + 1) if world_size % d == 0]
        if config.deterministic:
            allowed = [d for d in allowed if d & (d - 1) == 0]
        raise ValueError(
            f"shard_group_size={g}: must divide the world size N = {world_size} (groups of G "
            f"consecutive ranks); allowed here: {allowed} or None"
        )
    if g == world_size:  # one group of N: plain ZeRO
        return
    if mp is not None:
        raise ValueError(
            f"shard_group_size={g} with model parallelism (mp=): hierarchical sharding over a "
            "data-parallel group of a mesh is not built; allowed is shard_group_size=None"
        )
    if world_size != dist.get_world_size():
        raise ValueError(
            f"shard_group_size={g}: the engine's group has {world_size} of the world's "
            f"{dist.get_world_size()} ranks; the shard and replica groups are made over the "
            "world, so allowed only when the engine's group is the whole world"
        )


@dataclass(frozen=True)
class Sharding:
    """Who shares the model states: the shard group (group, size G, this rank's place s in it)
    and, with hierarchical sharding, the Replicas across groups (None: plain ZeRO, G = N)."""

    group: object
    size: int
    rank: int
    replicas: Replicas | None = None


def sharding(config, group, world_size: int, rank: int) -> Sharding:
    """[Note: the groups of HSDP] dist.new_group is a collective of the whole world: every rank
    creates every group, in one order (the K shard groups, then the G replica groups), and keeps
    its own two. Called after the ranks agreed on the config (zero/build.py)."""
    g = config.shard_group_size
    if g is None or g == world_size:
        return Sharding(group, world_size, rank)
    k = world_size // g
    shard = replica = None
    for i in range(k):
        made = dist.new_group(list(range(i * g, (i + 1) * g)))
        shard = made if i == rank // g else shard
    for j in range(g):
        made = dist.new_group(list(range(j, world_size, g)))
        replica = made if j == rank % g else replica
    replicas = Replicas(replica, k, config.deterministic)
    return Sharding(shard, g, rank % g, replicas)


class Replicas:
    """The K ranks that hold the same shard: the sum of their partial shards."""

    def __init__(self, group, count: int, deterministic: bool):
        self.group, self.count, self.deterministic = group, count, deterministic

    def after(self, pending, u: FlatUnit, counter, *, whole: bool = False) -> _Summed:
        """`pending` (a reduce-scatter's, or with whole=True an all-reduce's in place) with the
        sum over the replicas done when it is waited: [Note: the sum over replicas]."""
        return _Summed(pending, lambda x: self.sum(x, u, counter, whole))

    def sum(self, x: torch.Tensor, u: FlatUnit, counter, whole: bool) -> torch.Tensor:
        k, tag = self.count, {"phase": PHASE, "unit": u.index, "kind": "model"}
        if self.deterministic:  # shards only: deterministic mode never all-reduces whole units
            out = torch.empty(k * x.numel(), dtype=x.dtype, device=x.device)
            pad = (k - 1) * (x.numel() - u.part.real_elements(u.part.rank))
            C.all_gather(out, x, group=self.group, counter=counter, padding=pad, tag=tag)
            return tree_sum(list(out.view(k, x.numel()).unbind(0)))
        part = u.part
        real = part.real_elements(part.rank)
        if whole:  # every shard of the unit: a persistent stage-3 unit's whole buffer
            real = sum(part.real_elements(r) for r in range(part.world_size))
        pad = 2 * (k - 1) * ((x.numel() - real) // k)
        return C.all_reduce_sum(x, padding=pad, group=self.group, counter=counter, tag=tag).wait()


class _Summed:
    """A reduction followed by the sum over the replicas; wait() returns the summed result."""

    def __init__(self, pending, then):
        self._pending, self._then, self._result = pending, then, None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._then(self._pending.wait())
            self._pending = None
        return self._result
