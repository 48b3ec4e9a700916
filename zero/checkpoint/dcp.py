"""torch.distributed.checkpoint (DCP), both ways: the engine's state as a DCP checkpoint that
plain PyTorch and FSDP2 read, and a DCP checkpoint loaded at any N and stage.

    save_dcp(engine, "out/dcp-7")   # every rank; each writes only what it holds, nothing gathered
    load_dcp(engine, "out/dcp-7")   # every rank; each reads only the ranges it holds

The keys and chunks are zero/checkpoint/dcp_plan.py's ([Note: DCP keys], [Note: DCP boxes]).
Legend: N ranks, u a unit, L its shard length; rank r owns [r·L, (r+1)·L) of each unit's padded
flat buffer; "extent" a range of that buffer.

[Note: DCP writes] Each rank writes the chunks of its own shard [r·L, (r+1)·L) of every unit's
master, optimizer states and frozen values (at stages 0-2 it holds more and writes only that);
rank 0 also the step counts, param_groups, EXTRA_KEY and the buffers; DCP's coordinator then
writes .metadata. Everything goes into a fresh temporary sibling folder `.NAME.XXXXXXXX.tmp`
(DCP fsyncs each file), which rank 0 renames to NAME once every rank has written: NAME never
exists half-written, and a failed save removes the temporary folder. NAME must not exist.

[Note: DCP reads] Each rank asks for exactly what it holds: the master over its working extent
(whole at stages 0-2 and for persistent units, its shard at stage 3), which contains the master
extent; each optimizer state over the master extent; frozen values over their working extent;
whole buffers; and the scalars. Alignment gaps and padding are left as they are (zeros, as every
optimizer keeps them). Before any tensor of the engine is written, the checkpoint is checked
against the model on every rank (one line per refusal: a missing or short data file, a key
missing on either side, a shape that differs), and a first, small read takes the step counts,
the buffers and EXTRA_KEY into fresh tensors and checks them: any refusal so far leaves the
engine unchanged. The second read then goes straight into the engine's own buffers (the master
extent into u.master, the rest of the working extent into the working copy, each state into
u.opt, frozen values into theirs): DCP's reader loads one saved chunk at a time and copies it
into place, so a rank's memory grows by about one saved chunk, not by a copy of its shard. A
failure during that read (a data file that turns out unreadable midway) leaves the engine partly
loaded: a guard set on every rank before the read (instance attributes `at` and `forward` over
the engine's methods), cleared only once every rank has read everything, makes every later call
(step, forward, backward, save, load, gather) refuse with one line naming the checkpoint, until
a new load_dcp succeeds or a new engine is built; partly_loaded(engine) names the checkpoint.
After the read the working copies, the buffers and the counters are set. DCP's .metadata is a
pickle: load only checkpoints you trust, as with torch.load(weights_only=False).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..introspect import Introspect
from .commit import _buffers
from .dcp_plan import (
    DCP_FORMAT,
    DCP_VERSION,
    EXTRA_KEY,
    Chunk,
    LoadPlanner,
    SavePlanner,
    Targets,
    kept_states,
    load_targets,
    param_keys,
    save_chunks,
    scalars,
)
from .format import CheckpointError, _agree, _broadcast, _check_idle, _fsync_dir, scope

METADATA = ".metadata"  # DCP's own name for the file its coordinator writes last

# -- save ----------------------------------------------------------------------------------------


def _refuse(engine, what: str) -> None:
    if getattr(engine, "mp", None) is not None:
        raise ValueError(
            f"{what}: a model-parallel engine (zero/mp/) has no DCP path; allowed is a plain "
            "engine (engine.save and engine.load serve model-parallel ones)"
        )


def _dcp_error(what: str, exc: CheckpointException) -> CheckpointError:
    """DCP's multi-rank traceback as one line: the first rank that failed and its error."""
    failures = sorted(exc.failures.items())
    rank, (error, _) = failures[0]
    more = f" (and on ranks {[r for r, _ in failures[1:]]})" if len(failures) > 1 else ""
    text = " ".join(str(error).split())  # torch's messages may span lines
    return CheckpointError(f"{what}: rank {rank}: {type(error).__name__}: {text}{more}")


def _fresh_folder(target: Path, given) -> str:
    """Rank 0: the temporary sibling folder a save writes into ([Note: DCP writes])."""
    if os.path.lexists(target):
        raise ValueError(
            f"directory={str(given)!r}: exists; allowed is a path that does not exist yet "
            "(a DCP checkpoint is written whole into a temporary folder, then renamed to it)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; others may read checkpoints
    return tmp


def save_dcp(engine: Introspect, directory) -> Path:
    """Save the engine's state as a DCP checkpoint in the new folder `directory`; call on every
    rank. Each rank writes only the chunks of its own shards ([Note: DCP writes]); the keys are
    torch.distributed.checkpoint.state_dict's, flattened ([Note: DCP keys]). Returns the folder.
    If any rank fails, every rank raises and nothing is left at `directory`."""
    _refuse(engine, "save_dcp")
    engine.at("save")  # every rank saves together ([Note: collective fingerprints])
    _check_idle(engine, "save_dcp")
    group, _, rank = scope(engine)
    target, tmp, error = Path(directory), None, None
    if rank == 0:
        try:
            tmp = _fresh_folder(target, directory)
        except (OSError, ValueError) as exc:
            error = exc
    tmp = _broadcast(engine, tmp)
    _agree(engine, error, f"save_dcp to {target}")

    def abandon():  # rank 0, once every rank has stopped writing into tmp
        if rank == 0:
            _rmtree(Path(tmp))

    planner, error = None, None
    try:
        aliases, buffers = param_keys(engine)
        tensors, objects = scalars(engine, aliases, buffers) if rank == 0 else ({}, {})
        planner = SavePlanner(save_chunks(engine, aliases), tensors, objects)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"save_dcp to {target}", on_failure=abandon)
    error = None
    try:  # DCP's own collectives report a failure on one rank to every rank
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        dcp.save({}, storage_writer=writer, planner=planner, process_group=group)
    except CheckpointException as exc:
        error = _dcp_error(f"save_dcp to {target}", exc)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"save_dcp to {target}", on_failure=abandon)
    error = None
    if rank == 0:
        try:
            _fsync_dir(Path(tmp))
            os.rename(tmp, target)
            _fsync_dir(target.parent)
        except OSError as exc:
            error = exc
            abandon()
    _agree(engine, error, f"save_dcp to {target}")
    return target


def _rmtree(d: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(d)


# -- load ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DcpInfo:
    """What load_dcp() restored."""

    directory: Path
    t: int  # optimizer steps taken
    data_step: int  # the data position: the next step to run (train_steps' start_step)
    steps: dict  # parameter name -> its own optimizer steps
    world_size: int | None  # N at save (None: not saved by this engine)
    stage: int | None  # the stage at save (None: not saved by this engine)
    elements_read: int  # tensor elements this rank asked DCP for ([Note: DCP reads])


def _read_metadata(directory):
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"directory={str(directory)!r}: not a folder; allowed is a DCP checkpoint folder "
            f"(one holding {METADATA})"
        )
    if not os.path.isfile(path / METADATA):
        raise CheckpointError(
            f"{path}: no {METADATA}: not a DCP checkpoint, or a save that never finished"
        )
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"{path / METADATA}: unreadable ({type(exc).__name__}: {exc})"
        ) from None


def _check_files(path: Path, md) -> None:
    """Every data file .metadata names is a regular file long enough for what it places there."""
    needs: dict[str, tuple[int, str]] = {}
    for index, info in (md.storage_data or {}).items():
        end = info.offset + info.length
        if end > needs.get(info.relative_path, (-1, ""))[0]:
            needs[info.relative_path] = (end, index.fqn)
    for name, (end, key) in sorted(needs.items()):
        f = path / name
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            raise CheckpointError(
                f"{f}: missing shard file ({METADATA} places key {key!r} in it)"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{f}: not a regular file ({METADATA} places key {key!r} in it)")
        if st.st_size < end:
            raise CheckpointError(
                f"{f}: {st.st_size} bytes, but {METADATA} places key {key!r} up to byte {end}"
            )


def _state_owner(key: str, names) -> str | None:
    """The parameter whose optimizer state `key` ("state.<fqn>.<...>") is, if the model has it."""
    parts = key.split(".")[1:]
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in names:
            return ".".join(parts[:i])
    return None


def _check_keys(engine, path: Path, md, chunks: list[Chunk], aliases, buffers) -> None:
    """The first key this rank needs that the checkpoint lacks or shapes otherwise, then the
    first tensor key of the checkpoint that the model lacks."""
    saved = md.state_dict_metadata
    for key, shape in {c.key: c.size for c in chunks}.items():
        m = saved.get(key)
        if m is None:
            raise ValueError(
                f"{path}: key {key!r} (model shape {shape}) is not in the checkpoint "
                f"({len(saved)} keys)"
            )
        if not isinstance(m, TensorStorageMetadata):
            raise ValueError(f"{path}: key {key!r} (model shape {shape}) is not a tensor there")
        if tuple(m.size) != shape:
            raise ValueError(
                f"{path}: key {key!r}: checkpoint shape {tuple(m.size)}, model shape {shape}"
            )
    model_keys = {k for keys in aliases.values() for k in keys} | set(buffers)
    for key, m in saved.items():  # the model's own keys first, then the optimizer's
        plain = not key.startswith(("state.", "param_groups.")) and key != EXTRA_KEY
        if plain and isinstance(m, TensorStorageMetadata) and key not in model_keys:
            raise ValueError(
                f"{path}: key {key!r} (checkpoint shape {tuple(m.size)}) is not in the model"
            )
    for key in saved:
        if not key.startswith("state."):
            continue
        name = _state_owner(key, aliases)
        if name is None:
            raise ValueError(f"{path}: key {key!r}: the state of a parameter not in the model")
        if name not in engine.group_index:
            raise ValueError(
                f"{path}: key {key!r}: parameter {name!r} has optimizer state in the "
                "checkpoint but is frozen here (requires_grad=False)"
            )


def _count(path: Path, where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{path}: {where}: {value!r}, not a step count (an integer >= 0)")
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise CheckpointError(f"{path}: {where}: {value!r}, not a step count (an integer >= 0)")
    return int(value)


def _extra(engine, path: Path, extra) -> dict:
    """EXTRA_KEY checked ({} when the checkpoint was not saved by this engine)."""
    if extra is None:
        return {}
    if not isinstance(extra, dict) or extra.get("format") != DCP_FORMAT:
        raise CheckpointError(f"{path}: key {EXTRA_KEY!r}: not this engine's record")
    if not isinstance(extra.get("version"), int) or extra["version"] > DCP_VERSION:
        raise CheckpointError(
            f"{path}: key {EXTRA_KEY!r}: version {extra.get('version')!r}; allowed is an "
            f"integer up to {DCP_VERSION}"
        )
    for field in ("t", "data_step"):
        _count(path, f"key {EXTRA_KEY!r}: {field}", extra.get(field))
    if extra.get("optimizer") != engine.config.optimizer:
        raise ValueError(
            f"optimizer={engine.config.optimizer!r}: the checkpoint {path} holds the states of "
            f"optimizer={extra.get('optimizer')!r}"
        )
    return extra


def _counters(engine, path: Path, targets: Targets, extra: dict) -> dict:
    """t, data_step, each t_p and the scaler, from the checkpoint; without EXTRA_KEY (a
    checkpoint of plain PyTorch, FSDP2): t_p from "state.<fqn>.step" (Adam), else 1 where a
    momentum buffer was read (torch.optim has one only after a step), t their maximum, the data
    position t."""
    from reference.precision import ScalerState, scaler_init

    if targets.steps:
        where = "key 'state.{}.step'"
        steps = {n: _count(path, where.format(n), v.item()) for n, v in targets.steps.items()}
    elif extra:
        saved = extra.get("steps") if isinstance(extra.get("steps"), dict) else {}
        steps = {
            n: _count(path, f"key {EXTRA_KEY!r}: steps[{n!r}]", saved.get(n))
            for n in engine.group_index
        }
    else:
        steps = {n: 1 if kept_states(engine, n) else 0 for n in engine.group_index}
    t = extra["t"] if extra else max(steps.values(), default=0)
    scaler = None
    if engine.config.precision == "fp16":
        scaler = scaler_init(engine.config.scaler)
        if extra.get("scaler") is not None:
            try:
                scaler = ScalerState(**extra["scaler"])
            except TypeError as exc:
                raise CheckpointError(f"{path}: key {EXTRA_KEY!r}: scaler: {exc}") from None
    return {
        "t": t,
        "data_step": extra["data_step"] if extra else t,
        "steps": steps,
        "scaler": scaler,
        "run_id": extra.get("run_id"),
    }


def _apply(engine, targets: Targets, counters: dict) -> None:
    """After the read: the working copies of the masters read into u.master, the buffers and the
    counters (no communication, nothing that can fail)."""
    with torch.no_grad():
        for resident, master in targets.synced:
            resident.copy_(master)  # rounded to the compute dtype, as refresh_working does
        module_buffers = dict(_buffers(engine.module))
        for key, values in targets.buffers.items():
            module_buffers[key].copy_(values)
    for u in engine.units:
        u.steps = [counters["steps"][n] for n, _ in u.params]
    engine.t, engine.data_step = counters["t"], counters["data_step"]
    engine.scaler = counters["scaler"]
    if counters["run_id"] is not None:  # [Note: run identity]: a resumed run is the same run
        engine.checkpoint_run_id = counters["run_id"]


def partly_loaded(engine) -> str | None:
    """The checkpoint whose load_dcp into `engine` did not finish reading, else None."""
    return getattr(vars(engine).get("at"), "partly_loaded", None)


def _guard(engine, path: Path) -> None:
    """[Note: DCP reads]: until a load_dcp finishes, every call of the engine refuses (each
    step, save, load and gather passes engine.at; an eval forward may not, so forward too)."""
    line = (
        f"load_dcp from {path} did not finish reading, so this engine is partly loaded; "
        "load a checkpoint again with load_dcp, or build a new engine"
    )

    def at(call: str) -> None:
        raise CheckpointError(f"{call} refused: {line}")

    def forward(*args, **kwargs):
        raise CheckpointError(f"forward refused: {line}")

    at.partly_loaded = forward.partly_loaded = str(path)
    engine.at, engine.forward = at, forward  # instance attributes over the methods


def _unguard(engine) -> None:
    for name in ("at", "forward"):
        if getattr(vars(engine).get(name), "partly_loaded", None) is not None:
            delattr(engine, name)


def _read(path: Path, group, planner: LoadPlanner) -> None:
    dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=planner, process_group=group)


def _prepare(engine, directory, path: Path):
    """Every check that needs no tensor data (files, keys, shapes): (targets, first planner)."""
    md = _read_metadata(directory)
    _check_files(path, md)
    aliases, buffers = param_keys(engine)
    targets = load_targets(engine, aliases, buffers)
    _check_keys(engine, path, md, targets.chunks + targets.small, aliases, buffers)
    wanted = [EXTRA_KEY] if EXTRA_KEY in md.state_dict_metadata else []
    return targets, LoadPlanner(targets.small, wanted)


def load_dcp(engine: Introspect, directory) -> DcpInfo:
    """Load a DCP checkpoint into this engine at any N and stage; call on every rank. Each rank
    reads only the ranges it holds, straight into its own buffers ([Note: DCP reads]). The
    checkpoint is this engine's (save_dcp) or any other with the same keys ([Note: DCP keys]):
    plain PyTorch's, FSDP2's. The engine's own config (hyper-parameters, M, precision) stays in
    force. If any rank fails, every rank raises (ValueError or CheckpointError, one line): before
    the read the engine is unchanged; during it, partly loaded, and it refuses every call but a
    new load_dcp."""
    _refuse(engine, "load_dcp")
    type(engine).at(engine, "load")  # every rank loads together; past _guard's refusal
    _check_idle(engine, "load_dcp")
    group, path = scope(engine)[0], Path(directory)
    targets, first, counters, error = None, None, None, None
    try:
        targets, first = _prepare(engine, directory, path)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"load_dcp from {path}")
    error = None
    try:  # the step counts, buffers and EXTRA_KEY into fresh tensors, then checked
        _read(path, group, first)
        extra = _extra(engine, path, first.objects.get(EXTRA_KEY))
        counters = _counters(engine, path, targets, extra)
    except CheckpointException as exc:
        error = _dcp_error(f"load_dcp from {path}", exc)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"load_dcp from {path}")
    planner, error = LoadPlanner(targets.chunks, []), None
    _guard(engine, path)  # cleared only once every rank has read everything
    try:
        _read(path, group, planner)
    except CheckpointException as exc:
        error = _dcp_error(f"load_dcp from {path}", exc)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"load_dcp from {path}")
    _apply(engine, targets, counters)
    _unguard(engine)
    return DcpInfo(
        directory=path,
        t=counters["t"],
        data_step=counters["data_step"],
        steps=counters["steps"],
        world_size=extra.get("world_size"),
        stage=extra.get("stage"),
        elements_read=first.elements + planner.elements,
    )
