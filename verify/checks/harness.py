"""One verification cell: run the engine on every rank and the reference beside it, compare.

A cell is one point of the matrix: (stage, N, precision, optimizer, mode, clipping, M/N, unit
size, parameter sizes, overlap, where the gradients come from). On every rank, `run_cells`
builds the model and the engine and runs the single-process reference on the same gradients:
  backward   the per-micro-batch gradients g_j are computed by a plain copy of the model on the
             reference's working copy, through the engine's own input cast and backward
             (zero.engine.cast_inputs, backward_scaled), so in one process they are the bits
             each rank's backward produces; the engine trains on the data itself;
  injected   g_j come from a GradientDraw (verify/cells/inject.py) and go into the engine through
             ZeroEngine.inject_gradients on the rank that owns micro-batch j.
The reference side comes from the model and the cell alone (verify/checks/expect.py): its units
(config.units on the model's parameters), groups (verify.checks.expect.GROUPINGS, stated there, not
the config's group_of), configuration and micro-batches; the engine's units and groups are
compared with them, never used.
After every step each rank compares, naming the step, the quantity and both values:
  reported  the step's loss (the mean of the reference side's own micro-batch losses, or of the
            injected ones, within loss_bound), the global norm, the skip decision, the loss
            scale used and after the step, the optimizer step count, each parameter's own step
            count (unused parameters: reference/step.py) and the data step;
  traffic   the step's counted collectives (calls, elements, padding per op and phase) against
            verify.checks.expect.expected_traffic (docs/design.md §2's volumes, unit by unit);
  state     its master extent, its optimizer-state extent and its working copy. Which extent a
            rank must hold is derived from the stage (`expected_extents`), not asked of the
            engine, so an engine that shifts its own shard cannot shift the check with it;
and after the last step engine.memory_report() against verify.checks.expect.expected_memory.
  deterministic  bit for bit (NaN compared as NaN-ness: torch and NumPy differ in payloads);
  fast           within the bound stated in verify/checks/lockstep.py (lock-step: every step starts
                 from the reference's state); the norm bit for bit against the pinned order
                 applied to the engine's own R (`engine_norm`), and within Δν of the reference's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings

import torch

from reference import init_state, train_step, working_copy
from zero.config import TORCH_DTYPES, ZeroConfig
from zero.engine import ZeroEngine

from .. import features
from ..cells.cell import Cell
from .expect import (
    expected_extents,
    frozen_layouts,
    reference_spec,
    reference_step_config,
    reference_zeropp,
)
from .lockstep import check_fast_step
from .report import cell_name, guarded
from .sides import (
    BackwardSource,
    CellRun,
    InjectedSource,
    cell_device,
    compare_rank,
    frozen_working,
    injected_delays,
    loss_bound,
    microbatch_grads,
    microbatch_loss_and_grads,
    own_init,
    qwz_working,
    state_digest,
)
from .verdict import (
    Verdict,
    check_memory,
    check_released,
    check_reported,
    check_state,
    check_structure,
    check_traffic,
    norm_check,
)

__all__ = [  # the names other modules import from here (their home: sides.py, verdict.py)
    "cell_device", "check_memory", "check_reported", "compare_rank", "expected_extents",
    "loss_bound", "microbatch_grads", "microbatch_loss_and_grads", "state_digest",
]  # fmt: skip


def reference_config(cell: Cell, model) -> ZeroConfig:
    """The configuration the reference side reads: the cell's, with units="auto" replaced by
    the blocks the model declares (model.unit_names()), never by the engine's detection."""
    cfg = cell.zero_config(model.unit_names())
    if cell.units == "auto":
        cfg = dataclasses.replace(cfg, units=tuple(model.unit_names()))
    return cfg


def build_cell(rank: int, cell: Cell) -> CellRun:
    """The model, both configurations, the reference's start and the engine, in that order."""
    build = cell.builder()[0]
    device = cell_device()
    model = build()
    cfg, ref_cfg = cell.zero_config(model.unit_names()), reference_config(cell, model)
    if cell.init == "own":
        own_init(model, ref_cfg.units, seed=0)
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    spec = reference_spec(model, ref_cfg)  # before the engine wraps the model
    frozen = frozen_layouts(model, ref_cfg)
    rcfg = reference_step_config(ref_cfg, cell.world_size)
    start = init_state(init, spec, rcfg)
    arranged = [arrange(rank, cfg) for arrange in features.arrangers(cell.features)]
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # its note
        warnings.filterwarnings("ignore", message="stage 3 with units=", category=UserWarning)
        if cell.meta:  # the same initial values, never materialised whole
            init_rule = "own" if cell.init == "own" else "auto"
            eng = ZeroEngine(build(device="meta"), cfg, device=device, init_seed=0, init=init_rule)
        else:
            eng = ZeroEngine(model.to(device), cfg)
    eng.keep_reduced = True  # the reduced-gradient and norm checks read R after each step
    ref_model = None if cell.injected else build().to(device)
    checks = [c for c in arranged if c is not None]
    zeropp = reference_zeropp(ref_cfg, spec)
    start_frozen = None if ref_model is None else frozen_working(ref_model, cell.precision)
    return CellRun(
        cell,
        rank,
        eng,
        ref_cfg,
        spec,
        frozen,
        rcfg,
        start,
        ref_model,
        device,
        checks,
        zeropp,
        start_frozen,
    )


def run_cell(rank: int, world_size: int, cell: Cell, partial: list | None = None) -> dict:
    """Run one cell on this rank; returns this rank's verdict (Verdict.as_dict). The checks are
    named: structure; every step the reported values, the traffic, then the state (bits) or the
    bounds (fast mode, in lock-step: every step starts from the reference's state); then the
    memory and the frozen parameters. `partial` receives the verdict as it fills, so that a
    cell that raises after some check failed still reports that check (raised_verdict)."""
    assert cell.world_size == world_size, (cell.world_size, world_size)
    v = Verdict(rank)
    if partial is not None:
        partial.append(v)
    run = build_cell(rank, cell)
    for started in run.start_checks:  # a rank's own checks: no collective
        if why := started():
            v.fail(why, "start")
    if not check_structure(run, v):
        return v.as_dict(cell.mode)
    source = (
        InjectedSource(cell, run.eng, run.spec)
        if cell.injected
        else BackwardSource(
            cell, run.eng, run.ref_model, run.rcfg, run.device, lambda w: qwz_working(run, w)
        )
    )
    # the quantized reference in deterministic mode; fast mode is checked against the exact
    # step, within a bound that adds qgZ's error (verify/checks/lockstep.py)
    zeropp = run.zeropp if cell.mode == "deterministic" else None
    ref, res, before_ran = run.start, None, None
    for step in range(cell.steps):
        grads, losses = source.grads(step, ref)
        before = ref
        ref, info = train_step(before, grads, run.spec, run.rcfg, zeropp)
        if cell.mode == "fast":
            run.eng.load_full_state(
                before.master, before.opt, t=before.t, data_step=before.data_step,
                scaler=before.scaler, steps=before.steps,
            )  # fmt: skip
        res = source.feed(step, grads, losses)
        v.skipped_steps += int(info.skipped)
        v.clipped_steps += int(info.clip_coef is not None)
        norm_ok = norm_check(run, before, info, grads)
        v.note("reported", check_reported(step, run.eng, res, ref, info, losses, norm_ok))
        before_ran = check_traffic(run, step, info, grads, before_ran, v)
        check_released(run, step, v)
        if res.skipped != info.skipped:
            continue
        if cell.mode == "deterministic":
            check_state(run, step, ref, v)
        elif not info.skipped:
            v.bounds.note(
                check_fast_step(run.eng, run.spec, run.rcfg, before, ref, info, grads, detail=True)
            )
    check_memory(run, v)
    # the bits the engine ends with, so that two versions of the code can be compared cell by
    # cell (python -m verify --baseline): a refactoring must leave every digest unchanged
    return {**v.as_dict(cell.mode), "digest": state_digest(run.eng, res)}


def each_cell(run_one, rank: int, n: int, cells) -> list[dict]:
    """run_one(rank, n, cell) for every cell of a section (parity, model parallelism) on this
    rank; a cell that raises is reported as its failure ({"name", "passed": False, "error"}:
    verify.checks.report.guarded) and the next one runs."""
    return [guarded(cell_name(c), lambda c=c: run_one(rank, n, c)) for c in cells]


def run_cells(rank: int, world_size: int, cells: list[Cell]) -> list[dict]:
    """Every cell of one world size, in one pass over the same process group.

    An exception in a cell is that cell's failure (verify.checks.report.guarded: a verdict that
    failed
    with "raised <Type>: <message>", and its `error`), not the batch's: a broken engine must
    show up as a failing row. An exception on some ranks only can leave the others waiting in a
    collective; the pool's timeout names them then.
    """
    torch.set_num_threads(1)
    out = []
    for c in cells:
        partial: list = []
        out.append(
            guarded(
                cell_name(c),
                lambda c=c, partial=partial: run_delayed(rank, world_size, c, partial),
                failed=lambda error, c=c, partial=partial: raised_verdict(rank, c, error, partial),
            )
        )
    return out


def run_delayed(rank: int, world_size: int, cell: Cell, partial: list | None = None) -> dict:
    """run_cell under the cell's injected delays; the verdict counts the delayed launches."""
    with injected_delays(cell.delays, cell.seed, rank) as delayed:
        out = run_cell(rank, world_size, cell, partial)
    return {**out, "delayed_launches": delayed[0]}


def raised_verdict(rank: int, cell: Cell, error: str, partial: list | None = None) -> dict:
    """This rank's verdict on a cell that raised `error`: the checks that failed before it
    (partial, from run_cell), then "raised"."""
    v = partial[0] if partial else Verdict(rank)
    v.fail(f"raised {error}", "raised")
    return v.as_dict(cell.mode)


def reference_trajectory(cell: Cell) -> list:
    """The reference's StepInfo of every step of a cell, in this process and without an engine
    (backward cells on a CPU copy of the model): which steps clip, skip or overflow, so that
    the matrix can choose clip_norm and tests can check what the --quick cells exercise."""
    build, data = cell.builder()
    model = build()
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    cfg = reference_config(cell, model)
    spec = reference_spec(model, cfg)
    rcfg = reference_step_config(cfg, cell.world_size)
    ref = init_state(init, spec, rcfg)
    infos = []
    if cell.injected:
        shapes = {s.name: tuple(s.shape) for lay in spec.layouts for s in lay.slots}
        names, draw = sorted(shapes), cell.gradient_draw()
    for step in range(cell.steps):
        if cell.injected:
            grads = draw.materialise(step, names, shapes, cell.micro_batches, cell.precision)
        else:
            batches = data(
                model.cfg,
                seed=cell.seed,
                data_step=step,
                count=cell.micro_batches,
                batch_size=cell.batch_size,
            )
            scale = None if ref.scaler is None else ref.scaler.scale
            work = working_copy(ref, rcfg)
            dtype = TORCH_DTYPES[cell.precision]
            grads = [microbatch_grads(model, work, b, dtype, scale) for b in batches]
        ref, info = train_step(ref, grads, spec, rcfg)
        infos.append(info)
    return infos
