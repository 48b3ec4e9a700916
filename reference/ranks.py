"""N simulated ranks for reference/simulate.py: what each rank holds (Rank: its flat buffers, unit
by unit, and the bytes it owns), and the collectives between them (reduce_scatter, all_gather,
all_reduce, all_reduce_max), which take and return lists indexed by rank and log what each rank
sends (Sent). The reduce-scatter sums in the tree's order (reference/tree.py), so the ranks'
sums are the reference's bits.

Legend: N ranks, L a unit's shard length (rank r's shard is [r·L, (r+1)·L) of the padded N·L).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .tree import tree_sum


@dataclass(frozen=True, kw_only=True)
class Sent:
    """What one rank sent in one collective."""

    op: str  # reduce_scatter | all_gather | all_reduce | all_reduce_max
    phase: str  # grad | grad_gather | param_update | param_fwd | param_bwd | overflow | norm
    unit: int | None
    elements: int  # elements this rank sent, padding included
    padding: int  # how many of them are padding
    kind: str  # "model" (model states) or "control"


# --- simulated collectives: lists indexed by rank in, lists indexed by rank out -------------


def reduce_scatter(bufs, shard: int, padding, log, **tag):
    """Rank r gets T over ranks (rank order) of everyone's slice r; each sends (N-1)·L.

    Realised as an all-to-all followed by a local tree sum, which fixes the order (docs/design.md
    §2).
    """
    n = len(bufs)
    out = [tree_sum([b[r * shard : (r + 1) * shard] for b in bufs]) for r in range(n)]
    for r in range(n):
        pad = sum(padding[s] for s in range(n) if s != r)
        log[r].append(Sent(op="reduce_scatter", elements=(n - 1) * shard, padding=pad, **tag))
    return out


def all_gather(shards, padding, log, **tag):
    """Every rank gets the concatenation of all shards; each sends its shard to N-1 ranks."""
    n = len(shards)
    for r in range(n):
        el, pad = (n - 1) * shards[r].size, (n - 1) * padding[r]
        log[r].append(Sent(op="all_gather", elements=el, padding=pad, **tag))
    full = np.concatenate(shards)
    return [full.copy() for _ in range(n)]


def all_reduce(bufs, shard: int, padding, log, **tag):
    """Counted as reduce-scatter + all-gather (2(N-1)·L per rank), the bandwidth-optimal ring."""
    n = len(bufs)
    inner: list[list[Sent]] = [[] for _ in range(n)]
    full = all_gather(reduce_scatter(bufs, shard, padding, inner, **tag), padding, inner, **tag)
    for r in range(n):
        el, pad = sum(s.elements for s in inner[r]), sum(s.padding for s in inner[r])
        log[r].append(Sent(op="all_reduce", elements=el, padding=pad, **tag))
    return full


def all_reduce_max(flags, log, used=None):
    """Control: every rank learns whether any rank saw an overflow, and (with `used`, one set
    of parameter names per rank) which parameters some rank had a gradient for: one flag per
    parameter besides the overflow flag, counted as (N-1)·(1 + P) elements per rank.
    Returns the overflow decision, or (decision, union of `used`) when `used` is given."""
    tag = {"phase": "overflow", "unit": None, "kind": "control", "padding": 0}
    extra = 0 if used is None else used[1]
    for r in range(len(flags)):
        log[r].append(Sent(op="all_reduce_max", elements=(len(flags) - 1) * (1 + extra), **tag))
    if used is None:
        return any(flags)
    return any(flags), set().union(*used[0])


# --- a simulated rank --------------------------------------------------------------------------


class Rank:
    """One rank's buffers, unit by unit (lists indexed by unit)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.working: list[np.ndarray] = []  # compute dtype: padded unit (stages 0-2) or shard (3)
        self.master: list[np.ndarray] = []  # fp32: padded unit (stage 0) or shard (1-3)
        self.opt: list[dict[str, np.ndarray]] = []  # fp32, same extent as master
        self.grad: list[np.ndarray] = []  # reduction dtype: padded unit (0-1) or shard (2-3)
        self.peak_partials: list[int] = []  # extra streaming-tree buffers, per unit (shards)
        self.frozen: list[np.ndarray] = []  # compute dtype, per frozen unit: whole, or shard (3)

    def resident_bytes(self, shard_nbytes: Sequence[int]) -> dict[str, int]:
        """Bytes this rank owns, by category, each buffer counted once: a view (the fp32
        master inside an fp32 working copy) or the same array in two roles owns nothing new.
        The streaming tree's extra partial sums (shards) count as gradients."""
        seen: set[int] = set()

        def owned(arrays) -> int:
            total = 0
            for a in arrays:
                if a.base is None and id(a) not in seen:
                    seen.add(id(a))
                    total += a.nbytes
            return total

        extra = sum(p * b for p, b in zip(self.peak_partials, shard_nbytes, strict=True))
        out = {
            "params": owned(self.working),
            "grads": owned(self.grad) + extra,
            "master": owned(self.master),
            "optimizer": sum(owned(st.values()) for st in self.opt),
        }
        if self.frozen:
            out["frozen"] = owned(self.frozen)
        return out
