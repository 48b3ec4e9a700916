"""Checkpoints: sharded save, load at any world size and stage, consolidation to plain PyTorch.

    engine.save(root)                         # every rank; a new step directory, committed last
    engine.load(root)                         # any N, any stage: resharded while loading
    python -m zero.checkpoint consolidate ROOT model.pt   # one plain state dict, no engine
    python -m zero.checkpoint verify ROOT                 # every checksum, nothing loaded
    save_dcp(engine, "out/dcp-7")             # torch.distributed.checkpoint, each rank its shards
    load_dcp(engine, "out/dcp-7")             # any N, any stage; plain PyTorch's and FSDP2's too

Legend: N1 the world size at save, N2 at load. Modules: format.py (the on-disk format, verified
reads), validate.py (a manifest against itself), commit.py (save: [Note: atomic commit],
[Note: run identity]), reshard.py (load: [Note: resharding by layout]), consolidate.py, cli.py,
lock.py (one run per output directory), leftovers.py (what a killed writer left: [Note: crash
leftovers]), mpformat.py and mpjoin.py (a model-parallel engine's
checkpoints at (N_d, N_m): [Note: MP checkpoint layout], [Note: joining slices]), dcp.py and
dcp_plan.py (the exchange format of torch.distributed.checkpoint: [Note: DCP keys], [Note: DCP
writes], [Note: DCP reads]). They read an
engine only through zero/introspect.py's Introspect, never a stage.
"""

from __future__ import annotations

from .cli import main
from .commit import save
from .consolidate import consolidate, consolidate_to
from .dcp import DcpInfo, load_dcp, save_dcp
from .format import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointInfo,
    read_manifest,
    resolve,
    verify,
)
from .hf import export_hf, init_from_hf, meta_model  # noqa: F401 (Hugging Face: hf.py)
from .reshard import load

_after_write = None
"""Fault injection for tests: called with each path right after it is durably written (shard
files, the manifest) and with ROOT/latest after the switch. Never set outside tests."""

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "DcpInfo",
    "consolidate",
    "consolidate_to",
    "load",
    "load_dcp",
    "main",
    "read_manifest",
    "resolve",
    "save",
    "save_dcp",
    "verify",
]
