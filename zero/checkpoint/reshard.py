"""Load: a checkpoint saved at any world size and stage, resharded while it is read.

Legend: N1 the world size a checkpoint was saved at, N2 the one it is loaded at; L1, L2 their
shard lengths; a unit's *layout* (the parameters' offsets, reference/layout.py) is the first
layout_numel elements of its padded buffer. "Extent" is a range of the padded buffer.

[Note: resharding by layout] A unit's layout does not depend on N; only the zero padding after
it does. So loading never assembles a parameter: for each extent a rank holds at N2 (its master
and optimizer-state shard; its working copy, whole at stages 0-2), each parameter slot that
overlaps it is copied from the saved files that hold that slot's range, wherever the parameter
lived at save time (another unit split or chunk size works too). Alignment gaps and padding are
zeros, which is what every optimizer keeps in them (zero/optim/update.py), so the copy is exact. A
rank reads and hashes whole files: at the same N only its own, at stages 0-2 every file of a unit
(the working copy is whole there). Limitation: a file is read into memory whole, so a unit's shard
must fit in host memory; no I/O is overlapped with compute.

A model-parallel engine loads a checkpoint of any (N_d, N_m), a plain one included, and a plain
engine one of a model-parallel engine: zero/checkpoint/mpjoin.py's Source hands each slot its
slice's values ([Note: joining slices]); the names and whole shapes must agree.
"""

from __future__ import annotations

import torch

from ..introspect import Introspect
from .commit import _buffers
from .format import CheckpointInfo, _agree, _check_idle, read_manifest, resolve, saved_steps
from .mpformat import whole_params
from .mpjoin import Source, place, whole_shapes

# -- load ----------------------------------------------------------------------------------------


def _check_model(engine, m: dict, shapes: dict, mesh: str) -> None:
    """The first parameter (in module order) that differs, named with both shapes (with model
    parallelism on either side, the plain model's shapes: `mesh` says so)."""
    saved = {p["name"]: p for p in whole_params(m)}
    mine = dict(engine.module.named_parameters())
    for name in mine:
        if name not in saved:
            raise ValueError(
                f"parameter {name!r}: model shape {shapes[name]}, not in the checkpoint "
                f"(which has {len(saved)} parameters){mesh}"
            )
        if tuple(saved[name]["shape"]) != shapes[name]:
            raise ValueError(
                f"parameter {name!r}: checkpoint shape {tuple(saved[name]['shape'])}, model "
                f"shape {shapes[name]}{mesh}"
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
    for name, p in mine.items():
        if saved[name].get("frozen", False) != (not p.requires_grad):
            was = "frozen" if saved[name].get("frozen", False) else "trainable"
            raise ValueError(
                f"parameter {name!r}: requires_grad={p.requires_grad} here, {was} in the "
                "checkpoint (frozen parameters have no master or optimizer state to restore)"
            )
        if not p.requires_grad:
            continue
        g_saved, g_mine = saved[name]["group"], engine.group_index[name]
        if g_saved != g_mine:
            raise ValueError(
                f"parameter {name!r}: parameter group {g_mine} here, {g_saved} in the checkpoint"
            )


def _extent(u, source: Source, key: str, ext: slice, device) -> torch.Tensor:
    """fp32 values of state `key` over elements `ext` of unit u's padded buffer at N2, copied
    slot by slot from the saved files ([Note: resharding by layout])."""
    out = torch.zeros(ext.stop - ext.start)
    for s in u.part.layout.slots:
        lo, hi = max(ext.start, s.offset), min(ext.stop, s.offset + s.numel)
        if lo >= hi:
            continue
        values = source.read(s.name, key, lo - s.offset, hi - s.offset)
        if values is None:
            continue  # a state this optimizer did not keep then: zeros, as a fresh one starts
        out[lo - ext.start : hi - ext.start] = values
    return out.to(device)


def _load_here(engine: Introspect, directory) -> CheckpointInfo:
    from reference.precision import ScalerState, scaler_init

    step_dir = resolve(directory)
    m = read_manifest(step_dir)
    here, n_m = place(engine), m.get("mp", {}).get("size", 1)
    mesh = ""
    if here is not None or n_m > 1:
        mine = 1 if here is None else here.n
        mesh = f" (whole shapes: the checkpoint's N_m = {n_m} slices, the model's N_m = {mine})"
    _check_model(engine, m, whole_shapes(engine, here), mesh)
    source = Source(step_dir, m, here)
    with torch.no_grad():
        for u in engine.units:
            resident, held = engine.working_extent(u)  # held contains the master extent
            ext = engine.master_extent(u)
            master = _extent(u, source, "master", held, resident.device)
            resident.copy_(master)  # rounded to the compute dtype, as refresh_working does
            if u.master.untyped_storage().data_ptr() != resident.untyped_storage().data_ptr():
                u.master.copy_(master[ext.start - held.start : ext.stop - held.start])
            for x, state in u.opt.items():
                state.copy_(_extent(u, source, x, ext, state.device))
            source.drop()
        for u in engine.frozen_units:  # the held values, whole or this rank's shard
            resident, held = engine.working_extent(u)
            resident.copy_(_extent(u, source, "frozen", held, resident.device))
            source.drop()
        name = source.rng_file(engine.rank, engine.world_size)
        reader, buffers = source.buffers()
        if name is not None:  # the same rank's RNG (same N_d, N_m); else left as it is
            torch.set_rng_state(reader.tensor(name, "rng:torch_cpu").clone())
            entries = m["files"][name]["entries"]
            if engine.device.type == "cuda" and "rng:cuda" in entries:
                torch.cuda.set_rng_state(reader.tensor(name, "rng:cuda").clone(), engine.device)
        for key, b in _buffers(engine.module):
            saved = reader.tensor(buffers, f"buffer:{key}")
            if tuple(saved.shape) != tuple(b.shape):
                raise ValueError(
                    f"buffer {key!r}: checkpoint shape {tuple(saved.shape)}, model shape "
                    f"{tuple(b.shape)}"
                )
            b.copy_(saved)
    engine.t, engine.data_step = m["t"], m["data_step"]
    steps = saved_steps(m)
    for u in engine.units:
        u.steps = [steps[n] for n, _ in u.params]
    engine.checkpoint_run_id = m.get("run_id")  # [Note: run identity]; None before format 2
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
        steps=steps,
        world_size=m["world_size"],
        stage=m["stage"],
        extra=m["extra"],
        mp=n_m,
    )


def load(engine: Introspect, directory) -> CheckpointInfo:
    """Load a checkpoint saved at any world size and stage into this engine; call on every rank.

    `directory` is a root (its `latest` is read) or a step directory. The engine's own config
    (hyper-parameters, M, precision) stays in force; the model, the optimizer kind and each
    parameter's group must match the checkpoint. Every file read is checked against its sha256.
    If any rank fails, every rank raises (CheckpointError or ValueError naming the problem).
    The RNG state is restored only at the world size it was saved at (docs/design.md §2: randomness
    comes from (seed, data step, micro-batch), never from the rank, so nothing depends on it).
    A model-parallel engine loads on every rank of its mesh, from a checkpoint of any (N_d, N_m)
    whose parameters' names and whole shapes are its own ([Note: joining slices]).
    """
    engine.at("load")  # every rank loads together ([Note: collective fingerprints])
    _check_idle(engine, "load")
    info, error = None, None
    try:
        info = _load_here(engine, directory)
    except Exception as exc:
        error = exc
    _agree(engine, error, f"load from {directory}")
    return info
