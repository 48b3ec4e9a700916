"""How closely ranks check that they issue the same collectives (ZeroConfig.watchdog,
[Note: collective fingerprints] in zero/ranks/watchdog.py): "calls" (the default, every cell's),
"collectives" (a fingerprint before every collective too) or "off". The fingerprints are control
traffic, outside what a cell counts, so every mode must leave the bits, the reported values, the
model traffic and the memory as the default's; what the watchdog names when ranks diverge is the
watchdog section's (verify/faults/watchdog_cells.py)."""

from __future__ import annotations

from .record import Feature


def _mode(text: str) -> str:
    from zero.config import WATCHDOG_MODES

    if text not in WATCHDOG_MODES or text == "calls":
        allowed = [m for m in WATCHDOG_MODES if m != "calls"]
        raise ValueError(f"watchdog={text}: allowed are {allowed} ('calls' is every cell's)")
    return text


FEATURE = Feature(
    name="watchdog",
    doc="the collective fingerprints' mode: 'collectives' (before every collective) or 'off'",
    config=lambda value: {"watchdog": value},
    parse=_mode,
    absent="calls",
    # the checks around every collective at stage 3 (the most collectives per step) and at
    # N = 3; none at all at stage 2 in fast mode
    quick=(
        dict(stage=3, precision="bf16", optimizer="adamw", features=("watchdog=collectives",),
             seed=6400),
        dict(stage=1, precision="fp32", optimizer="adam", world_size=3,
             features=("watchdog=collectives",), seed=6401),
        dict(stage=2, precision="bf16", optimizer="sgd", mode="fast", features=("watchdog=off",),
             seed=6402),
    ),
    branches={"watchdog mode other than 'calls'": lambda c: c.watchdog != "calls"},
)  # fmt: skip
