"""The parity section's Hugging Face leg (docs/checkpoints.md, "Hugging Face"): after a
deterministic cell of a Hugging Face family (GPT-2, Llama) has trained, export_hf writes the
engine's model (zero/checkpoint/hf.py) in files of at most SHARD_BYTES (so with an index), twice
into one folder (the second replaces the first whole), and
  1. transformers' from_pretrained reads it: every parameter is the engine's gathered fp32 master
     bit for bit (GPT-2's lm_head is tied to wte again, so it is the master's wte too);
  2. the folder's model built on the meta device (meta_model) and materialised as zeros unit by
     unit, in a fresh engine of the same cell, filled by init_from_hf (zero/checkpoint/hfread.py):
     the fresh engine's gathered master is the same bits.
The folder is this cell's own name under the temporary directory; rank 0 removes it before the
export (what a killed run of the same cell left) and after the leg."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

HF_FAMILIES = ("gpt2", "llama")
SHARD_BYTES = 20_000
"""The largest file's data: the families' 30-60K parameters take several files and an index."""


def folder_of(cell) -> Path:
    """One folder per cell and verify run (the pool's ranks share their parent's pid)."""
    name = f"zero-verify-hf-{os.getppid()}-{cell.family}-s{cell.stage}-n{cell.world_size}"
    return Path(tempfile.gettempdir()) / name


def applies(cell) -> bool:
    return (
        cell.family in HF_FAMILIES and cell.mode == "deterministic" and cell.plant is None
        and not cell.perturb
    )  # fmt: skip


def _first_diff(what: str, ours: dict, want: dict) -> str:
    for k in sorted(want):
        a = np.asarray(ours.get(k), np.float32) if k in ours else None
        b = np.asarray(want[k], np.float32)
        if (
            a is None
            or a.shape != b.shape
            or not np.array_equal(a.view(np.uint32), b.view(np.uint32))
        ):
            return f"hf: {what}: {k} is not the engine's master bit for bit"
    return ""


def _as_transformers_reads(folder: Path, master: dict) -> str:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    theirs = {k: v.detach().float().numpy() for k, v in loaded.named_parameters()}
    return _first_diff("from_pretrained", theirs, {k: v.numpy() for k, v in master.items()})


def hf_leg(rank: int, cell, family, eng, model) -> str:
    """'' or the first mismatch; a cell it does not apply to: ''. Every rank calls it."""
    from zero.checkpoint import export_hf, init_from_hf, meta_model
    from zero.engine import ZeroEngine

    if not applies(cell):
        return ""
    folder = folder_of(cell)
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    try:
        for _ in range(2):  # the second export replaces the first's folder
            export_hf(eng, model, folder, max_shard_bytes=SHARD_BYTES)
        master, _ = eng.gather_state()
        why = _as_transformers_reads(folder, master) if rank == 0 else ""
        fresh_model = meta_model(folder, attn_implementation="eager")
        fresh = ZeroEngine(fresh_model, cell.config(fresh_model), device=eng.device, init_seed=None)
        init_from_hf(fresh, folder)
        got, _ = fresh.gather_state()  # every rank has read: the folder can go
        mine = {k: v.numpy() for k, v in got.items()}
        return why or _first_diff("init_from_hf", mine, {k: v.numpy() for k, v in master.items()})
    finally:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
