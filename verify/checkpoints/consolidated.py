"""A resume row's consolidation check (verify/checkpoints/resume.py): the checkpoint as plain
PyTorch, one step
on ([Note: a resume row that consolidates] at consolidated_step), and the micro-batches every run
of a row trains on."""

from __future__ import annotations

import numpy as np
import torch

from ..cells.cell import MODELS


def microbatches(case, model):
    """microbatch(step, j) of a resume case (verify.checkpoints.resume.ResumeCase): a function of
    (seed 0,
    step, j) only, as train_steps wants."""
    _, data = MODELS[case.model]

    def microbatch(step: int, j: int):
        return data(model.cfg, seed=0, data_step=step, count=j + 1, batch_size=4)[j]

    return microbatch


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def consolidated_step(case, directory, saved: dict, after: dict) -> dict:
    """[Note: a resume row that consolidates] The checkpoint as plain PyTorch, one step on.

    1. consolidate(directory) (zero/checkpoint/consolidate.py) must hold the saving engine's
       gathered state bit for bit (masters, optimizer states, t, data step, scaler): the
       design says consolidation only reads the saved bits.
    2. The reference (reference/step.py), started from the consolidated state, takes the next
       step on its global batch (every micro-batch's gradient from the model, 1/(S·M),
       clipping); the engine that loaded the checkpoint must end that step on the same bits
       (deterministic mode equals the reference, docs/design.md §2).
    3. A plain model and torch.optim (foreach=False, as zero/optim/update.py builds it) load the
       consolidated dict and step with that step's gradient g (the reference's bits: so that
       only the optimizer's op order differs). torch.optim is not op-ordered, so it must lie
       within verify/checks/bounds.optimizer_step_error's one-step bound of the engine's step
       (inputs equal: zero input error), element by element; `torch_ratio` is the worst
       |torch - engine| / bound. A skipped step (fp16 overflow) takes no optimizer step.
    Returns {state_bitwise, next_step_bitwise, torch_ratio, skipped, first_mismatch}."""
    from zero.checkpoint import consolidate

    from .. import features

    out = {"state_bitwise": False, "next_step_bitwise": False, "torch_ratio": None,
           "skipped": False, "first_mismatch": ""}  # fmt: skip
    fmt = features.checkpoint_of(case.features)  # None: the native format
    ck = consolidate(directory) if fmt is None else fmt.consolidated(case, directory)
    names = [k for g in ck["param_names"] for k in g]
    entries = [ck["optimizer"]["state"].get(i, {}) for i in range(len(names))]
    why = _as_saved(ck, names, entries, saved)  # 1.
    if not why:
        out["state_bitwise"] = True
        step = _reference_step(case, ck, names, entries)  # 2.
        why = _next_step_differs(step, names, after)
    if not why:
        out["next_step_bitwise"] = True
        out["skipped"] = step["info"].skipped
        if not out["skipped"]:  # 3.
            out["torch_ratio"] = _torch_ratio(case, ck, names, step, after)
            if not out["torch_ratio"] <= 1.0:
                why = (f"torch.optim's step is {out['torch_ratio']:.3g} times the one-step "
                       "bound from the engine's")  # fmt: skip
    out["first_mismatch"] = f"consolidated: {why}" if why else ""
    return out


def _as_saved(ck: dict, names: list, entries: list, saved: dict) -> str:
    """1. "" when the consolidated dict is the saving engine's gathered state, bit for bit."""
    meta = ck["meta"]
    for key in ("t", "data_step", "scaler"):
        if meta[key] != saved[key]:
            return f"{key}: {meta[key]!r}, the engine saved {saved[key]!r}"
    for k, entry in zip(names, entries, strict=True):
        if not _same_bits(ck["model"][k], saved[f"master/{k}"]):
            return f"master {k}: bits differ from the engine's"
        for x in [key.split("/")[0] for key in saved if key.endswith(f"/{k}")]:
            if x == "master":
                continue
            want = saved[f"{x}/{k}"]
            have = entry[x].numpy() if x in entry else np.zeros_like(want)
            if not _same_bits(have, want):
                return f"{x} of {k}: bits differ from the engine's"
        if "step" in entry and entry["step"].item() != saved["t"]:
            return f"step of {k}: {entry['step'].item()}, t = {saved['t']}"
    return ""


def _reference_step(case, ck: dict, names: list, entries: list) -> dict:
    """2. The reference's next step from the consolidated state: {model (loaded), spec, rcfg,
    state (before), new (after), info, scale}."""
    from reference import init_state, train_step, working_copy
    from reference.precision import ScalerState, cast
    from reference.step import TrainState
    from zero.config import TORCH_DTYPES

    from ..checks.expect import (
        frozen_layouts,
        reference_spec,
        reference_step_config,
        reference_zeropp,
    )
    from ..checks.sides import microbatch_grads, quantized_compute

    meta = ck["meta"]
    model = case.make_model()
    model.load_state_dict(ck["model"])  # strict: every key
    cfg = case.engine_config(case.s2, model.unit_names())
    spec, rcfg = reference_spec(model, cfg), reference_step_config(cfg, case.n2)
    state = init_state({k: ck["model"][k].numpy() for k in names}, spec, rcfg)
    for k, entry in zip(names, entries, strict=True):
        state.opt[k].update({x: v.numpy().copy() for x, v in entry.items() if x != "step"})
    scaler = None if meta["scaler"] is None else ScalerState(**meta["scaler"])
    state = TrainState(master=state.master, opt=state.opt, t=meta["t"],
                       data_step=meta["data_step"], scaler=scaler)  # fmt: skip
    ref_model, scale = case.make_model(), None if scaler is None else scaler.scale
    data, work = microbatches(case, ref_model), working_copy(state, rcfg)
    frozen = {k for k, p in ref_model.named_parameters() if not p.requires_grad}
    work |= {k: cast(ck["model"][k].numpy(), case.precision) for k in frozen}  # exact: upcast
    zeropp = reference_zeropp(cfg, spec)  # ZeRO++'s quantized reference, where asked
    work = quantized_compute(
        work, zeropp, spec, frozen_layouts(model, cfg), cfg, case.n2, case.precision
    )
    dtype = TORCH_DTYPES[case.precision]
    # one thread, as every rank runs (docs/design.md §2): this runs in the launching process,
    # where BatchNorm's CPU reductions would otherwise split the batch over more threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grads = [
            microbatch_grads(ref_model, work, data(state.data_step, j), dtype, scale)
            for j in range(case.micro_batches)
        ]
    finally:
        torch.set_num_threads(threads)
    new, info = train_step(state, grads, spec, rcfg, zeropp)
    return dict(model=model, spec=spec, rcfg=rcfg, state=state, new=new, info=info, scale=scale)


def _next_step_differs(step: dict, names: list, after: dict) -> str:
    """2. "" when the engine that loaded the checkpoint ended the step on the reference's bits."""
    new = step["new"]
    if new.t != after["t"]:
        return f"next step: t {after['t']}, the reference {new.t}"
    for k in names:
        for x, v in [("master", new.master[k])] + list(new.opt[k].items()):
            if not _same_bits(v, after[f"{x}/{k}"]):
                return f"next step: {x} of {k}: engine and reference differ"
    return ""


def _torch_ratio(case, ck: dict, names: list, step: dict, after: dict) -> float:
    """3. torch.optim from the consolidated dict with the step's g: the worst |torch - engine|
    over the one-step bound, element by element."""
    from reference.precision import cast, f32
    from zero.optim.plain import torch_optimizer

    from ..checks.bounds import optimizer_step_error

    info, state, spec, rcfg = step["info"], step["state"], step["spec"], step["rcfg"]
    c = f32(1.0 / ((step["scale"] or 1.0) * case.micro_batches))
    g = {k: cast(info.reduced[k], "fp32") * c for k in names}
    if info.clip_coef is not None:
        g = {k: x * info.clip_coef for k, x in g.items()}
    named = dict(step["model"].named_parameters())
    groups = ck["param_names"]
    opt = torch_optimizer(
        case.optimizer, [([named[k] for k in grp], rcfg.groups[i]) for i, grp in enumerate(groups)],
        foreach=False,
    )  # fmt: skip
    opt.load_state_dict(ck["optimizer"])
    for k in names:
        named[k].grad = torch.from_numpy(np.ascontiguousarray(g[k]))
    opt.step()
    worst = 0.0
    for k in names:
        hp = rcfg.groups[spec.group_of[k]]
        err, _, _ = optimizer_step_error(case.optimizer, hp, state.t + 1, state.master[k], g[k],
                                         state.opt[k], {})  # fmt: skip
        diff = np.abs(named[k].detach().numpy().astype(np.float64) - after[f"master/{k}"])
        worst = max(worst, float(np.max(diff / np.maximum(err["p"], 1e-300), initial=0.0)))
    return worst
