"""ZeRO-R's M_D (ZeroConfig.contiguous_memory): gradient buffers and, with activation
checkpointing, the checkpoints in pre-allocated contiguous arenas (zero/zero_r/contiguous.py)."""

from __future__ import annotations

from .record import Bug, Feature, Pair


def plant_arena_slots_overlap(p) -> None:
    """The checkpoint arena's cursor forgets one alignment step: consecutive slots overlap."""
    from zero.zero_r.contiguous import ALIGN, CheckpointArena

    original = CheckpointArena.store

    def store(self, t):
        saved = original(self, t)
        arena = self.gen.arena
        if arena.cursor >= ALIGN:
            arena.cursor -= ALIGN
        return saved

    p.setattr(CheckpointArena, "store", store)


FEATURE = Feature(
    name="contiguous",
    doc="ZeRO-R's M_D: gradients (and checkpoints) in pre-allocated contiguous arenas",
    config=lambda value: {"contiguous_memory": True},
    branches={"contiguous memory": lambda c: c.contiguous},
    pairs=(
        Pair("contiguous × checkpointing", "the checkpoint arena", "cells",
             lambda c: c.contiguous and c.checkpointing),
        Pair("contiguous × offload", "the host gradient arena", "cells",
             lambda c: c.contiguous and c.offload),
    ),
    bugs=(
        # a later checkpoint overwrites an earlier one, which the recomputation then reads: the
        # recomputed loss and gradients differ from the first step on
        Bug(name="arena_slots_overlap", breaks="M_D checkpoint arena: consecutive slots overlap",
            where="deterministic, contiguous memory + checkpointing",
            plant=plant_arena_slots_overlap, check="reported",
            observable=lambda c: c.mode == "deterministic" and c.contiguous and c.checkpointing),
    ),
)  # fmt: skip
