"""One verification cell: run the engine on every rank and the reference beside it, compare.

A cell is one point of the matrix: (stage, N, precision, optimizer, mode, clipping, M/N, unit
size, parameter sizes, overlap, where the gradients come from). On every rank, `run_cells`
builds the model and the engine and runs the single-process reference on the same gradients:
  backward   the per-micro-batch gradients g_j are computed by a plain copy of the model on the
             reference's working copy, through the engine's own input cast and backward
             (zero.engine.cast_inputs, backward_scaled), so in one process they are the bits
             each rank's backward produces; the engine trains on the data itself;
  injected   g_j come from a GradientDraw (verify/inject.py) and go into the engine through
             ZeroEngine.inject_gradients on the rank that owns micro-batch j.
The reference side comes from the model and the cell alone (verify/expect.py): its units
(config.units on the model's parameters), groups (verify.expect.GROUPINGS, stated there, not
the config's group_of), configuration and micro-batches; the engine's units and groups are
compared with them, never used.
After every step each rank compares, naming the step, the quantity and both values:
  reported  the step's loss (the mean of the reference side's own micro-batch losses, or of the
            injected ones, within loss_bound), the global norm, the skip decision, the loss
            scale used and after the step, the optimizer step count, each parameter's own step
            count (unused parameters: reference/step.py) and the data step;
  traffic   the step's counted collectives (calls, elements, padding per op and phase) against
            verify.expect.expected_traffic (docs/design.md §2's volumes, unit by unit);
  state     its master extent, its optimizer-state extent and its working copy. Which extent a
            rank must hold is derived from the stage (`expected_extents`), not asked of the
            engine, so an engine that shifts its own shard cannot shift the check with it;
and after the last step engine.memory_report() against verify.expect.expected_memory.
  deterministic  bit for bit (NaN compared as NaN-ness: torch and NumPy differ in payloads);
  fast           within the bound stated in verify/lockstep.py (lock-step: every step starts
                 from the reference's state); the norm bit for bit against the pinned order
                 applied to the engine's own R (`engine_norm`), and within Δν of the reference's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import random
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reference import init_state, train_step, working_copy
from reference.precision import DTYPES, cast, f32
from reference.tree import chunk_sumsq, global_norm
from zero import collectives
from zero.common import owner
from zero.config import TORCH_DTYPES, ZeroConfig
from zero.engine import ZeroEngine, backward_scaled, cast_inputs
from zero.hooks import forward_rng
from zero.loop import train_steps
from zero.ranks import launch

from .cell import DELAY_S, MODELS, Cell
from .compare import bitwise_equal, max_abs_diff, max_ulp, to_numpy
from .expect import (
    expected_disk_traffic,
    expected_extents,
    expected_memory,
    expected_released,
    expected_traffic,
    first_difference,
    frozen_layouts,
    group_mismatch,
    ran_units,
    reference_spec,
    reference_step_config,
    traffic_of_step,
)
from .inject import to_torch
from .lockstep import check_fast_step, gradient_errors
from .report import cell_name, guarded

__all__ = ["expected_extents"]  # re-exported: it lived here before verify/expect.py


def cell_device() -> torch.device:
    """Where a cell runs: this rank's device (zero.ranks.launch.rank_device): a GPU in a torchrun
    world on GPUs (NCCL, or gloo with --device cuda) and in a local pool started with
    device="cuda" (gloo ranks sharing the GPU), else the CPU. Backward cells then compute the
    reference's micro-batch gradients on the same device, with the same kernels as the
    engine's backward (a CPU matmul gives other bits than a GPU's)."""
    return launch.rank_device()


def own_init(model, units, seed: int) -> None:
    """The values ZeroEngine(init="own") gives a model built on the meta device, recomputed in
    place on a CPU-built copy without the engine (docs/models.md, Meta-device models): for each
    unit (the root "" holding what no named unit holds), the modules of the unit, children
    before parents as module.apply visits them, run reset_parameters() under torch's RNG seeded
    from zero.materialize.unit_seed(seed, unit)."""
    from zero.materialize import unit_seed

    def post_order(prefix, m):
        for name, child in m.named_children():
            yield from post_order(f"{prefix}.{name}" if prefix else name, child)
        yield prefix, m

    def of(name: str) -> str:
        return next((u for u in units if name == u or name.startswith(u + ".")), "")

    order = list(post_order("", model))
    with torch.no_grad():
        for unit in ("", *units):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(unit_seed(seed, unit))
                for name, m in order:
                    if of(name) == unit and callable(getattr(m, "reset_parameters", None)):
                        m.reset_parameters()


def frozen_working(model, precision: str) -> dict[str, np.ndarray]:
    """The frozen parameters' values as forward reads them: each start value cast once to the
    compute dtype (nearest even), never updated (docs/design.md §2)."""
    return {
        k: cast(p.detach().float().cpu().numpy(), precision)
        for k, p in model.named_parameters()
        if not p.requires_grad
    }


def frozen_unchanged(eng: ZeroEngine, model, want: dict[str, np.ndarray]) -> str:
    """'' when every frozen parameter still holds its cast start value, bit for bit (read inside
    gathered_params: a collective at stage 3, so every rank calls it), else the first that
    does not."""
    if not want:
        return ""
    with eng.gathered_params():
        have = {k: to_numpy(p.detach().clone()) for k, p in model.named_parameters() if k in want}
    for k, v in want.items():
        if not bitwise_equal(have[k], v):
            return f"frozen parameter {k}: changed from its start value in the compute dtype"
    return ""


def microbatch_grads(model, working, batch, dtype, scale) -> dict[str, np.ndarray]:
    """g_j of one micro-batch in a single process, on the reference's working copy (on the
    model's device; the batch must be there too)."""
    return microbatch_loss_and_grads(model, working, batch, dtype, scale)[1]


def microbatch_loss_and_grads(model, working, batch, dtype, scale, rng=None):
    """(loss, g_j) of one micro-batch: microbatch_grads, and the loss its forward computed
    (as a float, which is what the engine reports per micro-batch). batch: positional inputs,
    or a dict of keyword inputs; rng: the context the forward runs in (zero.hooks.forward_rng
    of the micro-batch, as the engine's forward seeds it; None: torch's RNG as it is)."""
    for name, p in model.named_parameters():
        p.data = (
            torch.from_numpy(np.ascontiguousarray(working[name]).view(np.uint16)).view(
                torch.bfloat16
            )
            if dtype == torch.bfloat16
            else torch.from_numpy(np.array(working[name]))
        ).to(p.device)
        p.grad = None
    args, kwargs = cast_inputs(*(((), batch) if isinstance(batch, dict) else (batch, {})), dtype)
    with rng if rng is not None else contextlib.nullcontext():
        _, loss = model(*args, **kwargs)
    value = float(loss.detach().float())
    backward_scaled(loss, scale)
    # a parameter backward left without a gradient is absent ([Note: unused parameters])
    grads = {n: to_numpy(p.grad).copy() for n, p in model.named_parameters() if p.grad is not None}
    return value, grads


def loss_bound(losses) -> float:
    """How far a reported mean of the micro-batch losses may be from the exact mean: the
    engine sums them in float64 in some order (per rank, then over ranks) and divides once,
    so |error| <= γ_M(2^-53)·Σ|l_j|/M + 2^-53·|mean| (Higham eq. 4.4; a correctly rounded
    division). Not pinned by the design (docs/design.md §2 pins R and the norm, not the loss)."""
    m = len(losses)
    u = 2.0**-53
    total = sum(abs(x) for x in losses)
    return (m * u / (1 - m * u)) * total / m + u * abs(math.fsum(losses) / m)


def engine_norm(eng: ZeroEngine, spec, rank: int, n: int, scale: float) -> float:
    """The global norm of the engine's own reduced gradient (ZeroEngine.last_reduced), in the
    order docs/design.md §2 pins in both modes: this rank's shard of fp32(R)·s(1/(S·M)) in
    chunk partials, gathered (outside the engine's counter), then reference.tree.global_norm.
    In fast mode R itself is only bounded, but the norm of that R has exactly these bits."""
    import torch.distributed as dist

    c = f32(1.0 / (scale * eng.config.micro_batches))
    try:  # every rank must reach the gather below, whatever its engine did
        mine = []
        for lay, held in zip(spec.layouts, eng.last_reduced, strict=True):
            x = to_numpy(held).astype(np.float32)
            L = lay.shard_numel(n)
            if x.size == lay.padded_numel(n):
                x = x[rank * L : (rank + 1) * L]
            mine.append(chunk_sumsq(x * c, lay.chunk))
    except Exception:  # no R of this step on this rank (e.g. it skipped the step)
        mine = None
    every: list = [None] * n
    dist.all_gather_object(every, mine)
    if any(e is None for e in every):
        return float("nan")
    per_unit = [
        np.concatenate([every[r][i] for r in range(n)])[: lay.num_chunks]
        for i, lay in enumerate(spec.layouts)
    ]
    return float(global_norm(per_unit))


def flat(lay, arrays, n) -> np.ndarray:
    return lay.flatten(arrays, n, np.float32)


def compare_rank(eng: ZeroEngine, ref, rcfg, spec=None) -> tuple[bool, float, int, str]:
    """This rank's extents against the reference state: (bitwise, max |diff|, max ULP, first
    mismatch). NaN equals NaN whatever its payload; every other value must match in bits.
    spec: the reference's ModelSpec (verify.expect.reference_spec); its layouts cut the
    reference's flat buffers (without it, the engine's own layouts: older callers)."""
    n, rank, ok, worst_abs, worst_ulp, first = eng.world_size, eng.rank, True, 0.0, 0, ""
    stage, persist = eng.config.stage, eng.config.persist_below
    work = working_copy(ref, rcfg)
    for u in eng.units:
        lay = u.part.layout if spec is None else spec.layouts[u.index]
        ext, held = expected_extents(stage, persist, lay, rank, n)
        where = f"unit {u.index} ({u.name or 'root'})"
        claimed = (eng.master_extent(u), eng.working_extent(u)[1])
        if claimed != (ext, held):
            ok, first = (
                False,
                first or f"{where} extents {claimed}, stage {stage} needs {ext, held}",
            )
        pairs = [("master", u.master, flat(lay, ref.master, n)[ext])]
        for x, t in u.opt.items():
            states = {
                s.name: ref.opt[s.name].get(x, np.zeros(s.shape, np.float32)) for s in lay.slots
            }
            pairs.append((x, t, flat(lay, states, n)[ext]))
        resident = eng.working_extent(u)[0]
        pairs.append(("working", resident, lay.flatten(work, n, DTYPES[rcfg.precision])[held]))
        for what, ours, theirs in pairs:
            ours = to_numpy(ours)
            if not bitwise_equal(ours, theirs, nan_equal=True):
                ok = False
                first = first or f"{where} {what}"
                if ours.shape == theirs.shape and ours.dtype == theirs.dtype:
                    worst_abs = max(worst_abs, max_abs_diff(ours, theirs))
                    worst_ulp = max(worst_ulp, max_ulp(ours, theirs))
                else:
                    first = first + f" (shape {ours.shape} {ours.dtype}, need {theirs.shape})"
    return ok, worst_abs, worst_ulp, first


@contextlib.contextmanager
def injected_delays(enabled: bool, seed: int, rank: int):
    """Every collective launch sleeps a seeded 0..DELAY_S s first, differently on every rank.
    Yields a one-element list counting the delayed launches (so a report shows they ran)."""
    count = [0]
    if not enabled:
        yield count
        return
    original = collectives.launch
    rng = random.Random(f"delays:{seed}:{rank}")

    def late(*a, **kw):
        count[0] += 1
        time.sleep(rng.uniform(0, DELAY_S))
        return original(*a, **kw)

    collectives.launch = late
    try:
        yield count
    finally:
        collectives.launch = original


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    width = {4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.view(width).numpy().tobytes()


def state_digest(eng, result) -> str:
    """blake2b of every full state's bits in name order, the step counter, the loss scale, the
    norm and the skip decision (not the loss: its cross-rank mean is a float64 sum whose order
    depends on N, and it is not model state)."""
    h = hashlib.blake2b(digest_size=16)
    master, opt = eng.gather_state()
    with eng.gathered_params():
        working = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    for name in sorted(master):
        h.update(name.encode())
        h.update(_bits(master[name]))
        for key in sorted(opt[name]):
            h.update(key.encode())
            h.update(_bits(opt[name][key]))
        h.update(_bits(working[name]))
    scale = None if eng.scaler is None else eng.scaler.scale
    h.update(repr((eng.t, scale, result.norm, result.skipped)).encode())
    return h.hexdigest()


def injected_loss(seed: int, step: int, j: int) -> float:
    """The loss an injected cell reports for micro-batch j of a step: a dyadic rational, so
    that every sum of them is exact."""
    return 0.5 + ((seed + 7 * step + 3 * j) % 64) / 32


class _Injected:
    """The gradient source of an injected cell: every rank materialises all M micro-batches,
    with the reference's parameter names and shapes."""

    def __init__(self, cell: Cell, eng: ZeroEngine, spec):
        self.cell, self.eng, self.draw = cell, eng, cell.gradient_draw()
        self.shapes = {s.name: tuple(s.shape) for lay in spec.layouts for s in lay.slots}
        self.names = sorted(self.shapes)

    def grads(self, step: int, ref) -> tuple[list[dict[str, np.ndarray]], list[float]]:
        del ref
        m = self.cell.micro_batches
        grads = self.draw.materialise(step, self.names, self.shapes, m, self.cell.precision)
        return grads, [injected_loss(self.cell.seed, step, j) for j in range(m)]

    def feed(self, step: int, grads, losses):
        """This rank's micro-batches of the step, then the step; returns its StepResult."""
        n, rank = self.eng.world_size, self.eng.rank
        for k in range(self.cell.accumulation):  # micro-batch j = kN + r (docs/design.md §2)
            g = grads[k * n + rank]
            self.eng.inject_gradients(
                {name: to_torch(g[name]) for name in self.names}, loss=losses[k * n + rank]
            )
        return self.eng.step()


class _Backward:
    """The gradient source of a model cell: the model's own backward on the step's data, and
    the reference's micro-batches drawn from the reference's copy of the model."""

    def __init__(self, cell: Cell, eng: ZeroEngine, ref_model, rcfg, device):
        self.cell, self.eng, self.ref_model, self.rcfg = cell, eng, ref_model, rcfg
        self.data, self.device = MODELS[cell.model][1], device
        self.frozen = frozen_working(ref_model, cell.precision)

    def grads(self, step: int, ref):
        batches = self.data(
            self.ref_model.cfg,
            seed=self.cell.seed,
            data_step=step,
            count=self.cell.micro_batches,
            batch_size=self.cell.batch_size,
        )
        self.batches = [tuple(x.to(self.device) for x in b) for b in batches]
        scale = None if ref.scaler is None else ref.scaler.scale
        work = {**self.frozen, **working_copy(ref, self.rcfg)}
        dtype = TORCH_DTYPES[self.cell.precision]
        seed = self.cell.zero_config(()).dropout_seed  # the engine's config, from the cell
        pairs = [
            microbatch_loss_and_grads(
                self.ref_model, work, b, dtype, scale, forward_rng(seed, step, j, self.device)
            )
            for j, b in enumerate(self.batches)
        ]
        return [g for _, g in pairs], [x for x, _ in pairs]

    def feed(self, step: int, grads, losses):
        """One step of the training loop on the step's data; returns its StepResult."""
        del grads, losses
        (res,) = train_steps(self.eng, lambda s, j, b=self.batches: b[j], 1, start_step=step)
        return res


@dataclass
class StateCheck:
    """Deterministic mode: the engine's master, optimizer states and working copy against the
    reference's, bit for bit (compare_rank), over every step."""

    bitwise: bool = True
    max_abs_diff: float = 0.0
    max_ulp: int = 0


@dataclass
class BoundsCheck:
    """Fast mode: the worst error / derived bound per quantity over every step, with that
    element's error and bound (verify/lockstep.py)."""

    ratios: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def note(self, detail: dict) -> None:
        for key, (r, err, bound) in detail.items():
            if r >= self.ratios.get(key, -1.0):
                self.ratios[key], self.errors[key] = r, (err, bound)


@dataclass
class Verdict:
    """One rank's verdict on one cell, filled by the named checks; `first` is the first
    failure of any of them, and `as_dict` is the record verify/report.py merges over ranks."""

    rank: int
    first: str = ""
    failed: bool = False
    skipped_steps: int = 0
    clipped_steps: int = 0  # steps whose clip coefficient was < 1 (clipping did something)
    state: StateCheck = field(default_factory=StateCheck)
    bounds: BoundsCheck = field(default_factory=BoundsCheck)
    # what the engine reported, sent and holds: each the first mismatch, "" when as expected
    reported: str = ""
    traffic: str = ""
    memory: str = ""
    memory_bytes: dict = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failed = True
        self.first = self.first or why

    def note(self, check: str, why: str) -> None:
        """The first mismatch of `check` ("reported", "traffic" or "memory"), if any."""
        if why:
            setattr(self, check, getattr(self, check) or why)
            self.fail(why)

    def as_dict(self, mode: str) -> dict:
        first = self.first
        worst = max(self.bounds.ratios.values(), default=0.0)
        if mode == "fast" and worst > 1.0:
            first = first or f"bound exceeded: {self.bounds.ratios}"
        bitwise = self.state.bitwise and not self.failed
        passed = (self.first == "" and worst <= 1.0) if mode == "fast" else bitwise
        return {
            "rank": self.rank,
            "bitwise": bitwise,
            "max_abs_diff": self.state.max_abs_diff,
            "max_ulp": self.state.max_ulp,
            "first": first,
            "skipped_steps": self.skipped_steps,
            "clipped_steps": self.clipped_steps,
            "ratios": self.bounds.ratios,
            "errors": self.bounds.errors,
            "reported": self.reported,
            "traffic": self.traffic,
            "memory": self.memory,
            "memory_bytes": self.memory_bytes,
            "passed": passed,
        }


def _scaler_tuple(scaler):
    return None if scaler is None else (float(scaler.scale), int(scaler.clean_steps))


def check_reported(step: int, eng, res, ref, info, losses, norm_ok) -> str:
    """The step's reported quantities against the reference's: '' or the first mismatch with
    both values. norm_ok(engine norm, reference norm) -> '' or why they differ (mode
    dependent)."""
    want_loss = math.fsum(losses) / len(losses)
    bound = loss_bound(losses)
    if not abs(res.loss - want_loss) <= bound:
        return (
            f"step {step}: loss: engine {res.loss!r}, reference {want_loss!r} (bound {bound:.3g})"
        )
    pairs = [
        ("skip decision", res.skipped, info.skipped),
        ("loss scale used", res.scale, info.scale),
        ("loss scale after the step", _scaler_tuple(eng.scaler), _scaler_tuple(ref.scaler)),
        ("optimizer step count", eng.t, ref.t),
        ("data step", eng.data_step, ref.data_step),
    ]
    for what, ours, theirs in pairs:
        if ours != theirs:
            return f"step {step}: {what}: engine {ours!r}, reference {theirs!r}"
    steps = eng.param_steps()  # [Note: unused parameters]: t_p of every parameter
    for name in sorted(set(steps) | set(ref.master)):
        ours, theirs = steps.get(name), ref.step_of(name) if name in ref.master else None
        if ours != theirs:
            return f"step {step}: step count of {name!r}: engine {ours!r}, reference {theirs!r}"
    if (res.norm is None) != (info.norm is None):
        return f"step {step}: global norm: engine {res.norm!r}, reference {info.norm!r}"
    if info.norm is not None:
        why = norm_ok(res.norm, float(info.norm))
        if why:
            return f"step {step}: global norm: {why}"
    return ""


def reference_config(cell: Cell, model) -> ZeroConfig:
    """The configuration the reference side reads: the cell's, with units="auto" replaced by
    the blocks the model declares (model.unit_names()), never by the engine's detection."""
    cfg = cell.zero_config(model.unit_names())
    if cell.units == "auto":
        cfg = dataclasses.replace(cfg, units=tuple(model.unit_names()))
    return cfg


@dataclass
class CellRun:
    """What one cell builds on one rank: the engine, and the reference side beside it, which
    comes from the model and the cell alone (verify/expect.py)."""

    cell: Cell
    rank: int
    eng: ZeroEngine
    ref_cfg: ZeroConfig  # the configuration the reference side reads (reference_config)
    spec: object  # reference_spec: its units, layouts and parameter groups
    frozen: object  # frozen_layouts
    rcfg: object  # reference_step_config
    start: object  # the reference's initial TrainState
    ref_model: object  # the reference side's copy of the model (None for injected cells)
    device: torch.device
    stale: Path | None = None  # DISK cells, rank 0: a dead owner's folder the start must remove


def build_cell(rank: int, cell: Cell) -> CellRun:
    """The model, both configurations, the reference's start and the engine, in that order."""
    build = MODELS[cell.model][0]
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
    stale = _dead_owners_folder(cfg.offload_dir) if cell.disk and rank == 0 else None
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # its note
        warnings.filterwarnings("ignore", message="stage 3 with units=", category=UserWarning)
        if cell.meta:  # the same initial values, never materialised whole
            init_rule = "own" if cell.init == "own" else "auto"
            eng = ZeroEngine(build(device="meta"), cfg, device=device, init_seed=0, init=init_rule)
        else:
            eng = ZeroEngine(model.to(device), cfg)
    eng.keep_reduced = True  # the reduced-gradient and norm checks read R after each step
    ref_model = None if cell.injected else build().to(device)
    return CellRun(cell, rank, eng, ref_cfg, spec, frozen, rcfg, start, ref_model, device, stale)


def _dead_owners_folder(offload_dir: str) -> Path:
    """A disk-tier folder as a process killed outright leaves it (its owner's record, a state
    file), whose owner has exited: each DISK cell's engine must remove it at start, naming it."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid runs no more
    folder = Path(tempfile.mkdtemp(prefix=f"zero-states-{dead.pid}-", dir=offload_dir))
    record = {**owner.identity(), "pid": dead.pid, "proc_start": None}
    (folder / "owner.json").write_text(json.dumps(record))
    (folder / "u0000-master.f32").write_bytes(bytes(64))
    return folder


def check_structure(run: CellRun, v: Verdict) -> bool:
    """The engine's units and parameter groups are the reference's; False when the units are
    not (nothing else can be compared then)."""
    eng, spec = run.eng, run.spec
    ours = [[(name, tuple(shape)) for name, shape in u] for u in eng.unit_specs()]
    theirs = [[(s.name, tuple(s.shape)) for s in lay.slots] for lay in spec.layouts]
    if ours != theirs:
        v.fail(f"units: engine {ours}, reference {theirs}")
        return False
    # spec.group_of is verify.expect's GROUPINGS, stated apart from the config's group_of
    why = group_mismatch(dict(eng.group_index), dict(spec.group_of))
    if why:
        v.fail(why)
    return True


def norm_check(run: CellRun, before, info, grads):
    """norm_ok(engine norm, reference norm) -> "" or why they differ: bits in deterministic
    mode; in fast mode bits against the pinned order applied to the engine's own R (computed
    here, on every rank together) and within Δν of the reference's."""
    if run.cell.mode != "fast":
        return lambda ours, theirs: (
            "" if ours == theirs else f"engine {ours!r}, reference {theirs!r}"
        )
    if info.skipped:
        return lambda ours, theirs: ""  # a skipped step reports no norm on either side
    n = run.eng.world_size
    pinned = engine_norm(run.eng, run.spec, run.rank, n, info.scale)
    d = gradient_errors(run.spec, run.rcfg, before, info, grads)[-1]

    def norm_ok(ours, theirs):
        if ours != pinned:  # bits: the order is pinned in both modes
            return f"engine {ours!r}, the pinned order on its own R gives {pinned!r}"
        if not abs(ours - theirs) <= d:
            return f"engine {ours!r}, reference {theirs!r} (bound {d:.3g})"
        return ""

    return norm_ok


def check_traffic(run: CellRun, step: int, info, grads, before_ran, v: Verdict):
    """The step's counted collectives against expected_traffic; returns which units ran last
    where (the next step's `before_ran`), derived from the data alone."""
    n, counter = run.eng.world_size, run.eng.counter
    traffic = traffic_of_step(counter, counter.step - 1)
    ran = ran_units(run.spec, grads, n, run.rank)
    want = expected_traffic(
        run.ref_cfg,
        run.spec,
        n,
        run.rank,
        forward=not run.cell.injected,
        skipped=info.skipped,
        frozen=run.frozen,
        ran=ran,
        before=before_ran,
    )
    v.note("traffic", first_difference(f"step {step}: traffic", traffic, want))
    disk = {f"{r.op}:u{r.unit}": r.elements for r in counter.of_step(counter.step - 1, "disk")}
    want = expected_disk_traffic(run.ref_cfg, run.spec, n, skipped=info.skipped)
    v.note("traffic", first_difference(f"step {step}: disk", disk, want))
    return [r[-1] for r in ran]


def check_state(run: CellRun, step: int, ref, v: Verdict) -> None:
    """Deterministic mode: this rank's extents, bit for bit."""
    ok, worst_abs, worst_ulp, first = compare_rank(run.eng, ref, run.rcfg, run.spec)
    v.state.bitwise &= ok
    v.state.max_abs_diff = max(v.state.max_abs_diff, worst_abs)
    v.state.max_ulp = max(v.state.max_ulp, worst_ulp)
    if first and not v.first:
        v.first = f"step {step}: {first}"


def check_memory(run: CellRun, v: Verdict) -> None:
    """After the last step: resident bytes against expected_memory, and frozen parameters
    still the cast start values."""
    memory = {k: b for k, b in run.eng.memory_report().items() if k != "comm_buffers"}
    want = expected_memory(run.ref_cfg, run.spec, run.eng.world_size, run.frozen)
    v.memory_bytes = {"engine": memory, "expected": want}
    v.note("memory", first_difference("resident bytes", memory, want))
    released = set(run.eng.released_grads())
    got = [u.name in released for u in run.eng.units]
    expected = expected_released(run.ref_cfg, run.spec, run.device.type)
    if got != expected:
        i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        v.note("memory", f"unit {i}'s gradient buffer released: engine {got[i]}, expected "
                         f"{expected[i]} (release_grads between steps)")  # fmt: skip
    if run.ref_model is not None:  # frozen parameters: the cast start values, never updated
        why = frozen_unchanged(
            run.eng, run.eng.module, frozen_working(run.ref_model, run.cell.precision)
        )
        if why:
            v.fail(why)


def run_cell(rank: int, world_size: int, cell: Cell) -> dict:
    """Run one cell on this rank; returns this rank's verdict (Verdict.as_dict). The checks are
    named: structure; every step the reported values, the traffic, then the state (bits) or the
    bounds (fast mode, in lock-step: every step starts from the reference's state); then the
    memory and the frozen parameters."""
    assert cell.world_size == world_size, (cell.world_size, world_size)
    run, v = build_cell(rank, cell), Verdict(rank)
    if run.stale is not None and run.stale.exists():  # a rank's own check: no collective
        v.fail(f"disk tier: a dead owner's folder, {run.stale}, was not removed at the start")
    if not check_structure(run, v):
        return v.as_dict(cell.mode)
    source = (
        _Injected(cell, run.eng, run.spec)
        if cell.injected
        else _Backward(cell, run.eng, run.ref_model, run.rcfg, run.device)
    )
    ref, res, before_ran = run.start, None, None
    for step in range(cell.steps):
        grads, losses = source.grads(step, ref)
        before = ref
        ref, info = train_step(before, grads, run.spec, run.rcfg)
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
    verify.report.guarded) and the next one runs."""
    return [guarded(cell_name(c), lambda c=c: run_one(rank, n, c)) for c in cells]


def run_cells(rank: int, world_size: int, cells: list[Cell]) -> list[dict]:
    """Every cell of one world size, in one pass over the same process group.

    An exception in a cell is that cell's failure (verify.report.guarded: a verdict that failed
    with "raised <Type>: <message>", and its `error`), not the batch's: a broken engine must
    show up as a failing row. An exception on some ranks only can leave the others waiting in a
    collective; the pool's timeout names them then.
    """
    torch.set_num_threads(1)
    return [
        guarded(
            cell_name(c),
            lambda c=c: run_delayed(rank, world_size, c),
            failed=lambda error, c=c: raised_verdict(rank, c, error),
        )
        for c in cells
    ]


def run_delayed(rank: int, world_size: int, cell: Cell) -> dict:
    """run_cell under the cell's injected delays; the verdict counts the delayed launches."""
    with injected_delays(cell.delays, cell.seed, rank) as delayed:
        out = run_cell(rank, world_size, cell)
    return {**out, "delayed_launches": delayed[0]}


def raised_verdict(rank: int, cell: Cell, error: str) -> dict:
    """This rank's verdict on a cell that raised `error`."""
    v = Verdict(rank)
    v.fail(f"raised {error}")
    return v.as_dict(cell.mode)


def reference_trajectory(cell: Cell) -> list:
    """The reference's StepInfo of every step of a cell, in this process and without an engine
    (backward cells on a CPU copy of the model): which steps clip, skip or overflow, so that
    the matrix can choose clip_norm and tests can check what the --quick cells exercise."""
    build = MODELS[cell.model][0]
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
            batches = MODELS[cell.model][1](
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
