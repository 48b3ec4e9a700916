"""Checkpoints: sharded save, load at any world size and stage, consolidation to plain PyTorch.

    engine.save(root)                         # every rank; a new step directory, committed last
    engine.load(root)                         # any N, any stage: resharded while loading
    python -m zero.checkpoint consolidate ROOT model.pt   # one plain state dict, no engine
    python -m zero.checkpoint verify ROOT                 # every checksum, nothing loaded

Legend: N1 the world size a checkpoint was saved at, N2 the one it is loaded at; L1, L2 their
shard lengths; a unit's padded buffer has N·L elements, its *layout* (the parameters' offsets,
reference/layout.py) is the first layout_numel of them. "Extent" is a range of the padded buffer.

On disk, ROOT holds step directories and one pointer:
    ROOT/latest                       name of the newest committed step directory
    ROOT/step-00000012/manifest.json  what is where and every file's sha256: the commit record
    ROOT/step-00000012/u0003-r0001.bin  rank 1's shard of unit 3 at N1: the padded buffer's
                                      elements [L1, 2·L1) of the fp32 master, then of each
                                      optimizer state, raw little-endian
    ROOT/step-00000012/r0001.bin      rank 1's RNG state (rank 0's file also holds the buffers)
Every rank writes the same thing at every stage: its slice r of each unit, taken from the whole
master where the stage keeps it whole (stage 0, persistent stage-3 units). The working copy is
not saved: it is the master rounded to the compute dtype, which is how the engine makes it.

[Note: resharding by layout] A unit's layout does not depend on N; only the zero padding after
it does. So loading never assembles a parameter: for each extent a rank holds at N2 (its master
and optimizer-state shard; its working copy, whole at stages 0-2), each parameter slot that
overlaps it is copied from the saved files that hold that slot's range, wherever the parameter
lived at save time (another unit split or chunk size works too). Alignment gaps and padding are
zeros, which is what every optimizer keeps in them (zero/optim.py), so the copy is exact. A rank
reads and hashes whole files: at the same N only its own, at stages 0-2 every file of a unit (the
working copy is whole there). Limitation: a file is read into memory whole, so a unit's shard
must fit in host memory; no I/O is overlapped with compute.

[Note: atomic commit] (docs/design.md §3) 1. rank 0 creates a fresh step directory (never one that
exists, so the live checkpoint is never written into); 2. every rank writes its files (temp file,
fsync, rename) and fsyncs the directory, then all ranks exchange their checksums, which is the
barrier; 3. rank 0 writes manifest.json the same way and fsyncs the directory; 4. rank 0 switches
`latest` (temp file, fsync, os.replace, fsync ROOT). A directory without a manifest is an
interrupted save and is ignored; only after step 4 does rank 0 prune: interrupted saves always,
and committed ones beyond `keep_last`. A crash at any point leaves `latest` naming a complete,
verifiable checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .optim import TORCH_OPTIMIZERS, torch_kwargs

FORMAT = "zero-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"step-\d{8,}(-\d+)?")

_after_write = None
"""Fault injection for tests: called with each path right after it is durably written (shard
files, the manifest) and with ROOT/latest after the switch. Never set outside tests."""


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete, corrupt, of a newer format, or a rank failed."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What load() restored."""

    directory: Path  # the step directory read
    data_step: int  # the data position: the next step to run (train_steps' start_step)
    t: int  # optimizer steps taken
    world_size: int  # N1
    stage: int  # the stage it was saved at
    extra: object  # the JSON value passed to save(extra=...)


# -- small I/O helpers ---------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, chunks) -> tuple[str, int]:
    """Write chunks (buffers) to path via a temp file, fsync, rename; returns (sha256, bytes)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
            size += memoryview(chunk).nbytes
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return digest.hexdigest(), size


def _raw(t: torch.Tensor):
    """A tensor's bytes as a NumPy buffer (no copy on CPU), whatever its dtype."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _tensor_file(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """tensors written back to back; returns the file's manifest entry."""
    entries, offset, chunks = {}, 0, []
    for key, t in tensors:
        buf = _raw(t)
        entries[key] = [offset, t.numel(), str(t.dtype).removeprefix("torch."), list(t.shape)]
        offset += buf.nbytes
        chunks.append(buf)
    sha, size = _write_durably(path, chunks)
    if _after_write is not None:
        _after_write(path)
    return {"sha256": sha, "bytes": size, "entries": entries}


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# -- collectives among ranks (control only, outside the engine's traffic counter) -------------


def _all_gather(engine, obj) -> list:
    if engine.world_size == 1:
        return [obj]
    out: list = [None] * engine.world_size
    dist.all_gather_object(out, obj, group=engine.group)
    return out


def _broadcast(engine, obj):
    if engine.world_size == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(engine.group, 0)
    dist.broadcast_object_list(box, src=src, group=engine.group)
    return box[0]


def _agree(engine, error: BaseException | None, what: str) -> None:
    """Every rank learns whether some rank failed, so that none is left waiting in a later
    collective: the failing rank re-raises its own error, the others name it."""
    every = _all_gather(engine, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for r, msg in enumerate(every):
        if msg is not None:
            raise CheckpointError(f"{what} failed on rank {r}: {msg}")


def _check_idle(engine, what: str) -> None:
    if engine.microstep != 0:
        raise RuntimeError(
            f"{what} after {engine.microstep} micro-steps of an unfinished step on rank "
            f"{engine.rank}: save and load only between steps"
        )
    if engine.fake:
        raise RuntimeError(f"{what} on a simulated rank (fake process group): values are void")


# -- save ----------------------------------------------------------------------------------------


def _own(engine, u, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice [r·L, (r+1)·L) of a tensor that covers the unit's master extent."""
    ext, own = engine.impl.master_extent(u), u.part.own
    return t[own.start - ext.start : own.stop - ext.start]


def _buffers(module) -> list[tuple[str, torch.Tensor]]:
    """Persistent buffers, as state_dict() would list them (without reading any parameter)."""
    out = []
    for prefix, mod in module.named_modules():
        for key, b in mod._buffers.items():
            if b is not None and key not in mod._non_persistent_buffers_set:
                out.append((f"{prefix}.{key}" if prefix else key, b))
    return out


def _rng_tensors(engine) -> list[tuple[str, torch.Tensor]]:
    out = [("rng:torch_cpu", torch.get_rng_state())]
    if engine.device.type == "cuda":
        out.append(("rng:cuda", torch.cuda.get_rng_state(engine.device)))
    return out


def _write_rank_files(engine, step_dir: Path) -> dict:
    files = {}
    for u in engine.units:
        tensors = [("master", _own(engine, u, u.master))]
        tensors += [(x, _own(engine, u, t)) for x, t in sorted(u.opt.items())]
        name = f"u{u.index:04d}-r{engine.rank:04d}.bin"
        files[name] = _tensor_file(step_dir / name, tensors)
    extra = _rng_tensors(engine)
    if engine.rank == 0:
        extra += [(f"buffer:{k}", b) for k, b in _buffers(engine.module)]
    name = f"r{engine.rank:04d}.bin"
    files[name] = _tensor_file(step_dir / name, extra)
    _fsync_dir(step_dir)
    return files


def _config_record(cfg) -> dict:
    return {
        "precision": cfg.precision,
        "reduce_dtype": cfg.reduce_dtype,
        "deterministic": cfg.deterministic,
        "optimizer": cfg.optimizer,
        "groups": [dataclasses.asdict(h) for h in cfg.groups],
        "micro_batches": cfg.micro_batches,
        "clip_norm": cfg.clip_norm,
        "scaler": dataclasses.asdict(cfg.scaler),
        "nonfinite": cfg.nonfinite,
        "units": list(cfg.units),
        "persist_below": cfg.persist_below,
        "chunk": cfg.chunk,
    }


def _manifest(engine, name: str, files: dict, extra, sequence: int) -> dict:
    n = engine.world_size
    where = {}
    for u in engine.units:
        for s in u.part.layout.slots:
            where[s.name] = (u.index, s.offset)
    first = {id(p): k for k, p in engine.module.named_parameters()}  # tied: the first name
    aliases: dict[str, list[str]] = {}
    canonical: dict[str, str] = {}
    for pname, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(first[id(p)], []).append(pname)
        canonical[pname] = first[id(p)]
    params = []
    for pname, p in engine.module.named_parameters():  # module order: torch.optim's order
        unit, offset = where[pname]
        params.append(
            {
                "name": pname,
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),  # the working (compute) dtype
                "group": engine.group_index[pname],
                "unit": unit,
                "offset": offset,
                "aliases": aliases[pname],
            }
        )
    units = [
        {
            "name": u.name,
            "params": [s.name for s in u.part.layout.slots],
            "layout_numel": u.part.layout.layout_numel,
            "shard_numel": u.part.shard_numel,
            "padded_numel": u.part.padded_numel,
            "master_whole": engine.impl.master_extent(u) != u.part.own,
            "states": ["master", *sorted(u.opt)],
            "files": [f"u{u.index:04d}-r{r:04d}.bin" for r in range(n)],
        }
        for u in engine.units
    ]
    sd_keys = []  # state_dict() order: (key, parameter or buffer name)
    for prefix, mod in engine.module.named_modules(remove_duplicate=False):
        for key, p in mod._parameters.items():
            if p is not None:
                full = f"{prefix}.{key}" if prefix else key
                sd_keys.append([full, canonical[full]])
        for key, b in mod._buffers.items():
            if b is not None and key not in mod._non_persistent_buffers_set:
                full = f"{prefix}.{key}" if prefix else key
                sd_keys.append([full, f"buffer:{full}"])
    body = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": name,
        "sequence": sequence,
        "world_size": n,
        "stage": engine.config.stage,
        "t": engine.t,
        "data_step": engine.data_step,
        "scaler": None if engine.scaler is None else dataclasses.asdict(engine.scaler),
        "config": _config_record(engine.config),
        "params": params,
        "units": units,
        "state_dict_keys": list(dict(sd_keys).items()),  # a shared module once
        "files": files,
        "rng": {"files": [f"r{r:04d}.bin" for r in range(n)], "restored_at_same_world_size": True},
        "extra": extra,
        "torch_version": torch.__version__,
        "byteorder": sys.byteorder,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return {**body, "checksum": hashlib.sha256(_canonical(body)).hexdigest()}


def _sequence_after(root: Path) -> int:
    """One more than the newest committed sequence number under root."""
    seqs = [-1]
    for d in root.iterdir() if root.is_dir() else ():
        if STEP_DIR.fullmatch(d.name) and (d / MANIFEST).is_file():
            try:
                seqs.append(int(json.loads((d / MANIFEST).read_text())["sequence"]))
            except (ValueError, KeyError, TypeError):
                pass
    return max(seqs) + 1


def _fresh_step_dir(root: Path, data_step: int) -> str:
    base = f"step-{data_step:08d}"
    name, k = base, 0
    while (root / name).exists():  # never write into an existing (maybe the live) directory
        k += 1
        name = f"{base}-{k}"
    (root / name).mkdir()
    _fsync_dir(root)
    return name


def _prune(root: Path, current: str, keep_last: int | None) -> list[str]:
    committed, removed = [], []
    for d in root.iterdir():
        if d.name == current or not d.is_dir() or not STEP_DIR.fullmatch(d.name):
            continue
        if not (d / MANIFEST).is_file():  # an interrupted save
            shutil.rmtree(d)
            removed.append(d.name)
            continue
        try:
            seq = int(json.loads((d / MANIFEST).read_text())["sequence"])
        except (ValueError, KeyError, TypeError):
            seq = -1  # unreadable: the oldest
        committed.append((seq, d))
    if keep_last is not None:
        committed.sort()
        for _, d in committed[: max(0, len(committed) - (keep_last - 1))]:
            shutil.rmtree(d)
            removed.append(d.name)
    if removed:
        _fsync_dir(root)
    return removed


def save(engine, directory, *, keep_last: int | None = None, extra=None) -> Path:
    """Save every rank's state into a new step directory under `directory`; call on every rank.

    keep_last: after the commit, keep only this many committed step directories (None: all).
    extra: any JSON value (a data loader's position, say), returned by load() as info.extra.
    Returns the committed step directory. Protocol: [Note: atomic commit].
    """
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last={keep_last!r}: must be None or an integer >= 1")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra={extra!r}: must be JSON-serialisable ({exc})") from None
    _check_idle(engine, "save")
    root = Path(directory)
    name, error = None, None
    if engine.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            name = _fresh_step_dir(root, engine.data_step)
        except OSError as exc:
            error = exc
    name = _broadcast(engine, name)
    _agree(engine, error, f"save to {root}")
    step_dir = root / name
    files, error = None, None
    try:
        files = _write_rank_files(engine, step_dir)
    except Exception as exc:  # reported to every rank below, so none waits forever
        error = exc
    every = _all_gather(engine, files)  # the barrier: every rank's files are durable
    _agree(engine, error, f"save to {step_dir}")
    error = None
    if engine.rank == 0:
        try:
            all_files = {k: v for f in every for k, v in f.items()}
            manifest = _manifest(engine, name, all_files, extra, _sequence_after(root))
            _write_durably(step_dir / MANIFEST, [json.dumps(manifest, indent=1).encode()])
            _fsync_dir(step_dir)
            if _after_write is not None:
                _after_write(step_dir / MANIFEST)
            _write_durably(root / LATEST, [f"{name}\n".encode()])
            _fsync_dir(root)
            if _after_write is not None:
                _after_write(root / LATEST)
            _prune(root, name, keep_last)
        except Exception as exc:
            error = exc
    _agree(engine, error, f"commit of {step_dir}")
    return step_dir


# -- reading -------------------------------------------------------------------------------------


def resolve(directory) -> Path:
    """The step directory to read: `directory` itself if it holds a manifest, else the one its
    `latest` pointer names."""
    d = Path(directory)
    if (d / MANIFEST).is_file():
        return d
    pointer = d / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"{d}: neither a step directory ({MANIFEST}) nor a root ({LATEST})")
    step_dir = d / pointer.read_text().strip()
    if not (step_dir / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {step_dir}, which has no {MANIFEST}")
    return step_dir


def read_manifest(step_dir: Path) -> dict:
    """The manifest, checked: our format, a version we read, its own checksum."""
    path = Path(step_dir) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the save did not complete)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    version = m.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version!r} is newer than this code reads (up to "
            f"{FORMAT_VERSION}); load it with the version of zero that wrote it, or a newer one"
        )
    body = {k: v for k, v in m.items() if k != "checksum"}
    got = hashlib.sha256(_canonical(body)).hexdigest()
    if got != m.get("checksum"):
        raise CheckpointError(
            f"{path}: checksum mismatch (sha256 of its contents {got}, "
            f"recorded {m.get('checksum')})"
        )
    if m["byteorder"] != sys.byteorder:
        raise CheckpointError(f"{path}: saved on a {m['byteorder']}-endian machine")
    return m


class _Reader:
    """The files of one step directory: each verified against its sha256 on first read, and
    ranges of a unit's saved padded buffer sliced out of them."""

    def __init__(self, step_dir: Path, manifest: dict):
        self.dir, self.m, self.cache = Path(step_dir), manifest, {}

    def file(self, name: str) -> bytearray:
        if name not in self.cache:
            info = self.m["files"].get(name)
            path = self.dir / name
            if info is None:
                raise CheckpointError(f"{path}: not listed in {self.dir / MANIFEST}")
            try:
                with open(path, "rb") as f:
                    data = bytearray(f.read())
            except FileNotFoundError:
                raise CheckpointError(
                    f"missing shard file {path} (the manifest lists it: {info['bytes']} bytes)"
                ) from None
            got = hashlib.sha256(data).hexdigest()
            if len(data) != info["bytes"] or got != info["sha256"]:
                raise CheckpointError(
                    f"checksum mismatch in {path}: sha256 {got} ({len(data)} bytes), the "
                    f"manifest records {info['sha256']} ({info['bytes']} bytes)"
                )
            self.cache[name] = data
        return self.cache[name]

    def tensor(self, name: str, key: str) -> torch.Tensor:
        data = self.file(name)
        offset, numel, dtype, shape = self.m["files"][name]["entries"][key]
        dt = getattr(torch, dtype)
        if numel == 0:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(data, dtype=dt, count=numel, offset=offset).view(shape)

    def range(self, unit: int, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of a saved unit's padded fp32 buffer of state `key`."""
        spec = self.m["units"][unit]
        L = spec["shard_numel"]
        out = torch.zeros(stop - start)
        pos = start
        while pos < stop:
            k, end = pos // L, min(stop, (pos // L + 1) * L)
            name = spec["files"][k]  # slots lie inside the layout, so k < N1 always
            buf = self.file(name)
            offset = self.m["files"][name]["entries"][key][0]
            out[pos - start : end - start] = torch.frombuffer(
                buf, dtype=torch.float32, count=end - pos, offset=offset + 4 * (pos - k * L)
            )
            pos = end
        return out

    def drop(self) -> None:
        self.cache.clear()


def verify(directory) -> dict:
    """Check a checkpoint without loading it: the manifest, and every file against its sha256.
    Returns the manifest; raises CheckpointError naming the first bad file."""
    step_dir = resolve(directory)
    m = read_manifest(step_dir)
    reader = _Reader(step_dir, m)
    for name in sorted(m["files"]):
        reader.file(name)
        reader.drop()
    return m


# -- load ----------------------------------------------------------------------------------------


def _check_model(engine, m: dict) -> None:
    """The first parameter (in module order) that differs, named with both shapes."""
    saved = {p["name"]: p for p in m["params"]}
    mine = dict(engine.module.named_parameters())
    for name, p in mine.items():
        if name not in saved:
            raise ValueError(
                f"parameter {name!r}: model shape {tuple(p.shape)}, not in the checkpoint "
                f"(which has {len(saved)} parameters)"
            )
        if tuple(saved[name]["shape"]) != tuple(p.shape):
            raise ValueError(
                f"parameter {name!r}: checkpoint shape {tuple(saved[name]['shape'])}, model "
                f"shape {tuple(p.shape)}"
            )
    for name, p in saved.items():
        if name not in mine:
            raise ValueError(
                f"parameter {name!r}: checkpoint shape {tuple(p['shape'])}, not in the model"
            )
    kind = m["config"]["optimizer"]
    if kind != engine.config.optimizer:
        raise ValueError(
            f"optimizer={engine.config.optimizer!r}: the checkpoint holds the states of "
            f"optimizer={kind!r}"
        )
    for name in mine:
        g_saved, g_mine = saved[name]["group"], engine.group_index[name]
        if g_saved != g_mine:
            raise ValueError(
                f"parameter {name!r}: parameter group {g_mine} here, {g_saved} in the checkpoint"
            )


def _extent(u, reader: _Reader, where: dict, key: str, ext: slice, device) -> torch.Tensor:
    """fp32 values of state `key` over elements `ext` of unit u's padded buffer at N2, copied
    slot by slot from the saved files ([Note: resharding by layout])."""
    out = torch.zeros(ext.stop - ext.start)
    for s in u.part.layout.slots:
        lo, hi = max(ext.start, s.offset), min(ext.stop, s.offset + s.numel)
        if lo >= hi:
            continue
        unit, offset = where[s.name]
        if key not in reader.m["units"][unit]["states"]:
            continue  # a state this optimizer did not keep then: zeros, as a fresh one starts
        out[lo - ext.start : hi - ext.start] = reader.range(
            unit, key, offset + lo - s.offset, offset + hi - s.offset
        )
    return out.to(device)


def _load_here(engine, directory) -> CheckpointInfo:
    from reference.precision import ScalerState, scaler_init

    step_dir = resolve(directory)
    m = read_manifest(step_dir)
    _check_model(engine, m)
    reader = _Reader(step_dir, m)
    where = {p["name"]: (p["unit"], p["offset"]) for p in m["params"]}
    with torch.no_grad():
        for u in engine.units:
            resident, held = engine.impl.working_extent(u)  # held contains the master extent
            ext = engine.impl.master_extent(u)
            master = _extent(u, reader, where, "master", held, resident.device)
            resident.copy_(master)  # rounded to the compute dtype, as refresh_working does
            if u.master.untyped_storage().data_ptr() != resident.untyped_storage().data_ptr():
                u.master.copy_(master[ext.start - held.start : ext.stop - held.start])
            for x, state in u.opt.items():
                state.copy_(_extent(u, reader, where, x, ext, state.device))
            reader.drop()
        name = f"r{engine.rank:04d}.bin"
        if m["world_size"] == engine.world_size:  # the same rank's RNG; else left as it is
            torch.set_rng_state(reader.tensor(name, "rng:torch_cpu").clone())
            entries = m["files"][name]["entries"]
            if engine.device.type == "cuda" and "rng:cuda" in entries:
                torch.cuda.set_rng_state(reader.tensor(name, "rng:cuda").clone(), engine.device)
        for key, b in _buffers(engine.module):
            saved = reader.tensor("r0000.bin", f"buffer:{key}")
            if tuple(saved.shape) != tuple(b.shape):
                raise ValueError(
                    f"buffer {key!r}: checkpoint shape {tuple(saved.shape)}, model shape "
                    f"{tuple(b.shape)}"
                )
            b.copy_(saved)
    engine.t, engine.data_step = m["t"], m["data_step"]
    if engine.config.precision != "fp16":
        engine.scaler = None
    elif m["scaler"] is not None:
        engine.scaler = ScalerState(**m["scaler"])
    else:  # saved without loss scaling: start the scaler afresh
        engine.scaler = scaler_init(engine.config.scaler)
    return CheckpointInfo(
        directory=step_dir,
        data_step=m["data_step"],
        t=m["t"],
        world_size=m["world_size"],
        stage=m["stage"],
        extra=m["extra"],
    )


def load(engine, directory) -> CheckpointInfo:
    """Load a checkpoint saved at any world size and stage into this engine; call on every rank.

    `directory` is a root (its `latest` is read) or a step directory. The engine's own config
    (hyper-parameters, M, precision) stays in force; the model, the optimizer kind and each
    parameter's group must match the checkpoint. Every file read is checked against its sha256.
    If any rank fails, every rank raises (CheckpointError or ValueError naming the problem).
    The RNG state is restored only at the world size it was saved at (docs/design.md §2: randomness
    comes from (seed, data step, micro-batch), never from the rank, so nothing depends on it).
    """
    _check_idle(engine, "load")
    info, error = None, None
    try:
        info = _load_here(engine, directory)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"load from {directory}")
    return info


# -- consolidation -------------------------------------------------------------------------------


def _torch_param_groups(kind: str, hypers: list[dict], indices: list[list[int]]) -> list[dict]:
    """torch.optim's own param_groups: each group as this torch version's optimizer writes it
    (every default key present), with our hyper-parameters and parameter indices."""
    cls = getattr(torch.optim, TORCH_OPTIMIZERS[kind])
    groups = []
    for hp, idx in zip(hypers, indices, strict=True):
        probe = cls([torch.zeros(1, requires_grad=True)], **torch_kwargs(kind, hp))
        group = probe.state_dict()["param_groups"][0]
        group["params"] = list(idx)
        groups.append(group)
    return groups


def consolidate(directory) -> dict:
    """One plain state dict from a checkpoint, without an engine or a process group:

        {"model": {state_dict key: fp32 tensor},      # model.load_state_dict(...) takes it
         "optimizer": {"state": ..., "param_groups": ...},  # torch.optim.<Kind>.load_state_dict
         "param_names": [[names of group 0], ...],    # the order torch.optim's groups must have
         "meta": {step, t, data_step, scaler, optimizer, world_size, stage, ...}}

    Parameter i of the optimizer state is the i-th name of param_names flattened: group by
    group, each in the model's named_parameters() order. So for one group,
    `torch.optim.AdamW(model.parameters())` matches; for several, build each group's list in
    module order. Every value is the fp32 master bit for bit; Adam's "step" is t as a float32
    tensor (torch's own convention), SGD keeps "momentum_buffer" only when momentum != 0.
    """
    step_dir = resolve(directory)
    m = read_manifest(step_dir)
    reader = _Reader(step_dir, m)
    units = m["units"]
    kind, t = m["config"]["optimizer"], m["t"]
    hypers = m["config"]["groups"]

    def value(p: dict, key: str) -> torch.Tensor:
        numel = 1
        for d in p["shape"]:
            numel *= d
        if key not in units[p["unit"]]["states"]:
            return torch.zeros(p["shape"])
        return reader.range(p["unit"], key, p["offset"], p["offset"] + numel).view(p["shape"])

    masters = {p["name"]: value(p, "master") for p in m["params"]}
    model = {}
    for key, src in m["state_dict_keys"]:
        if src.startswith("buffer:"):
            model[key] = reader.tensor("r0000.bin", src).clone()
        else:
            model[key] = masters[src]
    names = [[p["name"] for p in m["params"] if p["group"] == g] for g in range(len(hypers))]
    by_name = {p["name"]: p for p in m["params"]}
    state, indices, i = {}, [], 0
    for g, group_names in enumerate(names):
        indices.append(list(range(i, i + len(group_names))))
        for name in group_names:
            p, entry = by_name[name], {}
            if t >= 1 and kind == "sgd" and hypers[g]["momentum"]:
                entry["momentum_buffer"] = value(p, "momentum_buffer")
            elif t >= 1 and kind != "sgd":
                entry["step"] = torch.tensor(float(t), dtype=torch.float32)
                entry["exp_avg"] = value(p, "exp_avg")
                entry["exp_avg_sq"] = value(p, "exp_avg_sq")
            if entry:
                state[i] = entry
            i += 1
    meta = {
        k: m[k]
        for k in ("format_version", "name", "t", "data_step", "scaler", "world_size", "stage")
    }
    meta.update(optimizer=kind, precision=m["config"]["precision"], extra=m["extra"])
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": _torch_param_groups(kind, hypers, indices)},
        "param_names": names,
        "meta": meta,
    }


def consolidate_to(directory, out) -> Path:
    """consolidate(directory), written to `out` with torch.save (temp file, fsync, rename)."""
    import io

    out = Path(out)
    buf = io.BytesIO()
    torch.save(consolidate(directory), buf)
    _write_durably(out, [buf.getbuffer()])
    _fsync_dir(out.parent if str(out.parent) else Path("."))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zero.checkpoint", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one plain PyTorch state dict")
    c.add_argument("directory", help="a checkpoint root (follows `latest`) or a step directory")
    c.add_argument("out", help="output file (torch.save)")
    v = sub.add_parser("verify", help="check the manifest and every file's sha256")
    v.add_argument("directory")
    args = p.parse_args(argv)
    try:
        if args.command == "consolidate":
            out = consolidate_to(args.directory, args.out)
            print(f"wrote {out} from {resolve(args.directory)}")
        else:
            m = verify(args.directory)
            print(
                f"{resolve(args.directory)}: {len(m['files'])} files verified; step "
                f"{m['data_step']}, t {m['t']}, N {m['world_size']}, stage {m['stage']}"
            )
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
