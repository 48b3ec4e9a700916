"""What hierarchical sharding (ZeroConfig.shard_group_size, zero/stages/hsdp.py) must show,
from the config and the layouts alone: the collectives and memory of a world of G, and the sum
over the replicas.

Legend: N ranks, G per shard group (group g = ranks [g·G, (g+1)·G)), K = N/G replicas, s =
rank mod G the rank's shard, k = M/N micro-steps, L a unit's shard length at a world of G,
real_s the real (non-padding) elements of shard s.

Inside its group a rank is rank s of a world of G running k micro-steps a step, so every
expectation of plain ZeRO holds with (G, s) for (N, rank) and M·G/N micro-batches (`as_group`).
Besides, each reduction of a unit is summed over the K ranks holding the same shard:
    deterministic   an all-gather of the K partials, (K-1)·L elements, (K-1)·(L - real_s)
                    padding, then the tree over the K in group order (phase grad_replicas)
    fast            the backend's all-reduce, 2(K-1)·⌊L/K⌋ elements, 2(K-1)·⌊(L - real_s)/K⌋
                    padding; a persistent stage-3 unit's whole buffer (stage 0's all-reduce):
                    2(K-1)·⌊G·L/K⌋, 2(K-1)·⌊(G·L - Σ real)/K⌋
once per reduction: k per unit and step, but once at stage 1 and for persistent units in fast
mode (their gradients accumulate locally); pieces of C_B are summed whole, once per reduction.
"""

from __future__ import annotations

import dataclasses

from .expect_memory import persistent


def groups_of(config, n: int) -> int | None:
    """G where the config shards hierarchically at world size n, else None (G = N is plain)."""
    g = getattr(config, "shard_group_size", None)
    return g if g is not None and g != n else None


def shard_world(config, n: int, rank: int) -> tuple[int, int]:
    """(world size, rank) whose shards a rank holds: (G, rank mod G), or (n, rank) plain."""
    g = groups_of(config, n)
    return (n, rank) if g is None else (g, rank % g)


def as_group(config, n: int):
    """The config of a world of G with the same micro-steps per rank (M·G/N micro-batches)."""
    g = groups_of(config, n)
    return dataclasses.replace(
        config, shard_group_size=None, micro_batches=config.micro_batches // n * g
    )


def replica_traffic(config, spec, n: int, rank: int) -> dict[str, tuple]:
    """{"op:grad_replicas": (calls, elements, padding)}: the sums over the replicas of one
    step on `rank`, by the table in the module docstring."""
    g = groups_of(config, n)
    kk, s, k = n // g, rank % g, config.micro_batches // n
    calls = elements = padding = 0
    for lay in spec.layouts:
        L = lay.shard_numel(g)
        mask = lay.real_mask(g).reshape(g, L).sum(axis=1)
        whole = persistent(config, lay) and not config.deterministic
        times = 1 if whole or (config.stage == 1 and not config.deterministic) else k
        if config.deterministic:
            e, p = (kk - 1) * L, (kk - 1) * (L - int(mask[s]))
        elif whole:
            e, p = 2 * (kk - 1) * (g * L // kk), 2 * (kk - 1) * ((g * L - int(mask.sum())) // kk)
        else:
            e, p = 2 * (kk - 1) * (L // kk), 2 * (kk - 1) * ((L - int(mask[s])) // kk)
        calls, elements, padding = calls + times, elements + times * e, padding + times * p
    op = "all_gather" if config.deterministic else "all_reduce"
    return {f"{op}:grad_replicas": (calls, elements, padding)}


def ring_next(config, n: int, rank: int, phase: str) -> int:
    """The rank a ring collective of `phase` sends to from `rank` ([Note: traffic per link]):
    the next member of its replica group (grad_replicas) or of its shard group (the rest)."""
    g = groups_of(config, n)
    if g is None:
        return (rank + 1) % n
    if phase == "grad_replicas":
        return (rank + g) % n
    return rank - rank % g + (rank % g + 1) % g
