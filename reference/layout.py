"""Flat units: where each parameter lives in its unit's contiguous buffer, and how it is sharded.

Legend:
    unit    a group of parameters flattened into one buffer (one transformer block, say)
    A       alignment of every parameter's offset, in elements (ALIGN = 128: 256 bytes for
            2-byte dtypes, 512 for fp32, so one layout serves every dtype)
    C       clipping-chunk size in elements, a power of two that is a multiple of A
    L       shard length per rank, a multiple of C; the padded buffer holds N*L elements
    Ψ_u     the unit's real parameter count (its numel without any padding)

The layout is part of the semantics because the global norm's chunks are cut from it.

[Note: norm invariance] A unit's *layout size* is its aligned extent rounded up to whole chunks;
it does not depend on N. The world-size padding appended after it (to reach N*L) is whole zero
chunks, whose partials are dropped before the norm's tree sum, so the chunk list, and therefore
the norm's bits, are the same at every N and for every partition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ALIGN = 128
DEFAULT_CHUNK = 4096


@dataclass(frozen=True, kw_only=True)
class ParamSlot:
    """One parameter's place in its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int  # first element in the flat buffer, a multiple of ALIGN
    numel: int


@dataclass(frozen=True, kw_only=True)
class UnitLayout:
    """A unit's flat buffer: parameter slots, alignment gaps, chunks and world-size padding."""

    slots: tuple[ParamSlot, ...]
    chunk: int  # C
    layout_numel: int  # aligned extent rounded up to whole chunks; independent of N

    @property
    def numel(self) -> int:
        """Ψ_u: real parameters, no padding."""
        return sum(s.numel for s in self.slots)

    @property
    def num_chunks(self) -> int:
        return self.layout_numel // self.chunk

    def shard_numel(self, world_size: int) -> int:
        """L: elements per rank; the smallest multiple of C with N*L >= layout_numel."""
        return math.ceil(self.num_chunks / world_size) * self.chunk

    def padded_numel(self, world_size: int) -> int:
        """N*L: the buffer each rank allocates when it holds the whole unit."""
        return world_size * self.shard_numel(world_size)

    def real_mask(self, world_size: int) -> np.ndarray:
        """Boolean mask over the padded buffer: True where a parameter element lives."""
        mask = np.zeros(self.padded_numel(world_size), dtype=bool)
        for s in self.slots:
            mask[s.offset : s.offset + s.numel] = True
        return mask

    def flatten(self, arrays: Mapping[str, np.ndarray], world_size: int, dtype) -> np.ndarray:
        """Copy the unit's parameters into a zero-padded flat buffer of N*L elements."""
        flat = np.zeros(self.padded_numel(world_size), dtype=dtype)
        for s in self.slots:
            flat[s.offset : s.offset + s.numel] = np.asarray(arrays[s.name]).reshape(-1)
        return flat

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views of each parameter inside a flat buffer (any length >= layout_numel)."""
        return {s.name: flat[s.offset : s.offset + s.numel].reshape(s.shape) for s in self.slots}


def unit_layout(
    params: Sequence[tuple[str, tuple[int, ...]]], *, chunk: int = DEFAULT_CHUNK
) -> UnitLayout:
    """Lay out (name, shape) pairs in order, each offset aligned to ALIGN elements."""
    if chunk < ALIGN or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk}: must be a power of two >= ALIGN ({ALIGN})")
    slots, offset = [], 0
    for name, shape in params:
        numel = math.prod(shape)
        slots.append(ParamSlot(name=name, shape=tuple(shape), offset=offset, numel=numel))
        offset += math.ceil(numel / ALIGN) * ALIGN
    layout_numel = max(1, math.ceil(offset / chunk)) * chunk
    return UnitLayout(slots=tuple(slots), chunk=chunk, layout_numel=layout_numel)


def model_layout(
    units: Sequence[Sequence[tuple[str, tuple[int, ...]]]], *, chunk: int = DEFAULT_CHUNK
) -> list[UnitLayout]:
    """One UnitLayout per unit, in unit order (the global order of the norm's chunks)."""
    layouts = [unit_layout(u, chunk=chunk) for u in units]
    names = [s.name for lay in layouts for s in lay.slots]
    if len(set(names)) != len(names):
        raise ValueError("units: a parameter name appears in more than one unit")
    return layouts
