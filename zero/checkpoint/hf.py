"""Hugging Face folders, both ways: export an engine's model, or start an engine from one.

    export_hf(engine, engine.module, "out/hf")  # every rank; from_pretrained("out/hf") reads it
    init_from_hf(engine, "out/hf")              # every rank; master and working copy from it
    meta_model("out/hf")                        # its model, parameters on meta, for ZeroEngine

Legend: N ranks, u a unit, L its shard length; a unit's padded flat buffer has N·L elements and
rank r owns [r·L, (r+1)·L) of it (zero/partition.py); "extent" a range of that buffer; a "key" a
tensor's name in the folder (a state_dict() key).

[Note: HF export] The folder is what save_pretrained writes: config.json (the model's config,
`architectures` and `dtype` set), generation_config.json when the model has one, and the weights
as safetensors files (model.safetensors, or model-0000k-of-0000n.safetensors and
model.safetensors.index.json when they exceed max_shard_bytes). Every shape is known before any
value is, so the files' headers are laid out first and the values streamed into them in unit
order: each unit's fp32 master (a frozen unit's held values) is gathered to rank 0, which writes
its tensors and frees it, so no process holds more than one unit (plus one tensor cast to the
export dtype). A tied parameter is written once, under the key Hugging Face keeps (not a key of
the model's _tied_weights_keys); persistent buffers as rank 0 holds them. Rank 0 writes into a
temporary sibling folder `.NAME.XXXXXXXX.tmp` and renames it to NAME last (an existing NAME is
swapped with it atomically, then removed): a failure at any point leaves NAME as it was and
removes the temporary folder. An existing NAME is replaced only when it is empty or holds only
files an export writes, never a folder of other files. A rank that fails goes on taking part in
the gathers without writing, so no rank waits for it; every rank then raises (_agree).

Importing: zero/checkpoint/hfread.py ([Note: HF import ranges]).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import errno
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives as C
from ..introspect import Introspect
from .commit import _buffers, _state_dict_keys
from .format import _agree, _check_idle, _fsync_dir
from .hfread import CONFIG, GENERATION, INDEX, SINGLE, HFRead, init_from_hf, meta_model

__all__ = ["HFRead", "export_hf", "init_from_hf", "meta_model"]

SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
EXPORT_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
OTHER_DTYPES = {
    torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True, kw_only=True)
class _Entry:
    """One tensor of an export: its key, where its values come from, its file and place."""

    key: str
    block: int  # index into _Plan.blocks
    slot: str  # the parameter's name in its unit, or the buffer's key
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written
    file: int = 0
    begin: int = 0  # offset in the file's data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return {**EXPORT_DTYPES, **OTHER_DTYPES}[self.dtype]


@dataclass(frozen=True, kw_only=True)
class _Plan:
    blocks: list  # ("unit", u) | ("frozen", u) | ("buffers", None), in write order
    files: list  # list[list[_Entry]], each file's entries in write order

    def name(self, f: int) -> str:
        n = len(self.files)
        return SINGLE if n == 1 else f"model-{f + 1:05d}-of-{n:05d}.safetensors"


# -- export ------------------------------------------------------------------------------------


def _check_export_args(engine, model, max_shard_bytes, dtype) -> None:
    """The same answer on every rank, before any collective."""
    if model is not engine.module:
        raise ValueError(
            f"model={type(model).__name__}: not the module this engine wraps "
            f"({type(engine.module).__name__}); pass engine.module"
        )
    if not hasattr(getattr(model, "config", None), "to_json_string"):
        raise ValueError(
            f"model={type(model).__name__}: has no Hugging Face config (model.config); "
            "allowed are transformers models"
        )
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r}: allowed is an integer >= 1")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: allowed is an integer >= 1")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype}: allowed are {list(EXPORT_DTYPES)}")
    if getattr(engine, "mp", None) is not None:
        raise ValueError("export_hf: a model-parallel engine; allowed is a plain engine")
    if sys.byteorder != "little":
        raise ValueError(f"byte order {sys.byteorder}: safetensors files are little-endian")


def _keys(model) -> dict[str, str]:
    """Canonical parameter name (or "buffer:" + key) -> the one key the folder gives it: the
    first state_dict() key that Hugging Face does not drop as a tied copy."""
    first = {id(p): k for k, p in model.named_parameters()}
    canonical = {k: first[id(p)] for k, p in model.named_parameters(remove_duplicate=False)}
    tied = getattr(model, "_tied_weights_keys", None) or ()
    tied = set(tied.keys() if isinstance(tied, dict) else tied)
    chosen: dict[str, str] = {}
    for key, src in _state_dict_keys(model, canonical):
        if src not in chosen or (chosen[src] in tied and key not in tied):
            chosen[src] = key
    return chosen


def _plan(engine, model, dtype: torch.dtype, max_shard_bytes: int) -> _Plan:
    """Every tensor's key, source and place, in write order, cut into files of at most
    max_shard_bytes of data (a larger tensor alone in a file of its own)."""
    keys = _keys(model)
    blocks = [("unit", u) for u in engine.units] + [("frozen", u) for u in engine.frozen_units]
    entries = [
        _Entry(key=keys[s.name], block=b, slot=s.name, shape=tuple(s.shape), dtype=dtype)
        for b, (_, u) in enumerate(blocks)
        for s in u.part.layout.slots
    ]
    blocks.append(("buffers", None))
    for key, buf in _buffers(model):
        as_written = dtype if buf.is_floating_point() else buf.dtype
        if as_written not in OTHER_DTYPES and as_written not in EXPORT_DTYPES:
            raise ValueError(
                f"buffer {key!r}: dtype {buf.dtype}; allowed are floating dtypes and "
                f"{list(OTHER_DTYPES)}"
            )
        b = len(blocks) - 1
        entries.append(
            _Entry(
                key=keys[f"buffer:{key}"],
                block=b,
                slot=key,
                shape=tuple(buf.shape),
                dtype=as_written,
            )
        )
    files: list[list[_Entry]] = [[]]
    used = 0
    for e in entries:
        if files[-1] and used + e.nbytes > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(replace(e, file=len(files) - 1, begin=used))
        used += e.nbytes
    return _Plan(blocks=blocks, files=files)


def _header(entries: list[_Entry]) -> bytes:
    """A safetensors header: its length (8 bytes, little-endian), then JSON padded with spaces
    to a multiple of 8 bytes."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    for e in entries:
        meta[e.key] = {
            "dtype": e.dtype_name,
            "shape": list(e.shape),
            "data_offsets": [e.begin, e.begin + e.nbytes],
        }
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _exported_name(name: str) -> bool:
    return name in (CONFIG, GENERATION, SINGLE, INDEX) or SHARD_NAME.fullmatch(name) is not None


def _check_folder(folder: Path) -> None:
    """Refuse a target an export may not replace (rank 0, before anything is written)."""
    allowed = "allowed is a new name in an existing folder, an empty folder, or an export's folder"
    if folder.is_symlink():
        raise ValueError(f"folder={str(folder)!r}: a symbolic link; {allowed}")
    if not folder.parent.is_dir():
        raise ValueError(
            f"folder={str(folder)!r}: {str(folder.parent)!r} is not a folder; {allowed}"
        )
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"folder={str(folder)!r}: exists and is not a folder; {allowed}")
    others = sorted(
        p.name for p in folder.iterdir() if not (_exported_name(p.name) and p.is_file())
    )
    if others:
        raise ValueError(
            f"folder={str(folder)!r}: holds {others[:3]}{' …' if len(others) > 3 else ''}, "
            f"which an export does not write; {allowed}"
        )


def _write_all(f, chunk) -> None:
    """One chunk into an open file; a function of its own so that a test can make it fail."""
    f.write(chunk)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


class _Writer:
    """Rank 0's side of an export ([Note: HF export]): a temporary folder, its files in order."""

    def __init__(self, folder: Path, plan: _Plan):
        self.folder, self.plan = folder, plan
        tmp = tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent)
        self.tmp = Path(tmp)
        os.chmod(self.tmp, 0o755)  # mkdtemp makes 0700; a model folder is for others to read
        self.handle, self.file, self.next = None, -1, 0

    def put(self, e: _Entry, values: torch.Tensor) -> None:
        """The next tensor of the plan (asserted), written to its file."""
        if self.handle is None:
            self.file, self.next = self.file + 1, 0
            path = self.tmp / self.plan.name(self.file)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            self.handle = os.fdopen(fd, "wb")
            _write_all(self.handle, _header(self.plan.files[self.file]))
        assert e is self.plan.files[self.file][self.next], (e.key, self.file, self.next)
        flat = values.detach().reshape(-1).to("cpu", e.dtype).contiguous()
        _write_all(self.handle, memoryview(flat.view(torch.uint8).numpy()))
        self.next += 1
        if self.next == len(self.plan.files[self.file]):
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            self.handle = None

    def _json(self, name: str, text: str) -> None:
        with open(self.tmp / name, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, model, dtype: torch.dtype) -> None:
        """Index, config and generation config, then the folder swapped into place."""
        assert self.handle is None and self.file == len(self.plan.files) - 1
        if len(self.plan.files) > 1:
            total = sum(e.nbytes for f in self.plan.files for e in f)
            weights = {e.key: self.plan.name(f) for f, es in enumerate(self.plan.files) for e in es}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weights.items()))}
            self._json(INDEX, json.dumps(index, indent=2) + "\n")
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        setattr(config, "dtype" if "dtype" in config.to_dict() else "torch_dtype", dtype)
        self._json(CONFIG, config.to_json_string(use_diff=True))
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            self._json(GENERATION, generation.to_json_string(use_diff=True))
        _fsync_dir(self.tmp)
        parent = self.folder.parent
        if self.folder.exists() and _exchange(self.tmp, self.folder):
            _fsync_dir(parent)
            shutil.rmtree(self.tmp, ignore_errors=True)  # now the old folder
        elif self.folder.exists():  # two renames: the old folder set aside, then the new one
            old = Path(tempfile.mkdtemp(prefix=f".{self.folder.name}.", suffix=".old", dir=parent))
            os.replace(self.folder, old)  # an empty directory is replaced
            try:
                os.rename(self.tmp, self.folder)
            except OSError:
                os.rename(old, self.folder)
                raise
            _fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.tmp, self.folder)
            _fsync_dir(parent)

    def abandon(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(OSError):
                self.handle.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _to_rank0(engine, u, t: torch.Tensor, ext: slice) -> torch.Tensor | None:
    """u's padded buffer on rank 0 (None on the others), from t, which covers extent ext of it:
    t itself where ext is the whole buffer, else every rank's own shard gathered to rank 0 (an
    all-to-all whose every piece goes to rank 0: a gather, in the collectives the traffic
    counter models; counted as L elements on every rank, rank 0's own staying local, as the
    watchdog compares sizes across ranks: [Note: collective fingerprints])."""
    part, rank = u.part, engine.rank
    if ext.start == 0 and ext.stop == part.padded_numel:
        return t if rank == 0 else None
    own, n, shard = part.own, engine.world_size, part.shard_numel
    mine = t[own.start - ext.start : own.stop - ext.start].to(engine.device).contiguous()
    full = torch.empty(n * shard if rank == 0 else 0, dtype=t.dtype, device=engine.device)
    tag = {"phase": "export_hf", "kind": "control", "unit": u.name}
    pad = shard - part.real_elements(rank)
    rec = C.count_call(engine.counter, "all_to_all", shard, pad, mine, **tag)
    splits = {
        "output_split_sizes": [shard if rank == 0 else 0] * n,
        "input_split_sizes": [shard] + [0] * (n - 1),
    }
    C.launch(
        dist.all_to_all_single, full, mine, group=engine.group, async_op=False, rec=rec, **splits
    )
    rec.end = time.perf_counter()
    return full if rank == 0 else None


def _block(engine, model, kind: str, u):
    """A block's values on rank 0: {slot name: tensor}; a collective for sharded units."""
    if kind == "buffers":
        return dict(_buffers(model)) if engine.rank == 0 else None
    if kind == "unit":
        full = _to_rank0(engine, u, u.master, engine.master_extent(u))
    else:
        resident, held = engine.working_extent(u)
        full = _to_rank0(engine, u, resident, held)
    if full is None:
        return None
    return {s.name: full[s.offset : s.offset + s.numel].view(s.shape) for s in u.part.layout.slots}


def export_hf(
    engine: Introspect,
    model,
    folder,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a Hugging Face folder of the engine's model; call on every rank.

    model: engine.module (a transformers model: its config is written). The weights are the
    fp32 master (frozen parameters as held), written in `dtype` (float32, bfloat16 or float16:
    rounded to nearest even), in files of at most max_shard_bytes of data. Only rank 0 writes,
    one unit at a time ([Note: HF export]); the folder appears whole or not at all. Returns the
    folder. A failure on any rank makes every rank raise, naming it; an existing folder is
    then as it was."""
    _check_export_args(engine, model, max_shard_bytes, dtype)
    engine.at("gather")  # every rank exports together ([Note: collective fingerprints])
    _check_idle(engine, "export_hf")
    folder = Path(folder)
    plan = _plan(engine, model, dtype, max_shard_bytes)
    writer, error = None, None
    if engine.rank == 0:
        try:
            _check_folder(folder)
            writer = _Writer(folder, plan)
        except Exception as exc:
            error = exc
    _agree(engine, error, f"export to {folder}")
    entries: dict[int, list[_Entry]] = {}
    for e in (e for f in plan.files for e in f):
        entries.setdefault(e.block, []).append(e)
    with torch.no_grad():
        for b, (kind, u) in enumerate(plan.blocks):
            values = _block(engine, model, kind, u)  # every rank: the gathers pair up
            if writer is not None and error is None:
                try:
                    for e in entries.get(b, []):
                        writer.put(e, values[e.slot])
                except Exception as exc:  # the gathers go on: no rank is left waiting
                    error = exc
            del values
    if writer is not None and error is None:
        try:
            writer.commit(model, dtype)
        except Exception as exc:
            error = exc
    if writer is not None and error is not None:
        writer.abandon()
    _agree(engine, error, f"export to {folder}")
    return folder
