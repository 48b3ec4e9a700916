"""The two sides of a verification cell (verify/checks/harness.py): where the engine's gradients
come
from (the model's own backward, or injected draws) and how the reference side computes the same
ones; the comparisons of one rank's state with the reference's, bit for bit; the end-state digest;
the injected delays before collective launches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import random
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from reference import working_copy
from reference.precision import DTYPES, cast, f32
from reference.tree import chunk_sumsq, global_norm
from zero import collectives
from zero.config import TORCH_DTYPES, ZeroConfig
from zero.engine import ZeroEngine, backward_scaled, cast_inputs
from zero.hooks import forward_rng
from zero.loop import train_steps
from zero.ranks import launch

from ..cells.cell import DELAY_S, Cell
from ..cells.inject import to_torch
from .compare import bitwise_equal, max_abs_diff, max_ulp, to_numpy
from .expect import expected_extents
from .expect_hsdp import shard_world


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
    spec: the reference's ModelSpec (verify.checks.expect.reference_spec); its layouts cut the
    reference's flat buffers (without it, the engine's own layouts: older callers)."""
    n, rank = shard_world(eng.config, eng.world_size, eng.rank)  # HSDP: shards of a world of G
    ok, worst_abs, worst_ulp, first = True, 0.0, 0, ""
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


class InjectedSource:
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


class BackwardSource:
    """The gradient source of a model cell: the model's own backward on the step's data, and
    the reference's micro-batches drawn from the reference's copy of the model."""

    def __init__(self, cell: Cell, eng: ZeroEngine, ref_model, rcfg, device, computes=dict):
        """computes(working) -> the values forward computes with (qwz_working)."""
        self.cell, self.eng, self.ref_model, self.rcfg = cell, eng, ref_model, rcfg
        self.data, self.device = cell.builder()[1], device
        self.frozen = frozen_working(ref_model, cell.precision)
        self.computes = computes

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
        work = self.computes({**self.frozen, **working_copy(ref, self.rcfg)})
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


def qwz_working(run, work: dict) -> dict:
    """The values a stage-3 unit computes with under qwZ ([Note: qwZ's values],
    reference/zeropp.py): every sharded unit's, trainable and frozen, quantized; work itself
    without qwZ."""
    n, precision = run.cell.world_size, run.cell.precision
    return quantized_compute(work, run.zeropp, run.spec, run.frozen, run.ref_cfg, n, precision)


def quantized_compute(work: dict, zeropp, spec, frozen, config, n: int, precision: str) -> dict:
    """qwz_working from its parts: zeropp (expect.reference_zeropp), the reference's spec, the
    frozen units (expect.frozen_layouts) and the config they come from."""
    if zeropp is None or not zeropp.qwz_bits:
        return work
    from reference.zeropp import quantized_working

    from .expect_memory import persistent

    out = quantized_working(work, spec, zeropp, n, precision)
    layouts = SimpleNamespace(layouts=[lay for _, lay in frozen])
    sharded = tuple(not persistent(config, lay) for lay in layouts.layouts)
    return quantized_working(out, layouts, dataclasses.replace(zeropp, units=sharded), n, precision)


@dataclass
class CellRun:
    """What one cell builds on one rank: the engine, and the reference side beside it, which
    comes from the model and the cell alone (verify/checks/expect.py)."""

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
    start_checks: list  # the features' checks of what the engine's start must have done
    zeropp: object = None  # reference_zeropp: ZeRO++'s quantized collectives, or None
    frozen_start: dict | None = None  # frozen_working at the start (the reference's model then
    # computes with other values under qwZ)
