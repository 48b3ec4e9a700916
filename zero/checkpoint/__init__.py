"""Checkpoints: sharded save, load at any world size and stage, consolidation to plain PyTorch.

    engine.save(root)                         # every rank; a new step directory, committed last
    engine.load(root)                         # any N, any stage: resharded while loading
    python -m zero.checkpoint consolidate ROOT model.pt   # one plain state dict, no engine
    python -m zero.checkpoint verify ROOT                 # every checksum, nothing loaded

Legend: N1 the world size at save, N2 at load. Modules: format.py (the on-disk format, verified
reads), validate.py (a manifest against itself), commit.py (save: [Note: atomic commit],
[Note: run identity]), reshard.py (load: [Note: resharding by layout]), consolidate.py, cli.py,
lock.py (one run per output directory), leftovers.py (what a killed writer left: [Note: crash
leftovers]), mpformat.py and mpjoin.py (a model-parallel engine's
checkpoints at (N_d, N_m): [Note: MP checkpoint layout], [Note: joining slices]). They read an
engine only through zero/introspect.py's Introspect, never a stage.
"""

from __future__ import annotations

from .cli import main
from .commit import save
from .consolidate import consolidate, consolidate_to
from .format import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointInfo,
    read_manifest,
    resolve,
    verify,
)
from .reshard import load

_after_write = None
"""Fault injection for tests: called with each path right after it is durably written (shard
files, the manifest) and with ROOT/latest after the switch. Never set outside tests."""

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "consolidate",
    "consolidate_to",
    "load",
    "main",
    "read_manifest",
    "resolve",
    "save",
    "verify",
]
