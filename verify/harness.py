"""One verification cell: run the engine on every rank and the reference beside it, compare.

A cell is (stage, N, precision, optimizer, mode, ...). On every rank, `run_cells` builds the
model and the engine, and runs the single-process reference on the same data: the per-micro-
batch gradients g_j are computed by a plain copy of the model on the reference's working copy,
through the engine's own input cast and backward (zero.engine.cast_inputs, backward_scaled),
so in one process they are the bits each rank's backward produces. After every step each rank
compares what it holds (its master extent, its optimizer-state extent, its working copy, the
global norm and the skip decision) with the reference:
  deterministic  bit for bit;
  fast           within the bound stated in verify/bounds.py (lock-step, see run_fast_step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from reference import ModelSpec, init_state, train_step, working_copy
from reference.optim import Hyper
from reference.precision import DTYPES
from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine, backward_scaled, cast_inputs
from zero.models import GPT, MLP, GPTConfig, MLPConfig, gpt_microbatches, mlp_microbatches
from zero.train import train_steps

from .compare import bitwise_equal, max_abs_diff, max_ulp, to_numpy
from .lockstep import check_fast_step

MODELS = {
    "mlp": (lambda: MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)), mlp_microbatches),
    "gpt": (
        lambda: GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)),
        gpt_microbatches,
    ),
}
GROUPS = {  # group 0: matrices (decayed), group 1: biases and norms
    "sgd": (
        Hyper(lr=0.05, momentum=0.9, weight_decay=0.01),
        Hyper(lr=0.1, momentum=0.5, nesterov=True),
    ),
    "adam": (Hyper(lr=1e-2, weight_decay=0.01), Hyper(lr=2e-2)),
    "adamw": (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=2e-2, betas=(0.8, 0.99))),
}


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One configuration to verify; every field ends up in the JSON record's `config`."""

    stage: int
    world_size: int
    precision: str
    optimizer: str
    mode: str  # "deterministic" or "fast"
    steps: int = 3
    model: str = "mlp"
    accumulation: int = 2  # M/N micro-steps per step
    clip_norm: float | None = 1.0
    overlap: bool = True
    reduce_dtype: str | None = None
    batch_size: int = 4
    seed: int = 0
    persist_below: int = 0  # stage 3: units this small stay whole

    @property
    def micro_batches(self) -> int:
        return self.world_size * self.accumulation

    def zero_config(self, units) -> ZeroConfig:
        return ZeroConfig(
            stage=self.stage,
            precision=self.precision,
            reduce_dtype=self.reduce_dtype,
            deterministic=self.mode == "deterministic",
            optimizer=self.optimizer,
            groups=GROUPS[self.optimizer],
            group_of=decay_matrices_only,
            micro_batches=self.micro_batches,
            clip_norm=self.clip_norm,
            units=tuple(units),
            overlap=self.overlap,
            chunk=128,
            persist_below=self.persist_below,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def microbatch_grads(model, working, batch, dtype, scale) -> dict[str, np.ndarray]:
    """g_j of one micro-batch in a single process, on the reference's working copy."""
    for name, p in model.named_parameters():
        p.data = (
            torch.from_numpy(np.ascontiguousarray(working[name]).view(np.uint16)).view(
                torch.bfloat16
            )
            if dtype == torch.bfloat16
            else torch.from_numpy(np.array(working[name]))
        )
        p.grad = None
    _, loss = model(*cast_inputs(batch, dtype))
    backward_scaled(loss, scale)
    return {name: to_numpy(p.grad).copy() for name, p in model.named_parameters()}


def flat(lay, arrays, n) -> np.ndarray:
    return lay.flatten(arrays, n, np.float32)


def compare_rank(eng: ZeroEngine, ref, rcfg) -> tuple[bool, float, int, str]:
    """This rank's extents against the reference state: (bitwise, max |diff|, max ULP, first
    mismatch)."""
    n, ok, worst_abs, worst_ulp, first = eng.world_size, True, 0.0, 0, ""
    work = working_copy(ref, rcfg)
    for u in eng.units:
        lay, ext = u.part.layout, eng.impl.master_extent(u)
        pairs = [("master", u.master, flat(lay, ref.master, n)[ext])]
        for x, t in u.opt.items():
            states = {
                s.name: ref.opt[s.name].get(x, np.zeros(s.shape, np.float32)) for s in lay.slots
            }
            pairs.append((x, t, flat(lay, states, n)[ext]))
        resident, held = eng.impl.working_extent(u)
        pairs.append(("working", resident, lay.flatten(work, n, DTYPES[rcfg.precision])[held]))
        for what, ours, theirs in pairs:
            ours = to_numpy(ours)
            if not bitwise_equal(ours, theirs):
                ok = False
                first = first or f"unit {u.index} ({u.name or 'root'}) {what}"
                worst_abs = max(worst_abs, max_abs_diff(ours, theirs))
                worst_ulp = max(worst_ulp, max_ulp(ours, theirs))
    return ok, worst_abs, worst_ulp, first


def run_cell(rank: int, world_size: int, cell: Cell) -> dict:
    """Run one cell on this rank; returns this rank's verdict."""
    assert cell.world_size == world_size, (cell.world_size, world_size)
    build, data = MODELS[cell.model]
    model, ref_model = build(), build()
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    cfg = cell.zero_config(model.unit_names())
    eng = ZeroEngine(model, cfg)
    spec = ModelSpec.build(eng.unit_specs(), eng.group_index, chunk=cfg.chunk)
    rcfg = cfg.step_config(world_size)
    ref = init_state(init, spec, rcfg)
    verdict = {
        "rank": rank,
        "bitwise": True,
        "max_abs_diff": 0.0,
        "max_ulp": 0,
        "first": "",
        "skipped_steps": 0,
        "ratios": {},
    }
    m = cell.micro_batches
    for step in range(cell.steps):
        batches = data(
            model.cfg, seed=cell.seed, data_step=step, count=m, batch_size=cell.batch_size
        )
        scale = None if ref.scaler is None else ref.scaler.scale
        work = working_copy(ref, rcfg)
        grads = [microbatch_grads(ref_model, work, b, cfg.compute_dtype, scale) for b in batches]
        before = ref
        ref, info = train_step(before, grads, spec, rcfg)
        if cell.mode == "fast":  # lock-step: start from the reference's state every step
            eng.load_full_state(
                before.master,
                before.opt,
                t=before.t,
                data_step=before.data_step,
                scaler=before.scaler,
            )
        (res,) = train_steps(eng, lambda s, j, b=batches: b[j], 1, start_step=step)
        verdict["skipped_steps"] += int(info.skipped)
        if res.skipped != info.skipped:
            verdict["bitwise"] = False
            verdict["first"] = verdict["first"] or f"step {step}: skip decisions differ"
            continue
        if cell.mode == "fast":
            if not info.skipped:
                ratios = check_fast_step(eng, spec, rcfg, before, ref, info, grads)
                for key, r in ratios.items():
                    verdict["ratios"][key] = max(verdict["ratios"].get(key, 0.0), r)
            continue
        same_norm = res.norm == (None if info.norm is None else float(info.norm))
        ok, worst_abs, worst_ulp, first = compare_rank(eng, ref, rcfg)
        if not same_norm:
            ok, first = False, first or "global norm differs"
        verdict["bitwise"] &= ok
        verdict["max_abs_diff"] = max(verdict["max_abs_diff"], worst_abs)
        verdict["max_ulp"] = max(verdict["max_ulp"], worst_ulp)
        if first and not verdict["first"]:
            verdict["first"] = f"step {step}: {first}"
    if cell.mode == "fast":
        worst = max(verdict["ratios"].values(), default=0.0)
        verdict["passed"] = verdict["first"] == "" and worst <= 1.0
        if worst > 1.0:
            verdict["first"] = f"bound exceeded: {verdict['ratios']}"
    else:
        verdict["passed"] = verdict["bitwise"]
    return verdict


def run_cells(rank: int, world_size: int, cells: list[Cell]) -> list[dict]:
    """Every cell of one world size, in one pass over the same process group."""
    torch.set_num_threads(1)
    return [run_cell(rank, world_size, c) for c in cells]
