"""Helpers of tests/distributed/test_dcp.py: the functions its rank pools run (module level, so
that forked workers unpickle them by reference) and the plain-PyTorch side of the exchange
(torch.distributed.checkpoint.state_dict, flattened). Nothing here is a test.
"""

import math
import warnings

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from reference.optim import state_names
from tests.helpers.dcp_cases import HYPERS, build, compare_states, state_of
from tests.helpers.engine_tools import patched
from zero.checkpoint.dcp import load_dcp, save_dcp
from zero.checkpoint.dcp_plan import SavePlanner
from zero.checkpoint.format import CheckpointError
from zero.config import decay_matrices_only
from zero.loop import train_steps
from zero.optim.plain import torch_optimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def own_ranges(eng) -> dict[str, tuple[int, int]]:
    """Each parameter's elements [lo, hi) (flat, row-major) inside this rank's own shard
    [r·L, (r+1)·L) of its unit: what this rank alone may write."""
    out = {}
    for u in [*eng.units, *eng.frozen_units]:
        own = u.part.own
        for s in u.part.layout.slots:
            lo, hi = max(own.start, s.offset), min(own.stop, s.offset + s.numel)
            if lo < hi:
                out[s.name] = (lo - s.offset, hi - s.offset)
    return out


def expected_read(eng) -> int:
    """The tensor elements a rank holds, counted from its extents: the master over the working
    extent, each kept state over the master extent, frozen values, Adam's step counts and the
    persistent buffers (gaps and padding excluded)."""
    cfg = eng.config

    def overlap(rng, s) -> int:
        return max(0, min(rng.stop, s.offset + s.numel) - max(rng.start, s.offset))

    total = 0
    for u in eng.units:
        held, ext = eng.working_extent(u)[1], eng.master_extent(u)
        for s in u.part.layout.slots:
            kept = state_names(cfg.optimizer, cfg.groups[eng.group_index[s.name]])
            total += overlap(held, s) + len(kept) * overlap(ext, s)
    for u in eng.frozen_units:
        held = eng.working_extent(u)[1]
        total += sum(overlap(held, s) for s in u.part.layout.slots)
    if cfg.optimizer != "sgd":
        total += len(eng.group_index)
    sd = eng.module.state_dict(keep_vars=True)
    return total + sum(b.numel() for k, b in eng.module.named_buffers() if k in sd)


def dcp_run(rank, n, case, stage, steps, save_to=None, load_from=None) -> dict:
    """On every rank: build at `stage` (from another seed when loading, so that nothing survives
    by accident), load_dcp, train `steps`, save_dcp (each when asked). Every rank returns what it
    owns and the load's elements_read beside expected_read; rank 0 also the state
    (dcp_cases.state_of) right after the load and at the end, the losses and the DcpInfo."""
    torch.set_num_threads(1)
    model, eng = build(case, stage, seed=1 if load_from else 0)
    info = None if load_from is None else load_dcp(eng, load_from)
    loaded = state_of(eng)
    results = train_steps(eng, case.microbatches(model), steps, start_step=eng.data_step)
    if save_to is not None:
        save_dcp(eng, save_to)
    final = state_of(eng)  # a gather: on every rank
    out = {"own": own_ranges(eng), "expected": expected_read(eng)}
    out["read"] = None if info is None else info.elements_read
    if rank == 0:
        losses = [r.loss for r in results]
        out.update(loaded=loaded, state=final, losses=losses, info=info)
    return out


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


# -- plain PyTorch ----------------------------------------------------------------------------


def plain_optimizer(case, model):
    """torch.optim over the trainable parameters in the case's two groups (matrices decayed,
    then biases and norms), each in named_parameters() order: what a plain user builds."""
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    groups = [[p for k, p in named if decay_matrices_only(k, p) == g] for g in (0, 1)]
    return torch_optimizer(case.optimizer, list(zip(groups, HYPERS[case.optimizer])), foreach=False)


def plain_load(model, opt, directory):
    """dcp.load into get_state_dict's flattened dicts, then set_state_dict: plain PyTorch in one
    process (no process group: DCP warns that it assumes one process)."""
    msd, osd = get_state_dict(model, opt, options=FLAT)
    both = {**msd, **osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(both, checkpoint_id=str(directory))
    msd, osd = {k: both[k] for k in msd}, {k: both[k] for k in osd}  # plain values are replaced
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=FLAT)


def plain_save(model, opt, directory):
    msd, osd = get_state_dict(model, opt, options=FLAT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**msd, **osd}, checkpoint_id=str(directory))


def plain_state(model, opt) -> dict:
    """What state_of() holds, from a plain model and optimizer: masters, states, steps."""
    out, names = {}, {id(p): k for k, p in model.named_parameters()}
    for k, p in model.named_parameters():
        out[f"master/{k}"] = p.detach().float().numpy().copy()
    for p, st in opt.state.items():
        for x, v in st.items():
            key = "step" if x == "step" else x
            value = float(v) if x == "step" else v.detach().numpy().copy()
            out[f"{key}/{names[id(p)]}"] = value
    return out


def differences(engine_state: dict, plain: dict, steps: dict) -> list[str]:
    """Where a plain state differs from an engine's state_of() (bits) and its step counts."""
    out = []
    for key, v in engine_state.items():
        if "/" not in key:
            continue
        if key not in plain:
            out.append(f"{key}: missing on the plain side")
        elif not same_bits(v, plain[key]):
            out.append(f"{key}: bits differ")
    for name, t in steps.items():
        got = plain.get(f"step/{name}")
        if got is not None and got != t:
            out.append(f"step/{name}: {got} != {t}")
    return out


# -- FSDP2 (fully_shard) on gloo ---------------------------------------------------------------


def fsdp_loaded(case, ckpt):
    """FSDP2 on this rank: the case's model with fully_shard on each unit and the root, its
    torch.optim, both loaded from the DCP checkpoint (plain_load); and the data step it holds."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    model = case.make_model()
    for name in model.unit_names():
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    opt = plain_optimizer(case, model)
    plain_load(model, opt, ckpt)
    step = int(max(float(s["step"]) for s in opt.state.values())) if opt.state else 0
    return model, opt, step


def fsdp_round(rank, n, case, ckpt, out) -> dict:
    """FSDP2 on every rank: fully_shard each unit and the root, AdamW; load our checkpoint
    (set_state_dict), take one step on this rank's micro-batch of the next data step, save its
    own DCP checkpoint to `out`. Rank 0 returns the full state after the load and after the
    step (get_state_dict with full_state_dict, gathered by FSDP2)."""
    model, opt, step = fsdp_loaded(case, ckpt)
    loaded = full_state(model, opt)
    x = case.microbatches(model)(step, rank)
    _, loss = model(*x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    after = full_state(model, opt)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save({**msd, **osd}, checkpoint_id=str(out))
    return {"loaded": loaded, "after": after} if rank == 0 else None


def full_state(model, opt) -> dict:
    """Rank 0's full tensors as state_of() names them (every rank must call it)."""
    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
    )
    msd, osd = get_state_dict(model, opt, options=options)
    names = dict(model.named_parameters())
    out = {f"master/{k}": v.float().numpy().copy() for k, v in msd.items() if k in names}
    for key, v in osd.items():
        if key.startswith("state."):
            rest, x = key[len("state.") :].rsplit(".", 1)
            out[f"{x}/{rest}"] = float(v) if x == "step" else v.numpy().copy()
    return out


def chunk_owner_errors(md, own_by_rank: list[dict]) -> list[str]:
    """Every chunk of a parameter's tensors in a DCP checkpoint's metadata must be a contiguous
    run of flat elements inside the own range of the rank whose file holds it."""
    errors, names = [], set().union(*own_by_rank)
    for key, m in md.state_dict_metadata.items():
        name = key[len("state.") :].rsplit(".", 1)[0] if key.startswith("state.") else key
        if not hasattr(m, "chunks") or name not in names or not m.size:
            continue  # not a parameter's tensor, or a 0-dim step count
        flat = np.arange(math.prod(m.size)).reshape(tuple(m.size))
        for c in m.chunks:
            info = md.storage_data[MetadataIndex(key, c.offsets)]
            r = int(info.relative_path.split("_")[2])
            box = flat[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].ravel()
            lo, hi = own_by_rank[r].get(name, (0, 0))
            if not (np.all(np.diff(box) == 1) and lo <= box[0] and box[-1] < hi):
                errors.append(f"{key} chunk at {tuple(c.offsets)} in {info.relative_path}")
    return errors


# -- refusals ------------------------------------------------------------------------------------


def _attempt(errors: dict, label: str, fn) -> None:
    try:
        fn()
    except (ValueError, CheckpointError) as exc:
        errors[label] = f"{type(exc).__name__}: {exc}"


def _engine(case, stage, **model_fields):
    from zero.engine import ZeroEngine
    from zero.workloads.models import MLP, MLPConfig

    cfg = dict(d_in=16, d_hidden=48, d_out=4, n_layer=3) | model_fields
    model = MLP(MLPConfig(**cfg))
    return ZeroEngine(model, case.engine_config(stage, model.unit_names()))


def refusals(rank, n, case, good, damaged: dict, fresh) -> dict:
    """Every rank tries each bad load (and a save over an existing folder); returns each
    refusal's one line and whether the engine that was refused is unchanged."""
    import dataclasses

    torch.set_num_threads(1)
    errors = {}
    _, eng = build(case, 1)
    before = state_of(eng)
    _attempt(errors, "exists", lambda: save_dcp(eng, good))
    for label, path in damaged.items():
        _attempt(errors, label, lambda p=path: load_dcp(eng, p))
    adam = dataclasses.replace(case, optimizer="adam")
    _attempt(errors, "optimizer", lambda: load_dcp(_engine(adam, 1), good))
    _attempt(errors, "shape", lambda: load_dcp(_engine(case, 2, d_hidden=40), good))
    _attempt(errors, "model lacks", lambda: load_dcp(_engine(case, 0, bias=False), good))
    unchanged = compare_states(before, state_of(eng)) == ""

    def planted(self, item):  # a write that fails on rank 1 only, halfway through the save
        if rank == 1 and item.index.fqn.startswith("state."):
            raise OSError(28, "No space left on device (planted)")
        return real(self, item)

    real = SavePlanner.resolve_data
    with patched(SavePlanner, resolve_data=planted):
        _attempt(errors, "failed save", lambda: save_dcp(eng, fresh))
    return {"errors": errors, "unchanged": unchanged}


def interrupted(rank, n, case, good, broken) -> dict:
    """Every rank loads `broken` (a data file unreadable midway: it fails during the read), then
    tries a step, an eval forward, save_dcp, engine.save and engine.load (each refused), then
    loads `good` and steps. Returns the refusals, partly_loaded before and after, and whether the
    engine after the good load has the state of a fresh engine that loaded `good`."""
    from zero.checkpoint.dcp import partly_loaded

    torch.set_num_threads(1)
    model, eng = build(case, 2, seed=1)
    errors = {}
    _attempt(errors, "read", lambda: load_dcp(eng, broken))
    marked = partly_loaded(eng)
    batch = case.microbatches(model)
    _attempt(errors, "step", lambda: train_steps(eng, batch, 1, start_step=eng.data_step))
    with torch.no_grad():
        _attempt(errors, "eval", lambda: eng(*batch(0, 0)))
    _attempt(errors, "save_dcp", lambda: save_dcp(eng, f"{broken}-again"))
    _attempt(errors, "save", lambda: eng.save(f"{broken}-native"))
    _attempt(errors, "load", lambda: eng.load(good))
    load_dcp(eng, good)
    _, fresh = build(case, 2, seed=2)
    load_dcp(fresh, good)
    same = compare_states(state_of(fresh), state_of(eng)) == ""
    losses = [r.loss for r in train_steps(eng, batch, 1, start_step=eng.data_step)]
    return {
        "errors": errors,
        "marked": marked,
        "after": partly_loaded(eng),
        "same": same,
        "losses": losses,
    }
