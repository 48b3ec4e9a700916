"""ZeRO-R's activation checkpointing (ZeroConfig.activation_checkpointing): every unit's forward
recomputed in backward from its saved input (zero/zero_r/activations.py)."""

from __future__ import annotations

from .record import Feature

FEATURE = Feature(
    name="checkpointing",
    doc="activation checkpointing: each unit's forward recomputed in backward",
    config=lambda value: {"activation_checkpointing": True},
    needs=lambda c: "recomputation needs a forward, not injection" if c.injected else "",
    branches={"activation checkpointing": lambda c: c.checkpointing},
)
