"""Consolidation: one plain PyTorch state dict from a checkpoint, no engine, no process group.

Legend: the manifest's params list (module order) names each parameter's unit and offset; a
value is read slot by slot from the shard files, so the world size it was saved at does not
matter ([Note: resharding by layout] in zero/checkpoint/reshard.py). The optimizer part is in
torch.optim's own state_dict format (zero/optim/update.py maps our hyper-parameters to its kwargs).
A model-parallel checkpoint consolidates to the plain model: each parameter's slices joined
([Note: joining slices] in zero/checkpoint/mpjoin.py), so the dict is that of one plain
checkpoint, gather_state() + zero.mp.join_states bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..optim.plain import TORCH_OPTIMIZERS, torch_kwargs
from .format import (
    CheckpointError,
    _fsync_dir,
    _write_durably,
    check_files,
    read_manifest,
    resolve,
    saved_steps,
)
from .mpformat import views, whole_params
from .mpjoin import Source
from .validate import Invalid, check_gaps

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

    Parameter i of the optimizer state is the i-th name of param_names flattened: group by group,
    each in the model's named_parameters() order. So for one group,
    `torch.optim.AdamW(model.parameters())` matches; for several, build each group's list in module
    order. Every value is the fp32 master bit for bit; Adam's "step" is the parameter's own step
    count as a float32 tensor (torch's own convention; it falls behind t for a parameter some steps
    left without a gradient, reference/step.py), SGD keeps "momentum_buffer" only when momentum !=
    0. A parameter never stepped has no state, as in torch.optim. Frozen parameters
    (requires_grad=False) are in "model" as the engine held them, in the compute dtype, upcast to
    fp32 (exact; with bf16 training that is the start value rounded to bf16), and nowhere in
    "optimizer" or "param_names": torch.optim over the trainable parameters (`[p for p in
    model.parameters() if p.requires_grad]`) is what matches.
    """
    step_dir = resolve(directory)
    m = read_manifest(step_dir)
    source = Source(step_dir, m, None)  # as the plain model's: slices joined
    try:  # no model to check the shapes against: the saved values must fit them
        for reader, view in zip(source.readers, source.views):
            for u in range(len(view["units"])):
                check_gaps(reader, u)
    except Invalid as exc:
        raise CheckpointError(str(exc)) from None
    kind, steps = m["config"]["optimizer"], saved_steps(m)
    hypers, params = m["config"]["groups"], whole_params(m)

    def value(p: dict, key: str) -> torch.Tensor:
        # frozen: held in the compute dtype, the fp32 upcast is exact
        got = source.whole(p["name"], "frozen" if p.get("frozen") else key)
        if got is None:  # a state the optimizer did not keep
            return torch.zeros(p["shape"])
        return got

    masters = {p["name"]: value(p, "master") for p in params}
    model = {}
    reader, buffers = source.buffers()
    for key, src in views(m)[0]["state_dict_keys"]:
        if src.startswith("buffer:"):
            model[key] = reader.tensor(buffers, src).clone()
        else:
            model[key] = masters[src]
    trained = [p for p in params if not p.get("frozen")]
    names = [[p["name"] for p in trained if p["group"] == g] for g in range(len(hypers))]
    by_name = {p["name"]: p for p in params}
    state, indices, i = {}, [], 0
    for g, group_names in enumerate(names):
        indices.append(list(range(i, i + len(group_names))))
        for name in group_names:
            p, entry, t_p = by_name[name], {}, steps[name]
            if t_p >= 1 and kind == "sgd" and hypers[g]["momentum"]:
                entry["momentum_buffer"] = value(p, "momentum_buffer")
            elif t_p >= 1 and kind != "sgd":
                entry["step"] = torch.tensor(float(t_p), dtype=torch.float32)
                entry["exp_avg"] = value(p, "exp_avg")
                entry["exp_avg_sq"] = value(p, "exp_avg_sq")
            if entry:
                state[i] = entry
            i += 1
    # every file the parameters did not need (the RNG and buffer files r*.bin, say) is checked
    # too: a damaged file is refused, never passed over because this reader does not use it
    check_files(step_dir, m, skip=set().union(*(r.cache for r in source.readers)))
    meta = {
        k: m[k]
        for k in ("format_version", "name", "t", "data_step", "scaler", "world_size", "stage")
    }
    meta.update(optimizer=kind, precision=m["config"]["precision"], extra=m["extra"])
    meta["mp"] = m.get("mp", {}).get("size", 1)  # N_m it was saved at (world_size is N_d)
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": _torch_param_groups(kind, hypers, indices)},
        "param_names": names,
        "meta": meta,
    }


def check_out(out) -> Path:
    """Refuse, before any work, an output path consolidate_to cannot write: ValueError naming
    `out`, one line. Allowed is a new or existing file (replaced atomically) in an existing,
    writable folder; its temp file goes beside it, in that folder."""
    import tempfile

    given, out = str(out), Path(out)
    allowed = "allowed is a file path in an existing, writable folder"
    if out.is_dir():
        raise ValueError(f"out={given!r}: is a directory; {allowed}")
    if given.endswith(os.sep) or out.name in ("", ".", ".."):
        raise ValueError(f"out={given!r}: names no file; {allowed}")
    folder = out.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"out={str(out)!r}: its folder {str(folder)!r} {what}; {allowed}")
    try:  # as the temp file will be made: in that folder (root may write where others may not)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ValueError(
            f"out={str(out)!r}: cannot write in {str(folder)!r} ({why}); {allowed}"
        ) from None
    return out


def consolidate_to(directory, out) -> Path:
    """consolidate(directory), written to `out` with torch.save (temp file beside `out`, fsync,
    rename); `out` is checked first (check_out)."""
    import io

    out = check_out(out)
    buf = io.BytesIO()
    torch.save(consolidate(directory), buf)
    _write_durably(out, [buf.getbuffer()])
    _fsync_dir(out.parent if str(out.parent) else Path("."))
    return out
