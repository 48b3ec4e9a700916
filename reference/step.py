"""One data-parallel training step, single process: the ground truth every ZeRO stage must match.

Legend: N world size, M micro-batches per step, S loss scale, g_j micro-batch j's gradient in the
compute dtype (already multiplied by S, as backward of S * loss produces it), R the reduced
gradient, t the optimizer's step count, C the clipping-chunk size.

The step, in order (docs/design.md §2):
  1. R = reduce_microbatches([reduction_dtype(g_j)], N): the tree of reference/tree.py.
  2. overflow = any non-finite value in any g_j or in R. On overflow the step is skipped: only
     the loss scaler (fp16: scale * backoff) and the data-step counter change; the parameters,
     the optimizer state and t stay as they were. fp32/bf16 raise instead, unless
     nonfinite="skip".
  3. g = fp32(R) * s(1 / (S * M)): unscaling and averaging are one multiplication, after the
     whole sum.
  4. norm = global_norm over the layout's chunks (float64, reference/layout.py, always computed
     and returned). With clip_norm set: coef = s(clip_norm / (norm + 1e-6)); if coef < 1,
     g = g * coef.
  5. t = t + 1; each *used* parameter p (below) advances its own count t_p = t_p + 1 and is
     updated by its group's optimizer with t_p (reference/optim.py); the others are untouched.
  6. The working copy is the fp32 master rounded to the compute dtype (nearest even).
Here s(x) means x computed in float64 and rounded once to float32.
[Note: unused parameters] A micro-batch's `grads` may omit a parameter: it had no gradient
there (backward left its .grad None). Where some micro-batch has one, the others count as
zeros, as DDP reduces them. A parameter that no micro-batch of the step has is *unused*: the
optimizer skips it exactly as torch.optim skips `grad is None` (no decay, no momentum or moment
update, its own step count t_p does not advance; torch keeps state["step"] per parameter). Its
zeros still enter R and the norm, which they do not change.
Frozen parameters (requires_grad=False) are not in the spec: no gradient, master, optimizer state
or place in the norm's chunks, never updated; they are held in the compute dtype, cast once from
their start value (nearest even), and reach the step only through the g_j computed with them.
So the norm and every trainable bit are those of the model without them (docs/design.md §2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import optim
from .layout import DEFAULT_CHUNK, UnitLayout, model_layout
from .precision import DTYPES, ScalerConfig, ScalerState, cast, f32, scaler_init, scaler_update
from .tree import chunk_sumsq, global_norm, reduce_microbatches

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon

Grads = Mapping[str, np.ndarray]  # parameter name -> gradient, in the compute dtype


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """What one step means: precision, reduction, optimizer, clipping, N and M."""

    optimizer: str = "adamw"
    """'sgd', 'adam' or 'adamw'."""
    groups: tuple[optim.Hyper, ...] = (optim.Hyper(),)
    """Hyper-parameters of each parameter group; ModelSpec.group_of maps names to indices."""
    precision: str = "fp32"
    """Compute dtype of the working copy and gradients: 'fp32', 'bf16' or 'fp16'."""
    reduce_dtype: str | None = None
    """Dtype of the gradient sum: 'fp32' (None means fp32) or the compute dtype (paper config)."""
    world_size: int = 1
    """N: the tree over ranks depends on it (only the shape; invariant for powers of two)."""
    micro_batches: int = 1
    """M: micro-batches per step, a positive multiple of world_size."""
    clip_norm: float | None = None
    """Clip the global L2 norm to this value; None disables clipping."""
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    """Dynamic loss scaling (fp16 only)."""
    nonfinite: str = "raise"
    """fp32/bf16 only: 'raise' (FloatingPointError) or 'skip' the step on non-finite gradients."""

    def __post_init__(self):
        optim.check_kind(self.optimizer)
        if self.precision not in DTYPES:
            raise ValueError(f"precision={self.precision!r}: allowed are {sorted(DTYPES)}")
        if self.reduce_dtype not in (None, "fp32", self.precision):
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype!r}: allowed are 'fp32' or the compute dtype "
                f"{self.precision!r}"
            )
        if not isinstance(self.groups, (tuple, list)) or not self.groups:
            raise ValueError(f"groups={self.groups!r}: a non-empty tuple of Hyper is needed")
        for i, hp in enumerate(self.groups):
            if not isinstance(hp, optim.Hyper):  # caught here, not at the first step
                raise ValueError(f"groups[{i}]={hp!r}: must be a reference.optim.Hyper")
        if not isinstance(self.scaler, ScalerConfig):
            raise ValueError(f"scaler={self.scaler!r}: must be a ScalerConfig")
        for name in ("world_size", "micro_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name}={v!r}: must be an integer")
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: must be >= 1")
        if self.micro_batches < 1 or self.micro_batches % self.world_size:
            raise ValueError(
                f"micro_batches={self.micro_batches}: must be a positive multiple of "
                f"world_size={self.world_size}"
            )
        c = self.clip_norm
        if c is not None and not (
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0
        ):
            raise ValueError(f"clip_norm={c!r}: must be a finite number > 0, or None")
        if self.nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite={self.nonfinite!r}: allowed are 'raise', 'skip'")

    @property
    def reduction(self) -> str:
        return self.reduce_dtype or "fp32"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The parameters: their units (flat layout, reference/layout.py) and parameter groups."""

    layouts: tuple[UnitLayout, ...]
    group_of: Mapping[str, int]

    @classmethod
    def build(cls, units, group_of=None, *, chunk: int = DEFAULT_CHUNK) -> ModelSpec:
        """units: a list of units, each a list of (name, shape); group_of: name -> group index."""
        layouts = tuple(model_layout(units, chunk=chunk))
        names = [s.name for lay in layouts for s in lay.slots]
        group_of = dict(group_of or {})
        return cls(layouts=layouts, group_of={n: group_of.get(n, 0) for n in names})

    @property
    def names(self) -> list[str]:
        return [s.name for lay in self.layouts for s in lay.slots]

    @property
    def numel(self) -> int:
        return sum(lay.numel for lay in self.layouts)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: s.shape for lay in self.layouts for s in lay.slots}


@dataclass(frozen=True, kw_only=True)
class TrainState:
    master: dict[str, np.ndarray]  # fp32 master weights, by parameter name
    opt: dict[str, dict[str, np.ndarray]]  # optimizer state arrays, by parameter name
    t: int = 0  # optimizer steps taken (skipped steps excluded)
    data_step: int = 0  # steps attempted (skipped steps included): seeds the data
    scaler: ScalerState | None = None  # fp16 only
    steps: Mapping[str, int] | None = None  # t_p: each parameter's own optimizer steps
    """[Note: unused parameters]; None means every parameter has taken all t steps."""

    def step_of(self, name: str) -> int:
        """t_p: the optimizer steps parameter `name` has taken."""
        return self.t if self.steps is None else self.steps[name]


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    overflow: bool
    skipped: bool
    scale: float  # S used by this step
    norm: np.float64 | None  # global gradient norm before clipping (None when skipped)
    clip_coef: np.float32 | None  # applied coefficient, None when no clipping happened
    reduced: dict[str, np.ndarray]  # R, in the reduction dtype, before unscaling


def init_state(master: Mapping[str, np.ndarray], spec: ModelSpec, cfg: StepConfig) -> TrainState:
    for n, grp in spec.group_of.items():
        if not 0 <= grp < len(cfg.groups):
            raise ValueError(
                f"group_of[{n!r}]={grp}: allowed are 0..{len(cfg.groups) - 1} "
                f"({len(cfg.groups)} parameter group(s) configured)"
            )
    master = {n: np.asarray(master[n], np.float32).copy() for n in spec.names}
    opt = {
        n: optim.init_state(cfg.optimizer, cfg.groups[spec.group_of[n]], master[n].shape)
        for n in spec.names
    }
    scaler = scaler_init(cfg.scaler) if cfg.precision == "fp16" else None
    return TrainState(master=master, opt=opt, scaler=scaler, steps=dict.fromkeys(spec.names, 0))


def working_copy(state: TrainState, cfg: StepConfig) -> dict[str, np.ndarray]:
    """The compute-dtype parameters forward and backward use (round to nearest even)."""
    return {n: cast(p, cfg.precision) for n, p in state.master.items()}


def any_nonfinite(arrays) -> bool:
    return any(not np.isfinite(np.asarray(a, np.float32)).all() for a in arrays)


def norm_partials(g: Mapping[str, np.ndarray], spec: ModelSpec) -> list[np.ndarray]:
    """Per-unit chunk partials of a gradient dict, cut from the N-independent layout."""
    return [chunk_sumsq(lay.flatten(g, 1, np.float32), lay.chunk) for lay in spec.layouts]


def used_names(grads: Sequence[Grads], spec: ModelSpec) -> set[str]:
    """The parameters some micro-batch has a gradient for ([Note: unused parameters]); a name
    outside the spec is an error."""
    known = set(spec.names)
    for j, g in enumerate(grads):
        extra = sorted(set(g) - known)
        if extra:
            raise ValueError(f"grads[{j}][{extra[0]!r}]: not a parameter of the model spec")
    return {n for n in spec.names if any(n in g for g in grads)}


def complete(g: Grads, spec: ModelSpec, dtype: str) -> dict[str, np.ndarray]:
    """One micro-batch's gradients with every absent parameter as zeros (+0) of `dtype`."""
    return {
        n: g[n] if n in g else np.zeros(shape, DTYPES[dtype]) for n, shape in spec.shapes.items()
    }


def train_step(
    state: TrainState, grads: Sequence[Grads], spec: ModelSpec, cfg: StepConfig, zeropp=None
) -> tuple[TrainState, StepInfo]:
    """One step from per-micro-batch gradients; see the module docstring for the exact order.
    zeropp: ZeRO++'s quantized gradient sum (reference/zeropp.py, [Note: qgZ's sum]) for the
    units it names, in place of the tree over ranks; None: none."""
    used, reduced, overflow, scale, g = reduce_and_unscale(state, grads, spec, cfg, zeropp)
    if overflow:
        return skip_step(state, cfg, reduced, scale)
    norm = global_norm(norm_partials(g, spec))
    coef = clip_coefficient(norm, cfg.clip_norm)
    new = update(state, g, used, spec, cfg, coef)
    return new, StepInfo(
        overflow=False, skipped=False, scale=scale, norm=norm, clip_coef=coef, reduced=reduced
    )


def reduce_and_unscale(
    state: TrainState, grads: Sequence[Grads], spec: ModelSpec, cfg, zeropp=None
):
    """Steps 1-3: (used names, R by name, overflow?, S, g = fp32(R)·s(1/(S·M)) or None)."""
    m = len(grads)
    if m != cfg.micro_batches:
        raise ValueError(
            f"grads: got {m} micro-batches, config says micro_batches={cfg.micro_batches}"
        )
    used = used_names(grads, spec)
    grads = [complete(g, spec, cfg.precision) for g in grads]
    scale = state.scaler.scale if state.scaler is not None else 1.0
    reduced = {
        n: reduce_microbatches([cast(g[n], cfg.reduction) for g in grads], cfg.world_size)
        for n in spec.names
    }
    if zeropp is not None and zeropp.qgz_bits is not None:
        from .zeropp import quantized_reduction

        fp32 = [{n: cast(g[n], "fp32") for n in spec.names} for g in grads]
        reduced.update(quantized_reduction(fp32, spec, zeropp, cfg.world_size))
    overflow = any_nonfinite(g[n] for g in grads for n in spec.names) or any_nonfinite(
        reduced.values()
    )
    if overflow:
        return used, reduced, True, scale, None
    c = f32(1.0 / (scale * m))
    return used, reduced, False, scale, {n: cast(r, "fp32") * c for n, r in reduced.items()}


def update(state: TrainState, g, used: set[str], spec: ModelSpec, cfg, coef) -> TrainState:
    """Steps 4 (the clipping multiplication) to 6 of a step that did not overflow."""
    if coef is not None:
        g = {n: x * coef for n, x in g.items()}
    t = state.t + 1
    master, opt, steps = dict(state.master), dict(state.opt), {}
    for n in spec.names:
        steps[n] = state.step_of(n) + (n in used)
        if n in used:  # an unused parameter is skipped, as torch.optim skips grad None
            hp = cfg.groups[spec.group_of[n]]
            master[n], opt[n] = optim.step(
                cfg.optimizer, state.master[n], g[n], state.opt[n], hp, steps[n]
            )
    scaler = None if state.scaler is None else scaler_update(state.scaler, False, cfg.scaler)
    return TrainState(
        master=master, opt=opt, t=t, data_step=state.data_step + 1, scaler=scaler, steps=steps
    )


def clip_coefficient(norm: np.float64, clip_norm: float | None) -> np.float32 | None:
    """s(clip_norm / (norm + 1e-6)) when that is below 1, else None (nothing to multiply)."""
    if clip_norm is None:
        return None
    coef = f32(clip_norm / (float(norm) + CLIP_EPS))
    return coef if coef < 1 else None


def skip_step(state: TrainState, cfg: StepConfig, reduced, scale: float):
    """An overflowed step: only the scaler and the data-step counter move."""
    if state.scaler is None and cfg.nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite gradient at data step {state.data_step} with precision="
            f"{cfg.precision!r}; set nonfinite='skip' to skip such steps"
        )
    scaler = None if state.scaler is None else scaler_update(state.scaler, True, cfg.scaler)
    new = TrainState(
        master=state.master,
        opt=state.opt,
        t=state.t,
        data_step=state.data_step + 1,
        scaler=scaler,
        steps=state.steps,
    )
    info = StepInfo(
        overflow=True, skipped=True, scale=scale, norm=None, clip_coef=None, reduced=reduced
    )
    return new, info
