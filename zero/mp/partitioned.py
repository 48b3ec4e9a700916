"""ZeRO-R's P_a: activation checkpoints partitioned across the model-parallel group (paper §6.1).

Legend: N = N_m, m this rank's MP index, X = b·s·h the elements of one block's checkpoint (its
input), L = ⌈X/N⌉ the part each MP rank keeps.

Under tensor parallelism a block's input is replicated: every MP rank holds the same X values
(the residual stream after g's sum, docs/design.md §6). Checkpointing keeps that input for the
recomputation, so N_m ranks keep N_m copies. P_a keeps one: rank m keeps elements [m·L, (m+1)·L)
of the flattened checkpoint (zero-padded to N·L), and the recomputation all-gathers the N parts
first. The gather returns the very bits that were cut, so P_a changes no value: same bits on or
off. P_a+cpu keeps the part in host memory instead (counted like ActivationOffload's transfers).
With contiguous_memory (M_D) the parts go into the engine's CheckpointArena (on the host for
P_a+cpu), which then holds L elements per block instead of X.

Costs, per block per micro-step: memory X/N instead of X elements; traffic one all-gather,
(N-1)·L elements sent per rank (kind "mp", phase "p_a"). The paper (§7) sets it against
Megatron's 6 all-reduces of X per block (2 in forward, 2 in the recomputation, 2 in backward),
12·(N-1)·L on a ring: 1/12, "less than 10%". Here the recomputation has 1 sum, not 2: torch's
non-reentrant checkpoint stops recomputing once every tensor backward needs is back, which is
before the MLP branch's sum. With 5 all-reduces P_a adds 1/10 on a ring, and 1/(5·N) with the
deterministic gather-based sum (tests/distributed/test_mp_partitioned.py measures both counts).

`PartitionedCheckpoints(mp, unit, offload=...)` is a saved-tensors hook for the place where
zero/zero_r/activations.py enters its offload hook ([Note: what the offload hook sees]): exactly
a checkpointed unit's inputs pass through it. Those inputs must be replicated over the MP group,
as a TP transformer block's are; a unit whose input differs per MP rank (a column-parallel
output) must not be partitioned (the gather would assemble other ranks' values).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..collectives import all_gather
from ..common.traffic import count_transfer
from .tp_comm import KIND, MPContext


def part_length(numel: int, n: int) -> int:
    """L: the elements each of n MP ranks keeps of a checkpoint of `numel` elements."""
    return -(-numel // n)


class PartitionedCheckpoints(saved_tensors_hooks):
    """Keep this MP rank's 1/N of each checkpoint; all-gather it over the MP group when the
    recomputation unpacks it (see the module docstring)."""

    def __init__(self, mp: MPContext, unit: int, *, offload: bool = False, arena=None):
        n, m = mp.size, mp.rank

        def moved(t: torch.Tensor, phase: str, op: str) -> None:
            count_transfer(mp.counter, t, phase=phase, op=op, unit=unit)

        def pack(t: torch.Tensor):
            flat = t.detach().reshape(-1)
            size = part_length(flat.numel(), n)
            part = torch.zeros(size, dtype=t.dtype, device=t.device)
            lo, hi = min(m * size, flat.numel()), min((m + 1) * size, flat.numel())
            part[: hi - lo].copy_(flat[lo:hi])  # a copy: the whole checkpoint can be freed
            if offload:
                moved(part, "p_a_down", "d2h")
            if arena is not None:  # M_D: the part into the next slot (on the host with +cpu)
                return t.shape, t.device, flat.numel(), arena.store(part)
            if offload:
                pinned = t.device.type == "cuda"
                host = torch.empty(size, dtype=t.dtype, pin_memory=pinned)
                part = host.copy_(part, non_blocking=pinned)
            return t.shape, t.device, flat.numel(), part

        def unpack(packed):
            shape, device, numel, part = packed
            if arena is not None:
                part = arena.load(part)
            if offload:
                moved(part, "p_a_up", "h2d")
                part = part.to(device, non_blocking=part.is_pinned())
            size = part.numel()
            whole = torch.empty(n * size, dtype=part.dtype, device=device)
            real = max(0, min(size, numel - m * size))  # this rank's elements that are data
            all_gather(
                whole,
                part,
                group=mp.group,
                counter=mp.counter,
                padding=(n - 1) * (size - real),
                tag=dict(phase="p_a", kind=KIND, unit=unit),
            ).wait()
            return whole[:numel].view(shape)

        super().__init__(pack, unpack)
