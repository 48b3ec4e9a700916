"""Save: every rank writes its shards, then one atomic commit makes the checkpoint live.

Legend: N the world size at save time, L a unit's shard length, r a rank; ROOT the directory
given to save(), holding step directories and `latest` (zero/checkpoint/format.py).

[Note: atomic commit] (docs/design.md §3) 1. rank 0 creates a fresh step directory (never one that
exists, so the live checkpoint is never written into); 2. every rank writes its files (temp file,
fsync, rename) and fsyncs the directory, then all ranks exchange their checksums, which is the
barrier; 3. rank 0 writes manifest.json the same way and fsyncs the directory; 4. rank 0 switches
`latest` (temp file, fsync, os.replace, fsync ROOT). A directory without a manifest is an
interrupted save and is ignored; only after step 4 does rank 0 prune ([Note: run identity]).
A crash at any point leaves `latest` naming a complete, verifiable checkpoint. A save that
fails (a full disk, say) removes its own files before every rank raises: the temp file on the
rank that failed, the step directory on rank 0 once every rank has stopped writing into it.
Every removal of a step directory renames it to a trash name first ([Note: crash leftovers]).

[Note: crash leftovers] A save killed before its manifest leaves a step directory without one
(an empty one if killed at owner.json, its first file): `latest` never names it and resolve()
refuses a directory without a manifest, so it is never read, and save() removes it only when
its owner.json names the saving run. A removal (_remove) renames the step directory to a TRASH
name, then deletes it: a killed prune leaves trash, never a step directory holding part of its
files. The rest goes while the output directory is held exclusively (remove_leftovers in
zero/checkpoint/leftovers.py, called where [Note: leftover temp files] is): every trash folder,
and every step directory without manifest.json (the commit point, step 3) that `latest` does
not name. save(), which may share ROOT with another run's save in progress, removes only its
own run's trash and interrupted saves ([Note: run identity]).

[Note: run identity] Each engine's checkpoints carry a run id (the manifest's run_id; the
step directory's owner.json from its creation): a random id made at the engine's first save,
or the one of the checkpoint it loaded, so a resumed run is the same run. Pruning removes only
this run's own: committed checkpoints beyond `keep_last`, its interrupted saves and prunes.
Another run's checkpoints, a save in progress elsewhere, and whatever it cannot read are left
alone.

A model-parallel engine saves on all N_d·N_m ranks of its mesh in one commit: "every rank" above
is every (d, m), rank 0 is (0, 0), and each slice's files and records go where [Note: MP
checkpoint layout] (zero/checkpoint/mpformat.py) puts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import torch

from ..introspect import Introspect
from .format import (
    FORMAT,
    LATEST,
    MANIFEST,
    OWNER,
    POINTER_LIMIT,
    STEP_DIR,
    CheckpointError,
    _agree,
    _all_gather,
    _broadcast,
    _canonical,
    _check_idle,
    _fsync_dir,
    _tensor_file,
    _write_durably,
    notify_written,
    read_manifest_quietly,
    read_regular,
    scope,
)
from .mpformat import MP_FORMAT_VERSION
from .mpjoin import Place, file_prefix, mp_section, place

# -- save ----------------------------------------------------------------------------------------


def _own(engine, u, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice [r·L, (r+1)·L) of a tensor that covers the unit's master extent."""
    ext, own = engine.master_extent(u), u.part.own
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


def _write_rank_files(engine, step_dir: Path, pre: str) -> dict:
    """This rank's files; `pre` prefixes every name (a model-parallel slice's, file_prefix).
    [Note: HSDP checkpoints] With hierarchical sharding (zero/stages/hsdp.py) the replicas
    hold the same bits, so only the first shard group writes the units' files, as a world of
    G would; every rank writes its RNG file, as at N. The manifest records both N and G."""
    files = {}
    writes = engine.rank < engine.shard_size  # the first shard group (every rank without HSDP)
    for u in engine.units if writes else ():
        tensors = [("master", _own(engine, u, u.master))]
        tensors += [(x, _own(engine, u, t)) for x, t in sorted(u.opt.items())]
        name = f"{pre}u{u.index:04d}-r{engine.rank:04d}.bin"
        files[name] = _tensor_file(step_dir / name, tensors)
    for j, u in enumerate(engine.frozen_units if writes else ()):  # as held: compute dtype
        resident, held = engine.working_extent(u)
        own = resident[u.part.own.start - held.start : u.part.own.stop - held.start]
        name = f"{pre}f{j:04d}-r{engine.rank:04d}.bin"
        files[name] = _tensor_file(step_dir / name, [("frozen", own)])
    extra = _rng_tensors(engine)
    if engine.rank == 0:
        extra += [(f"buffer:{k}", b) for k, b in _buffers(engine.module)]
    name = f"{pre}r{engine.rank:04d}.bin"
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


def _slice(engine, pre: str) -> dict:
    """What a manifest says of this engine's model (one slice's, with model parallelism):
    params, units, frozen_units, state_dict_keys, rng (mpformat.SLICE_KEYS)."""
    n = engine.shard_size  # the units' files: N, or G ([Note: HSDP checkpoints])
    where = {}
    for u in engine.units:
        for s in u.part.layout.slots:
            where[s.name] = (u.index, s.offset)
    for j, u in enumerate(engine.frozen_units):
        for s in u.part.layout.slots:
            where[s.name] = (j, s.offset)
    first = {id(p): k for k, p in engine.module.named_parameters()}  # tied: the first name
    aliases: dict[str, list[str]] = {}
    canonical: dict[str, str] = {}
    for pname, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(first[id(p)], []).append(pname)
        canonical[pname] = first[id(p)]
    params, steps = [], engine.param_steps()
    for pname, p in engine.module.named_parameters():  # module order: torch.optim's order
        unit, offset = where[pname]
        entry = {
            "name": pname,
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),  # the working (compute) dtype
            "group": engine.group_index.get(pname),  # None: frozen
            "unit": unit,  # an index into "units", or into "frozen_units" when frozen
            "offset": offset,
            "aliases": aliases[pname],
        }
        if pname in engine.group_index:
            entry["step"] = steps[pname]  # t_p: since format version 2
        else:
            entry["frozen"] = True
        params.append(entry)

    units = [
        _layout(u)
        | {
            "master_whole": engine.master_extent(u) != u.part.own,
            "states": ["master", *sorted(u.opt)],
            "files": [f"{pre}u{u.index:04d}-r{r:04d}.bin" for r in range(n)],
        }
        for u in engine.units
    ]
    frozen_units = [
        _layout(u)
        | {
            "dtype": str(u.working.dtype).removeprefix("torch."),
            "files": [f"{pre}f{j:04d}-r{r:04d}.bin" for r in range(n)],
        }
        for j, u in enumerate(engine.frozen_units)
    ]
    return {
        "params": params,
        "units": units,
        **({"frozen_units": frozen_units} if frozen_units else {}),
        "state_dict_keys": _state_dict_keys(engine.module, canonical),
        "rng": {
            "files": [f"{pre}r{r:04d}.bin" for r in range(engine.world_size)],
            "restored_at_same_world_size": True,
        },
    }


def _layout(u) -> dict:
    """A unit's layout as a manifest has it: what validate.py recomputes from the parameters'
    shapes."""
    return {
        "name": u.name,
        "params": [s.name for s in u.part.layout.slots],
        "layout_numel": u.part.layout.layout_numel,
        "shard_numel": u.part.shard_numel,
        "padded_numel": u.part.padded_numel,
    }


def _state_dict_keys(module, canonical: dict[str, str]) -> list[tuple[str, str]]:
    """(state_dict() key, the parameter's canonical name or "buffer:" and the buffer's), in
    state_dict() order; a shared module's keys once."""
    sd_keys = []
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for key, p in mod._parameters.items():
            if p is not None:
                full = f"{prefix}.{key}" if prefix else key
                sd_keys.append([full, canonical[full]])
        for key, b in mod._buffers.items():
            if b is not None and key not in mod._non_persistent_buffers_set:
                full = f"{prefix}.{key}" if prefix else key
                sd_keys.append([full, f"buffer:{full}"])
    return list(dict(sd_keys).items())


def _manifest(engine, name: str, files: dict, extra, sequence: int, run_id: str, records, here):
    """The manifest: the records of the one model (_slice) at its top, or of each slice under
    "mp" ([Note: MP checkpoint layout]); every file's entry and sha256; the checksum."""
    mp = {} if here is None else {"mp": mp_section(here, records)}
    g = engine.shard_size  # [Note: HSDP checkpoints]
    body = {
        "format": FORMAT,
        "format_version": 2 if here is None else MP_FORMAT_VERSION,
        "name": name,
        "sequence": sequence,
        "run_id": run_id,
        "world_size": engine.world_size,
        **({"shard_group_size": g} if g != engine.world_size else {}),  # HSDP's G
        "stage": engine.config.stage,
        "t": engine.t,
        "data_step": engine.data_step,
        "scaler": None if engine.scaler is None else dataclasses.asdict(engine.scaler),
        "config": _config_record(engine.config),
        **(records[0] if here is None else mp),
        "files": files,
        "extra": extra,
        "torch_version": torch.__version__,
        "byteorder": sys.byteorder,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return {**body, "checksum": hashlib.sha256(_canonical(body)).hexdigest()}


def _step_dirs(root: Path) -> list[Path]:
    """Step directories directly under root: real directories (never through a link)."""
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if STEP_DIR.fullmatch(d.name) and not d.is_symlink() and d.is_dir():
            out.append(d)
    return out


def _sequence_after(root: Path) -> int:
    """One more than the newest committed sequence number under root."""
    seqs = [-1]
    for d in _step_dirs(root):
        m = read_manifest_quietly(d)
        if m is not None:
            seqs.append(m["sequence"])
    return max(seqs) + 1


def _fresh_step_dir(root: Path, data_step: int, run_id: str) -> str:
    base = f"step-{data_step:08d}"
    name, k = base, 0
    while True:  # never write into an existing (maybe the live) directory
        try:
            (root / name).mkdir()
            break
        except FileExistsError:
            k += 1
            name = f"{base}-{k}"
    owner = {"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname()}
    _write_durably(root / name / OWNER, [json.dumps(owner).encode()])
    _fsync_dir(root)
    return name


def _owner(d: Path) -> str | None:
    """The run id in a step directory's owner.json, None if it has none that reads."""
    try:
        return json.loads(read_regular(d / OWNER, limit=POINTER_LIMIT))["run_id"]
    except (OSError, CheckpointError, ValueError, KeyError, TypeError):
        return None


TEMP_FILE = re.compile(r"\.(latest|manifest\.json|owner\.json|[\w.-]+\.bin)\.[a-z0-9_]{8}\.tmp")
"""The temp files _write_durably makes in a checkpoint root (for `latest`) and in a step directory
(the manifest, owner.json, shard and RNG files): `.NAME.` + mkstemp's 8 characters + `.tmp`."""


def remove_temps(root) -> list[Path]:
    """Remove the temp files of dead writers under a checkpoint root (the root and its step
    directories); returns them. Call only while holding the root exclusively.

    [Note: leftover temp files] A writer removes its own temp file on any exception, but one killed
    between mkstemp and the rename (SIGKILL, or a signal before its cleanup runs) leaves it behind,
    and no later save would notice. Whether the writer of a temp file still lives cannot be told
    from the file, so the rule is about the caller: python -m zero.workloads.train calls this
    holding OUT/run.lock (zero/checkpoint/lock.py), before its ranks start; every writer of
    OUT/ckpt is a rank of the lock's holder, so every such file there is a dead writer's. save()
    never calls it: another process may be saving into the same root at that moment."""
    root, gone = Path(root), []
    dirs = [root, *_step_dirs(root)] if root.is_dir() and not root.is_symlink() else []
    for d in dirs:
        for f in d.iterdir():
            in_root = f.name.startswith(f".{LATEST}.")  # `latest` lives in the root only
            plain = f.is_symlink() or f.is_file()
            if TEMP_FILE.fullmatch(f.name) and in_root == (d == root) and plain:
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
                    gone.append(f)
    if gone:
        for d in {f.parent for f in gone}:
            _fsync_dir(d)
    return gone


TRASH = re.compile(r"\.trash-(step-\d{8,}(?:-\d+)?)\.([0-9a-f]{12})\.[0-9a-f]{8}")
"""A step directory being removed: `.trash-` + its name + its run's tag (_run_tag) + 8 random
hex digits. No reader takes it for a checkpoint: `latest` and every listing of step directories
accept only STEP_DIR's names ([Note: crash leftovers])."""


def _run_tag(run_id: str) -> str:
    return hashlib.sha256(run_id.encode()).hexdigest()[:12]


def _rmtree(d: Path) -> None:
    """shutil.rmtree, where what is already gone is no error (a remover cut short before)."""

    def gone_already(function, path, excinfo):
        if not issubclass(excinfo[0], FileNotFoundError):
            raise excinfo[1]

    shutil.rmtree(d, onerror=gone_already)


def _remove(root: Path, d: Path, run_id: str) -> None:
    """Remove the step directory d in one step ([Note: crash leftovers]): renamed to a trash name
    (durably), then deleted; a crash midway leaves trash, never a step directory with a part of
    its files."""
    trash = root / f".trash-{d.name}.{_run_tag(run_id)}.{uuid.uuid4().hex[:8]}"
    os.rename(d, trash)
    _fsync_dir(root)
    _rmtree(trash)


def _prune(root: Path, current: str, keep_last: int | None, run_id: str) -> list[str]:
    """Remove this run's interrupted saves and prunes, and its committed checkpoints beyond
    keep_last; nothing else ([Note: run identity], [Note: crash leftovers])."""
    committed, removed, tag = [], [], _run_tag(run_id)
    for t in sorted(root.iterdir()):
        found = TRASH.fullmatch(t.name)
        if found and found[2] == tag and t.is_dir() and not t.is_symlink():
            _rmtree(t)  # this run's removal, cut short
            removed.append(t.name)
    for d in _step_dirs(root):
        if d.name == current:
            continue
        if not os.path.lexists(d / MANIFEST):
            if _owner(d) == run_id:  # this run's interrupted save
                _remove(root, d, run_id)
                removed.append(d.name)
            continue
        m = read_manifest_quietly(d)
        if m is not None and m.get("run_id") == run_id:
            committed.append((m["sequence"], d))
    if keep_last is not None:
        committed.sort()
        for _, d in committed[: max(0, len(committed) - (keep_last - 1))]:
            _remove(root, d, run_id)
            removed.append(d.name)
    if removed:
        _fsync_dir(root)
    return removed


def _run_id(engine) -> str:
    """This engine's run ([Note: run identity]): rank 0's fresh id at the first save."""
    run_id = engine.checkpoint_run_id
    if run_id is None:
        run_id = _broadcast(engine, uuid.uuid4().hex if scope(engine)[2] == 0 else None)
        engine.checkpoint_run_id = run_id
    return run_id


def save(engine: Introspect, directory, *, keep_last: int | None = None, extra=None) -> Path:
    """Save every rank's state into a new step directory under `directory`; call on every rank.

    keep_last: after the commit, keep only this many committed step directories (None: all).
    extra: any JSON value (a data loader's position, say), returned by load() as info.extra.
    Returns the committed step directory. Protocol: [Note: atomic commit]. A model-parallel
    engine saves on every rank of its mesh ([Note: MP checkpoint layout]).
    """
    here: Place | None = place(engine)  # refuses a model-parallel engine it cannot describe
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last={keep_last!r}: must be None or an integer >= 1")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra={extra!r}: must be JSON-serialisable ({exc})") from None
    engine.at("save")  # every rank saves together ([Note: collective fingerprints])
    _check_idle(engine, "save")
    root = Path(directory)
    run_id = _run_id(engine)
    name, error, lead = None, None, scope(engine)[2] == 0  # rank (0, 0) with model parallelism
    if lead:
        try:
            root.mkdir(parents=True, exist_ok=True)
            name = _fresh_step_dir(root, engine.data_step, run_id)
        except OSError as exc:
            error = exc
    name = _broadcast(engine, name)
    _agree(engine, error, f"save to {root}")
    step_dir = root / name

    def abandon():  # rank 0, once every rank has stopped writing into step_dir
        if lead:
            with contextlib.suppress(OSError):
                _remove(root, step_dir, run_id)

    files, record, error = None, None, None
    try:
        files = _write_rank_files(engine, step_dir, file_prefix(here))
        if engine.rank == 0:  # DP rank 0 of each slice describes it (model order: m order)
            record = _slice(engine, file_prefix(here))
    except Exception as exc:  # reported to every rank below, so none waits forever
        error = exc
    every = _all_gather(engine, (files, record))  # the barrier: every rank's files are durable
    _agree(engine, error, f"save to {step_dir}", on_failure=abandon)
    error, committed = None, False
    if lead:
        try:
            all_files = {k: v for f, _ in every for k, v in f.items()}
            records = [r for _, r in every if r is not None]
            seq = _sequence_after(root)
            manifest = _manifest(engine, name, all_files, extra, seq, run_id, records, here)
            _write_durably(step_dir / MANIFEST, [json.dumps(manifest, indent=1).encode()])
            _fsync_dir(step_dir)
            notify_written(step_dir / MANIFEST)
            _write_durably(root / LATEST, [f"{name}\n".encode()])
            committed = True  # the rename is done: `latest` names step_dir
            _fsync_dir(root)
            notify_written(root / LATEST)
            _prune(root, name, keep_last, run_id)
        except Exception as exc:
            error = exc
            if not committed:  # `latest` still names the previous checkpoint
                abandon()
    _agree(engine, error, f"commit of {step_dir}")
    return step_dir
