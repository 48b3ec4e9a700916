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
(config.units on the model's parameters), groups (config.group_of), configuration and
micro-batches; the engine's units and groups are compared with them, never used.
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
import math
import random
import time
import traceback
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch

from reference import init_state, train_step, working_copy
from reference.optim import Hyper
from reference.precision import DTYPES, ScalerConfig, cast, f32
from reference.tree import chunk_sumsq, global_norm
from zero import collectives, launch
from zero.config import TORCH_DTYPES, ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine, backward_scaled, cast_inputs
from zero.forward import forward_rng
from zero.models import GPT, MLP, GPTConfig, MLPConfig, gpt_microbatches, mlp_microbatches
from zero.train import train_steps

from .branch import BranchMLP, branch_microbatches, skip_microbatches
from .compare import bitwise_equal, max_abs_diff, max_ulp, to_numpy
from .expect import (
    expected_extents,
    expected_memory,
    expected_traffic,
    first_difference,
    frozen_layouts,
    ran_units,
    reference_spec,
    reference_step_config,
    traffic_of_step,
)
from .inject import GradientDraw, ParamModel, draw_for, to_torch
from .lockstep import check_fast_step, gradient_errors

__all__ = ["expected_extents"]  # re-exported: it lived here before verify/expect.py


class NormMLP(MLP):
    """The MLP with a BatchNorm1d (affine=False: buffers only, no parameters) after each hidden
    layer, so that the engine's buffer path runs: buffers kept whole on every rank, rank 0's
    broadcast before every forward ([Note: buffers] in zero/build.py). In training mode a
    BatchNorm normalises with the micro-batch's own statistics, so the gradients are those of
    the reference side's copy whatever its running statistics hold. fp32 cells only: the engine
    keeps buffers in the compute dtype, the reference side's copy in fp32."""

    def __init__(self, cfg: MLPConfig, *, device=None):
        super().__init__(cfg, device=device)
        hidden = cfg.n_layer - 1
        self.norms = torch.nn.ModuleList(
            torch.nn.BatchNorm1d(cfg.d_hidden, affine=False, device=device) for _ in range(hidden)
        )

    def forward(self, x, targets=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(self.norms[i](x))
        loss = None if targets is None else torch.nn.functional.mse_loss(x, targets)
        return x, loss


def frozen_mlp(device=None) -> MLP:
    """The MLP with its middle layer frozen (requires_grad=False): the frozen parameters of
    docs/design.md §2 (a buffer of their own per unit, gathered at stage 3 in forward and, as
    the layer before it trains, in backward; no gradient, master or optimizer state)."""
    model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3), device=device)
    model.layers[1].requires_grad_(False)
    return model


MODELS = {  # build(device=None): on the CPU, or on the meta device (Cell.meta)
    "mlp": (
        lambda device=None: MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3), device=device),
        mlp_microbatches,
    ),
    # numel 481, 37, 1369, 37, 185, 5: none divisible by any N > 1
    "mlp-uneven": (
        lambda device=None: MLP(MLPConfig(d_in=13, d_hidden=37, d_out=5, n_layer=3), device=device),
        mlp_microbatches,
    ),
    "gpt": (
        lambda device=None: GPT(
            GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), device=device
        ),
        gpt_microbatches,
    ),
    "mlp-frozen": (frozen_mlp, mlp_microbatches),
    "mlp-bn": (
        lambda device=None: NormMLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)),
        mlp_microbatches,
    ),
    # a side branch that odd data steps skip: unused parameters (verify/branch.py); used by
    # some ranks only on even steps ("mlp-branch", stages 0-2) or by all ("mlp-skip")
    "mlp-branch": (
        lambda device=None: BranchMLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)),
        branch_microbatches,
    ),
    "mlp-skip": (
        lambda device=None: BranchMLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)),
        skip_microbatches,
    ),
    # no forward: injected gradients only (verify/inject.py)
    "params-even": (lambda: ParamModel("even"), None),
    "params-uneven": (lambda: ParamModel("uneven"), None),
}
GROUPS = {  # group 0: matrices (decayed), group 1: biases and norms
    "sgd": (
        Hyper(lr=0.05, momentum=0.9, weight_decay=0.01),
        Hyper(lr=0.1, momentum=0.5, nesterov=True),
    ),
    "adam": (Hyper(lr=1e-2, weight_decay=0.01), Hyper(lr=2e-2)),
    "adamw": (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=2e-2, betas=(0.8, 0.99))),
}
GRADIENTS = ("backward", "random", "extreme", "nonfinite", "drawn")
UNIT_SIZES = {"tiny": 128, "huge": 4096, "auto": 128}  # clipping chunk C; see Cell.units
DELAY_S = 0.004  # upper end of the random sleep before each collective launch (Cell.delays)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One configuration to verify; every field ends up in the JSON record's `config`."""

    stage: int
    world_size: int
    precision: str
    optimizer: str
    mode: str  # "deterministic" or "fast"
    steps: int = 3
    model: str = "mlp"  # a key of MODELS
    accumulation: int = 2  # M/N micro-steps per step
    clip_norm: float | None = 1.0
    overlap: bool = True
    reduce_dtype: str | None = None
    batch_size: int = 4
    seed: int = 0
    persist_below: int = 0  # stage 3: units this small stay whole
    units: str = "tiny"
    """'tiny': every block its own unit and clipping chunks of 128 elements (many small
    buckets, parameters straddling shards); 'huge': one unit holding everything and chunks of
    4096 (one bucket; at large N most ranks hold only padding); 'auto': units="auto" for the
    engine (zero/units.py), chunks of 128, while the reference side takes the blocks the model
    declares (model.unit_names()), so the engine's detection must find exactly those."""
    gradients: str = "backward"
    """'backward' (the model's own), or injected: 'random', 'extreme', 'nonfinite'
    (verify.inject.draw_for) or 'drawn' (the explicit `draw`)."""
    draw: GradientDraw | None = None
    delays: bool = False
    """Sleep 0-4 ms (seeded per rank) before every collective launch, so that asynchronous
    collectives complete in other orders and interleavings."""
    nonfinite: str = "raise"  # fp32/bf16: 'skip' steps with non-finite gradients instead
    checkpointing: bool = False
    """ZeRO-R: every unit's forward under activation checkpointing (with `offload` too, the
    checkpoints are kept in host memory)."""
    offload: bool = False
    """ZeRO-Offload: master, optimizer states and the gradient shard in host memory."""
    contiguous: bool = False
    """ZeRO-R's M_D: gradient buffers (and, with `checkpointing`, the checkpoints) in
    pre-allocated contiguous arenas (ZeroConfig.contiguous_memory)."""
    bucket_elements: int | None = None
    """ZeRO-R's C_B: reduce-scatters in pieces of at most this many elements."""
    release_grads: bool | None = None
    """Gradient buffers released after every update and allocated again in the next step
    (ZeroConfig.release_grads; None: the engine's default for the device)."""
    meta: bool = False
    """The engine's model is built on the meta device and materialised unit by unit with the
    models' counter-based initial values (ZeroEngine's init_seed); the reference side starts
    from the same model built on the CPU."""
    init: str = "auto"
    """With meta: ZeroEngine's init rule. "own" runs each unit's reset_parameters under its
    unit seed; the reference side recomputes those values itself (own_init)."""
    loss_scale: float | None = None
    """fp16: the loss scaler's first scale (and its floor, where below 1); None: the default
    2^16. Below 1/M the engine checks R itself for overflow ([Note: overflow detection])."""

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: allowed are {sorted(MODELS)}")
        if self.gradients not in GRADIENTS:
            raise ValueError(f"gradients={self.gradients!r}: allowed are {GRADIENTS}")
        if self.units not in UNIT_SIZES:
            raise ValueError(f"units={self.units!r}: allowed are {sorted(UNIT_SIZES)}")
        if self.mode not in ("deterministic", "fast"):
            raise ValueError(f"mode={self.mode!r}: allowed are 'deterministic', 'fast'")
        if self.gradients == "backward" and MODELS[self.model][1] is None:
            raise ValueError(f"model={self.model!r} has no forward: use injected gradients")
        if self.checkpointing and self.injected:
            raise ValueError("checkpointing=True: recomputation needs a forward, not injection")
        if self.model == "mlp-bn" and (self.precision != "fp32" or self.meta):
            raise ValueError("model='mlp-bn': fp32 and a CPU-built model only (see NormMLP)")
        if self.init not in ("auto", "own") or (self.init == "own" and not self.meta):
            raise ValueError(f"init={self.init!r}: 'auto', or 'own' with meta=True")
        if self.units == "auto" and self.model != "gpt":
            raise ValueError(f"units='auto' with model={self.model!r}: only the GPT's blocks")
        if (self.gradients == "drawn") != (self.draw is not None):
            raise ValueError("draw: give a GradientDraw exactly when gradients='drawn'")

    @property
    def micro_batches(self) -> int:
        return self.world_size * self.accumulation

    @property
    def injected(self) -> bool:
        return self.gradients != "backward"

    def gradient_draw(self) -> GradientDraw:
        if self.draw is not None:
            return self.draw
        return draw_for(
            self.gradients,
            self.precision,
            seed=self.seed,
            world_size=self.world_size,
            micro_batches=self.micro_batches,
        )

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
            units={"tiny": tuple(units), "huge": (), "auto": "auto"}[self.units],
            overlap=self.overlap,
            chunk=UNIT_SIZES[self.units],
            persist_below=self.persist_below,
            nonfinite=self.nonfinite,
            activation_checkpointing=self.checkpointing,
            offload_activations=self.checkpointing and self.offload,
            offload_optimizer=self.offload,
            contiguous_memory=self.contiguous,
            bucket_elements=self.bucket_elements,
            release_grads=self.release_grads,
            scaler=self.scaler_config(),
        )

    def scaler_config(self) -> ScalerConfig:
        if self.loss_scale is None:
            return ScalerConfig()
        floor = min(1.0, self.loss_scale / 16)  # room to back off from a small scale
        return ScalerConfig(init_scale=self.loss_scale, min_scale=floor)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["micro_batches"] = self.micro_batches
        return d

    @classmethod
    def from_config(cls, config: dict) -> Cell:
        """The cell of a JSON record's `config` (as_dict's output), e.g. to re-run a failure."""
        d = {k: v for k, v in config.items() if k != "micro_batches"}
        if d.get("draw") is not None:
            g = d["draw"]
            d["draw"] = GradientDraw(
                seed=g["seed"],
                exponents=tuple(g["exponents"]),
                zeros=g["zeros"],
                specials=tuple(tuple(x) for x in g["specials"]),
            )
        return cls(**d)


def cell_device() -> torch.device:
    """Where a cell runs: this rank's device (zero.launch.rank_device): a GPU in a torchrun
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
    or a dict of keyword inputs; rng: the context the forward runs in (zero.forward.forward_rng
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
    original = collectives._launch
    rng = random.Random(f"delays:{seed}:{rank}")

    def late(*a, **kw):
        count[0] += 1
        time.sleep(rng.uniform(0, DELAY_S))
        return original(*a, **kw)

    collectives._launch = late
    try:
        yield count
    finally:
        collectives._launch = original


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


def _verdict(rank: int) -> dict:
    return {
        "rank": rank,
        "bitwise": True,
        "max_abs_diff": 0.0,
        "max_ulp": 0,
        "first": "",
        "skipped_steps": 0,
        "clipped_steps": 0,  # steps whose clip coefficient was < 1 (clipping did something)
        "ratios": {},
        "errors": {},
        # what the engine reported and what it sent and holds, each "" when as expected
        "reported": "",
        "traffic": "",
        "memory": "",
        "memory_bytes": {},
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


def run_cell(rank: int, world_size: int, cell: Cell) -> dict:
    """Run one cell on this rank; returns this rank's verdict.

    The reference side is built from the model and the cell alone (verify/expect.py): its
    units, parameter groups and configuration; the engine is only compared with it."""
    assert cell.world_size == world_size, (cell.world_size, world_size)
    n = world_size
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
    ref = init_state(init, spec, rcfg)
    with warnings.catch_warnings():  # 'huge' cells are one root unit on purpose
        warnings.filterwarnings("ignore", message="stage 3 with units=", category=UserWarning)
        if cell.meta:  # the same initial values, never materialised whole
            init_rule = "own" if cell.init == "own" else "auto"
            eng = ZeroEngine(build(device="meta"), cfg, device=device, init_seed=0, init=init_rule)
        else:
            eng = ZeroEngine(model.to(device), cfg)
    eng.keep_reduced = True  # the reduced-gradient and norm checks read R after each step
    ref_model = None if cell.injected else build().to(device)
    verdict = _verdict(rank)

    def fail(why: str) -> None:
        verdict["bitwise"] = False
        verdict["first"] = verdict["first"] or why

    ours = [[(name, tuple(shape)) for name, shape in u] for u in eng.unit_specs()]
    theirs = [[(s.name, tuple(s.shape)) for s in lay.slots] for lay in spec.layouts]
    if ours != theirs:
        fail(f"units: engine {ours}, reference {theirs}")
        verdict["passed"] = False
        return verdict
    if dict(eng.group_index) != dict(spec.group_of):
        bad = sorted(k for k in spec.group_of if eng.group_index.get(k) != spec.group_of[k])
        fail(
            f"parameter groups: engine puts {bad[0]!r} in group {eng.group_index.get(bad[0])}, "
            f"the config's group_of in {spec.group_of[bad[0]]}"
        )
    source = (
        _Injected(cell, eng, spec)
        if cell.injected
        else _Backward(cell, eng, ref_model, rcfg, device)
    )
    res, before_ran = None, None
    for step in range(cell.steps):
        grads, losses = source.grads(step, ref)
        before = ref
        ref, info = train_step(before, grads, spec, rcfg)
        if cell.mode == "fast":  # lock-step: start from the reference's state every step
            eng.load_full_state(
                before.master,
                before.opt,
                t=before.t,
                data_step=before.data_step,
                scaler=before.scaler,
                steps=before.steps,
            )
        res = source.feed(step, grads, losses)
        verdict["skipped_steps"] += int(info.skipped)
        verdict["clipped_steps"] += int(info.clip_coef is not None)
        if cell.mode == "fast":
            scale = info.scale
            pinned = None
            if not info.skipped:  # the norm of the engine's own R, on every rank together
                pinned = engine_norm(eng, spec, rank, n, scale)
                d_norm = gradient_errors(spec, rcfg, before, info, grads)[-1]

            def norm_ok(ours, theirs, pinned=pinned, d=None if info.skipped else d_norm):
                if ours != pinned:  # bits: the order is pinned in both modes
                    return f"engine {ours!r}, the pinned order on its own R gives {pinned!r}"
                if not abs(ours - theirs) <= d:
                    return f"engine {ours!r}, reference {theirs!r} (bound {d:.3g})"
                return ""
        else:

            def norm_ok(ours, theirs):
                return "" if ours == theirs else f"engine {ours!r}, reference {theirs!r}"

        why = check_reported(step, eng, res, ref, info, losses, norm_ok)
        if why:
            verdict["reported"] = verdict["reported"] or why
            fail(why)
        traffic = traffic_of_step(eng.counter, eng.counter.step - 1)
        ran = ran_units(spec, grads, n, rank)  # which units ran where: from the data alone
        traffic_want = expected_traffic(
            ref_cfg,
            spec,
            n,
            rank,
            forward=not cell.injected,
            skipped=info.skipped,
            frozen=frozen,
            ran=ran,
            before=before_ran,
        )
        before_ran = [r[-1] for r in ran]
        why = first_difference(f"step {step}: traffic", traffic, traffic_want)
        if why and not verdict["traffic"]:
            verdict["traffic"] = why
            fail(why)
        if res.skipped != info.skipped:
            continue
        if cell.mode == "fast":
            if not info.skipped:
                detail = check_fast_step(eng, spec, rcfg, before, ref, info, grads, detail=True)
                for key, (r, err, bound) in detail.items():
                    if r >= verdict["ratios"].get(key, -1.0):
                        verdict["ratios"][key] = r
                        verdict["errors"][key] = (err, bound)
            continue
        ok, worst_abs, worst_ulp, first = compare_rank(eng, ref, rcfg, spec)
        verdict["bitwise"] &= ok
        verdict["max_abs_diff"] = max(verdict["max_abs_diff"], worst_abs)
        verdict["max_ulp"] = max(verdict["max_ulp"], worst_ulp)
        if first and not verdict["first"]:
            verdict["first"] = f"step {step}: {first}"
    memory = {k: v for k, v in eng.memory_report().items() if k != "comm_buffers"}
    memory_want = expected_memory(ref_cfg, spec, n, frozen)
    verdict["memory_bytes"] = {"engine": memory, "expected": memory_want}
    why = first_difference("resident bytes", memory, memory_want)
    if why:
        verdict["memory"] = why
        fail(why)
    if ref_model is not None:  # frozen parameters: the cast start values, never updated
        why = frozen_unchanged(eng, eng.module, frozen_working(ref_model, cell.precision))
        if why:
            fail(why)
    if cell.mode == "fast":
        worst = max(verdict["ratios"].values(), default=0.0)
        verdict["passed"] = verdict["first"] == "" and worst <= 1.0
        if worst > 1.0:
            verdict["first"] = verdict["first"] or f"bound exceeded: {verdict['ratios']}"
    else:
        verdict["passed"] = verdict["bitwise"]
    # the bits the engine ends with, so that two versions of the code can be compared cell by
    # cell (python -m verify --baseline): a refactoring must leave every digest unchanged
    verdict["digest"] = state_digest(eng, res)
    return verdict


def each_cell(run_one, rank: int, n: int, cells) -> list[dict]:
    """run_one(rank, n, cell) for every cell of a section (parity, model parallelism) on this
    rank; a cell that raises is reported as its failure ({"error": its first line}) and the
    next one runs."""
    out = []
    for cell in cells:
        try:
            out.append(run_one(rank, n, cell))
        except Exception as exc:  # noqa: BLE001 - reported as the cell's failure
            out.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})
    return out


def run_cells(rank: int, world_size: int, cells: list[Cell]) -> list[dict]:
    """Every cell of one world size, in one pass over the same process group.

    An exception in a cell is that cell's failure (reported with its last line), not the
    batch's: a broken engine must show up as a failing row. An exception on some ranks only
    can leave the others waiting in a collective; the pool's timeout names them then.
    """
    torch.set_num_threads(1)
    out = []
    for c in cells:
        try:
            with injected_delays(c.delays, c.seed, rank) as delayed:
                out.append(run_cell(rank, world_size, c))
            out[-1]["delayed_launches"] = delayed[0]
        except Exception as exc:  # reported as the cell's failure
            last = traceback.format_exception_only(exc)[-1].strip()
            out.append({**_verdict(rank), "bitwise": False, "first": f"raised {last}"})
            out[-1]["passed"] = False
    return out


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
