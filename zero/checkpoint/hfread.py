"""Hugging Face folders read into an engine: init_from_hf (zero/checkpoint/hf.py writes them).

Legend: N ranks, u a unit, L its shard length; rank r owns [r·L, (r+1)·L) of a unit's padded
flat buffer (zero/partition.py); "extent" a range of that buffer; a "key" a tensor's name in the
folder.

[Note: HF import ranges] Each rank fills the extents it holds (the working copy's, which
contains the master's; at stage 3 its own shard), slot by slot, from the folder: the flat range
[a, b) of a tensor is read with safetensors' get_slice as a few boxes (dcp_plan.py's boxes,
[Note: DCP boxes]: a partial first row, the whole rows between, a partial last row,
recursively), so a rank reads exactly the elements its extents hold, never a whole tensor it
does not hold. Alignment gaps and padding stay zeros, as construction leaves them. Values are
converted to fp32 (exact from F32, BF16, F16) and rounded to the compute dtype for the working
copy, as construction does. Optimizer states are not touched: they are zeros, since an engine
that has stepped is refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..introspect import Introspect
from .commit import _buffers
from .dcp_plan import boxes
from .format import _agree, _check_idle

CONFIG, GENERATION = "config.json", "generation_config.json"
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
HELD = ("F32", "BF16", "F16")
"""Folder dtypes an fp32 master holds exactly."""
JSON_LIMIT = 64 << 20
"""config.json and the index are read up to this many bytes."""


@dataclass(frozen=True, kw_only=True)
class HFRead:
    """What init_from_hf read on this rank."""

    folder: Path
    tensors: int  # parameters filled (each tied parameter once)
    bytes_read: int  # bytes of tensor data this rank read from the folder's files


# -- import ------------------------------------------------------------------------------------


def _open(path: Path):
    """safetensors' lazy reader of one file (a function of its own: the tests count reads)."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def _regular(path: Path, what: str) -> os.stat_result:
    """A regular file, after following links (a hub cache's folder is made of links)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; {what}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file; {what}")
    return st


def _read_json(path: Path, what: str) -> dict:
    if _regular(path, what).st_size > JSON_LIMIT:
        raise ValueError(f"{path}: over {JSON_LIMIT} bytes; {what}")
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: does not read as JSON ({exc}); {what}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON {type(value).__name__}, not an object; {what}")
    return value


def _boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple]:
    """Index tuples (slices, one per dim) whose elements, in order, are the row-major flat
    range [a, b) of a tensor of `shape`: dcp_plan.boxes' boxes ([Note: DCP boxes]) as the
    slices safetensors' get_slice takes, at most 2·ndim - 1, nothing outside [a, b)."""
    return [
        tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        for offsets, sizes, _ in boxes(shape, a, b)
    ]


class _Folder:
    """A Hugging Face folder's tensors, opened lazily: key -> file; slices read on demand."""

    def __init__(self, folder: Path, stack: contextlib.ExitStack):
        what = "allowed is a folder save_pretrained or export_hf wrote (safetensors weights)"
        if not folder.is_dir():
            raise ValueError(f"{folder}: no such folder; {what}")
        self.folder = folder
        if os.path.lexists(folder / INDEX):
            index = _read_json(folder / INDEX, what)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v and Path(v).name == v and v not in (".", "..")
                for v in weight_map.values()
            ):
                raise ValueError(
                    f"{folder / INDEX}: weight_map must map keys to file names in the folder; "
                    f"{what}"
                )
            names = sorted(set(weight_map.values()))
        elif os.path.lexists(folder / SINGLE):
            weight_map, names = None, [SINGLE]
        else:
            raise ValueError(f"{folder}: holds neither {SINGLE} nor {INDEX}; {what}")
        self.handles = {}
        for name in names:
            _regular(folder / name, what)
            self.handles[name] = stack.enter_context(_open(folder / name))
        if weight_map is None:
            self.file_of = {k: SINGLE for k in self.handles[SINGLE].keys()}
        else:
            self.file_of = dict(weight_map)
            for name, handle in self.handles.items():
                held = set(handle.keys())
                for key in (k for k, v in weight_map.items() if v == name and k not in held):
                    raise ValueError(f"{folder / INDEX}: names {key!r} in {name}, which lacks it")

    def where(self, key: str) -> Path:
        return self.folder / self.file_of[key]

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        sl = self.handles[self.file_of[key]].get_slice(key)
        return tuple(sl.get_shape()), sl.get_dtype()

    def read(self, key: str, shape: tuple[int, ...], a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the tensor's row-major flattening, and nothing else."""
        sl = self.handles[self.file_of[key]].get_slice(key)
        parts = [sl[box].reshape(-1) for box in _boxes(shape, a, b)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_config(model, folder: Path) -> None:
    """The folder's model_type and architectures against the engine's model."""
    mine = getattr(getattr(model, "config", None), "model_type", None)
    cls = type(model).__name__
    if mine is None:
        raise ValueError(f"init_from_hf: the engine's module ({cls}) has no Hugging Face config")
    path = folder / CONFIG
    saved = _read_json(path, "allowed is a folder save_pretrained or export_hf wrote")
    if saved.get("model_type") != mine:
        raise ValueError(
            f"{path}: model_type {saved.get('model_type')!r}, the engine's model is {mine!r} "
            f"({cls}); allowed is a folder of that architecture"
        )
    arch = saved.get("architectures")
    if arch is not None and cls not in arch:
        raise ValueError(
            f"{path}: architectures {arch}, the engine's model is {cls}; allowed is a folder "
            "of that architecture"
        )


def _candidates(names: list[str], prefix: str) -> list[str]:
    """The keys a parameter may have in a folder: each of its names, and each without the base
    model's prefix (a base model's folder, as from_pretrained reads one)."""
    out = list(names)
    if prefix:
        out += [n[len(prefix) + 1 :] for n in names if n.startswith(prefix + ".")]
    return out


def _match(model, source: _Folder) -> dict[str, str]:
    """Canonical parameter name -> its key in the folder. Refused by name: a parameter with no
    key, a shape that differs, a dtype the fp32 master cannot hold exactly, a folder key that is
    neither a parameter nor a buffer of the model."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    first = {id(p): k for k, p in model.named_parameters()}
    names: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(first[id(p)], []).append(name)
    where, known = {}, set()
    for name, p in model.named_parameters():
        tried = _candidates(names[name], prefix)
        known.update(tried)
        key = next((k for k in tried if k in source.file_of), None)
        if key is None:
            raise ValueError(
                f"{source.folder}: parameter {name!r} (shape {tuple(p.shape)}) is missing: no "
                f"tensor {' or '.join(map(repr, tried))} among the folder's "
                f"{len(source.file_of)}; allowed is a folder with every parameter"
            )
        shape, dtype = source.meta(key)
        if shape != tuple(p.shape):
            raise ValueError(
                f"{source.where(key)}: {key!r} has shape {shape}, the model's {name!r} has "
                f"{tuple(p.shape)}; allowed is the model's shape"
            )
        if dtype not in HELD:
            raise ValueError(
                f"{source.where(key)}: {key!r} is {dtype}; allowed are {list(HELD)} (held "
                "exactly by the fp32 master)"
            )
        where[name] = key
    for mod_name, mod in model.named_modules():
        for b in mod._buffers:
            known.update(_candidates([f"{mod_name}.{b}" if mod_name else b], prefix))
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    for key in source.file_of:
        if key not in known and not any(re.search(pat, key) for pat in ignored):
            raise ValueError(
                f"{source.where(key)}: {key!r} is no parameter or buffer of "
                f"{type(model).__name__}; allowed are the model's own keys"
            )
    return where


def _fill(engine, u, source: _Folder, where: dict[str, str], *, master: bool) -> int:
    """Unit u's held extents from the folder ([Note: HF import ranges]); the bytes read."""
    resident, held = engine.working_extent(u)  # held contains the master extent
    values, read = torch.zeros(held.stop - held.start), 0
    for s in u.part.layout.slots:
        lo, hi = max(held.start, s.offset), min(held.stop, s.offset + s.numel)
        if lo >= hi:
            continue
        got = source.read(where[s.name], tuple(s.shape), lo - s.offset, hi - s.offset)
        values[lo - held.start : hi - held.start] = got.float()
        read += got.numel() * got.element_size()
    resident.copy_(values.to(resident.device))  # rounded to the compute dtype
    if master and u.master.untyped_storage().data_ptr() != resident.untyped_storage().data_ptr():
        ext = engine.master_extent(u)
        u.master.copy_(values[ext.start - held.start : ext.stop - held.start])
    return read


def _fill_buffers(model, source: _Folder) -> int:
    """Persistent buffers the folder holds, whole, on every rank; the bytes read."""
    prefix, read = getattr(model, "base_model_prefix", "") or "", 0
    for key, buf in _buffers(model):
        found = next((k for k in _candidates([key], prefix) if k in source.file_of), None)
        if found is None:
            continue  # as from_pretrained: the model's own value stays
        shape, _ = source.meta(found)
        if shape != tuple(buf.shape):
            raise ValueError(
                f"{source.where(found)}: {found!r} has shape {shape}, the model's buffer "
                f"{key!r} has {tuple(buf.shape)}; allowed is the model's shape"
            )
        got = source.read(found, shape, 0, math.prod(shape))
        buf.copy_(got.view(shape))
        read += got.numel() * got.element_size()
    return read


def _init_here(engine, folder: Path) -> HFRead:
    if getattr(engine, "mp", None) is not None:
        raise ValueError("init_from_hf: a model-parallel engine; allowed is a plain engine")
    if engine.t != 0:
        raise ValueError(
            f"init_from_hf: the engine has taken t={engine.t} optimizer steps; allowed is a "
            "fresh engine (engine.load restores a checkpoint)"
        )
    model = engine.module
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder; allowed is a folder of a Hugging Face model")
    _check_config(model, folder)
    with contextlib.ExitStack() as stack, torch.no_grad():
        source = _Folder(folder, stack)
        where = _match(model, source)
        read = sum(_fill(engine, u, source, where, master=True) for u in engine.units)
        read += sum(_fill(engine, u, source, where, master=False) for u in engine.frozen_units)
        read += _fill_buffers(model, source)
    return HFRead(folder=folder, tensors=len(where), bytes_read=read)


def init_from_hf(engine: Introspect, folder) -> HFRead:
    """Set the engine's master and working copy (and frozen parameters, and the persistent
    buffers the folder holds) from a Hugging Face folder; call on every rank, before training.

    The folder is save_pretrained's or export_hf's: config.json and safetensors weights (one
    file, or shards and model.safetensors.index.json). Each rank reads only the ranges it holds
    ([Note: HF import ranges]): at stage 3, its own shard of each unit. Refused by name, on every
    rank: a folder of another architecture (model_type, architectures), a parameter missing, a
    shape that differs, a dtype other than F32, BF16, F16, a key the model does not have, an
    engine that has stepped. Returns what this rank read."""
    engine.at("load")  # every rank loads together ([Note: collective fingerprints])
    _check_idle(engine, "init_from_hf")
    info, error = None, None
    try:
        info = _init_here(engine, Path(folder))
    except Exception as exc:
        error = exc
    _agree(engine, error, f"init_from_hf from {folder}")
    return info


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside goes to the meta device as it is registered (one real
    tensor at a time, freed at once); buffers stay where they are built (a rotary embedding's
    inv_freq has a value the engine could not know). Not thread-safe: it patches nn.Module."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def meta_model(folder, **kwargs):
    """AutoModelForCausalLM of a Hugging Face folder's config.json, its parameters on the meta
    device and its buffers real: `ZeroEngine(meta_model(folder), cfg, device=...,
    init_seed=None)` builds each unit alone (zeros), and init_from_hf(engine, folder) fills
    them, so no process ever holds the whole model. kwargs go to from_config
    (attn_implementation="eager", say)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, **kwargs)
