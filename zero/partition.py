"""Flat units and their shards: which rank owns which elements. Pure code, no communication.

Legend (docs/design.md §3):
    unit     a module whose parameters are flattened into one contiguous buffer
    L        shard length; the unit's padded buffer has N·L elements; rank r owns [r·L, (r+1)·L)
    run      a maximal piece of a shard whose elements all belong to one parameter group
             (alignment gaps ride along: the optimizers map zeros to zeros, see optim.py)

The arithmetic (256-byte-aligned offsets, chunk-aligned shards) is reference/layout.py's, so the
engine and the reference cut the global norm's chunks from the same layout.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference.layout import UnitLayout, unit_layout


@dataclass(frozen=True, kw_only=True)
class Run:
    """Elements [start, stop) of a rank's shard (local offsets) that share one parameter group."""

    start: int
    stop: int
    group: int


@dataclass(frozen=True, kw_only=True)
class UnitPartition:
    """One unit's layout at world size N, seen from one rank."""

    layout: UnitLayout
    world_size: int
    rank: int
    groups: tuple[int, ...]  # parameter group of each slot, in slot order

    @classmethod
    def build(cls, params, *, world_size: int, rank: int, groups: Sequence[int], chunk: int):
        """params: (name, shape) pairs in unit order; groups: each parameter's group index."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: allowed are 0..{world_size - 1}")
        lay = unit_layout([(n, tuple(s)) for n, s in params], chunk=chunk)
        return cls(layout=lay, world_size=world_size, rank=rank, groups=tuple(groups))

    @property
    def shard_numel(self) -> int:
        """L."""
        return self.layout.shard_numel(self.world_size)

    @property
    def padded_numel(self) -> int:
        """N·L."""
        return self.layout.padded_numel(self.world_size)

    @property
    def own(self) -> slice:
        """This rank's elements in the padded buffer."""
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)

    def shard_of(self, rank: int) -> slice:
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def runs(self, *, whole: bool = False) -> list[Run]:
        """Maximal same-group runs of this rank's shard (or of the whole buffer), local offsets.
        Padding between or after parameters joins the run before it; elements before the extent's
        first parameter join the first run."""
        lo, hi = (0, self.padded_numel) if whole else (self.own.start, self.own.stop)
        runs: list[Run] = []
        for slot, group in zip(self.layout.slots, self.groups, strict=True):
            a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if a >= b:
                continue
            if runs and runs[-1].group == group:
                runs[-1] = Run(start=runs[-1].start, stop=b - lo, group=group)
            else:
                runs.append(Run(start=runs[-1].stop if runs else a - lo, stop=b - lo, group=group))
        if runs:  # stretch the first run back to the extent's start and the last to its end
            runs[0] = Run(start=0, stop=runs[0].stop, group=runs[0].group)
            runs[-1] = Run(start=runs[-1].start, stop=hi - lo, group=runs[-1].group)
        return runs

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view of its shape into a padded (or layout-sized) flat buffer."""
        return {
            s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots
        }

    @functools.cached_property
    def padding_scattered(self) -> int:
        """Padding elements a reduce-scatter sends from this rank: the padding of every other
        rank's shard (counted as traffic with the rest, zero/collectives.py)."""
        L = self.shard_numel
        return sum(L - self.real_elements(r) for r in range(self.world_size) if r != self.rank)

    @functools.cached_property
    def padding_gathered(self) -> int:
        """Padding elements an all-gather sends from this rank: its shard's, to N - 1 ranks."""
        return (self.world_size - 1) * (self.shard_numel - self.real_elements(self.rank))

    def real_elements(self, rank: int) -> int:
        """Non-padding elements in rank's shard."""
        sl = self.shard_of(rank)
        return sum(
            max(0, min(s.offset + s.numel, sl.stop) - max(s.offset, sl.start))
            for s in self.layout.slots
        )

    def flatten_into(self, flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Copy tensors (by name) into their slots of a flat buffer; padding is left alone."""
        for s in self.layout.slots:
            flat[s.offset : s.offset + s.numel].copy_(tensors[s.name].reshape(-1))
