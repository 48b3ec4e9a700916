"""The paper's analytic memory model: resident model-state bytes per data-parallel rank.

Legend (paper symbols, arXiv 1910.02054 §3.1 and §5):
- Ψ = ``num_params``: the number of model parameters.
- N_d (N) = ``world_size``: the data-parallel degree.
- K = ``k``: the optimizer-state multiplier, bytes per parameter of the fp32 master copy plus the
  optimizer states. 12 for mixed-precision Adam, 8 for mixed-precision SGD with momentum, 4 for
  plain mixed-precision SGD (docs/design.md §2).
- M: micro-batches per step, so ``accumulation`` = M/N is the number of micro-steps per step.
- N_m = ``mp``: the model-parallel degree (Table 2; :func:`checkpoint_bytes`, P_a).
- ``stage``: 0 = baseline DP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p.

Two forms of the same model:
- :func:`model_state_bytes` is the paper's Figure 1 formula, parametrised by K only.
- :func:`model_state_breakdown` is the general form of docs/design.md §3, by category (working
params,
  reduced gradients, fp32 master, optimizer states), with dtypes, optimizer, M/N and padding as
  parameters. In the paper's configuration its total equals the Figure 1 formula to the bit.

[Note: exact arithmetic] Every quantity is computed with ``fractions.Fraction`` and rounded to a
float once, at the end. So ``model_state_breakdown(...).total == model_state_bytes(...)`` holds
exactly, whatever order the terms are summed in: with floats, ``4Ψ/N + 8Ψ/N`` and ``12Ψ/N`` can
differ in the last bit.

Everything here is pure Python: it must import in a fraction of a second, without torch or
NumPy, for notebooks and for tests that only need the arithmetic.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from fractions import Fraction

GB = 10**9
"""The paper's gigabyte: Table 1 re-derives from its formulas with 1 GB = 1e9 bytes."""

STAGE_LABELS = ("Baseline DP", "P_os", "P_os+g", "P_os+g+p")
"""The paper's names of stages 0-3 (Figure 1, Tables 1-2)."""

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}
"""Optimizer states per parameter (Adam: m and v; SGD with momentum: the momentum buffer)."""


def _fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: expected {allowed}")


def _real(name: str, value: object) -> Fraction:
    """A finite real >= 0, returned exactly (a float is an exact binary fraction)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise _fail(name, value, "a finite number >= 0")
    return Fraction(value)


def _integer(name: str, value: object, *, minimum: int) -> int:
    # bool is an Integral, but True as a world size is a bug in the caller, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _fail(name, value, f"an integer >= {minimum}")
    return int(value)


def _stage(stage: object) -> int:
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage not in range(4):
        raise _fail("stage", stage, "one of 0, 1, 2, 3 (baseline DP, P_os, P_os+g, P_os+g+p)")
    return int(stage)


def _bytes_per_param(world_size: object, stage: object, k: object) -> Fraction:
    """Per-device model-state bytes per parameter, the paper's Figure 1 coefficients."""
    n = Fraction(_integer("world_size", world_size, minimum=1))
    stage = _stage(stage)
    k = _real("k", k)
    # 2Ψ fp16 params, 2Ψ fp16 grads, KΨ fp32 master + optimizer states (paper §3.1, Figure 1).
    if stage == 0:
        return 2 + 2 + k
    if stage == 1:
        return 2 + 2 + k / n
    if stage == 2:
        return 2 + (2 + k) / n
    return (2 + 2 + k) / n


def bytes_per_param(world_size: int, stage: int, *, k: float = 12) -> float:
    """Per-device model-state bytes per parameter at data-parallel degree N_d (Figure 1)."""
    return float(_bytes_per_param(world_size, stage, k))


def model_state_bytes(num_params: float, world_size: int, stage: int, *, k: float = 12) -> float:
    """Per-device model-state bytes in the paper's configuration (Figure 1).

    stage 0 (baseline DP): (2 + 2 + K)·Ψ
    stage 1 (P_os):        2Ψ + 2Ψ + K·Ψ/N_d
    stage 2 (P_os+g):      2Ψ + (2 + K)·Ψ/N_d
    stage 3 (P_os+g+p):    (2 + 2 + K)·Ψ/N_d

    Raises ValueError for a stage outside 0..3, world_size < 1, num_params < 0 or k < 0.
    """
    psi = _real("num_params", num_params)
    return float(psi * _bytes_per_param(world_size, stage, k))


def max_model_params(
    memory_bytes: float, world_size: int, stage: int, *, k: float = 12, mp: int = 1
) -> float:
    """The largest Ψ whose per-device model states fit in ``memory_bytes`` (Table 2's inversion).

    Model parallelism of degree ``mp`` (N_m) splits the model, so each device holds the model
    states of Ψ/mp parameters, partitioned over N_d = ``world_size`` by the stage:
    Ψ = mp · memory_bytes / (bytes per parameter per device at N_d). Activations and buffers are
    not counted, as in the paper's theoretical columns.
    """
    memory = _real("memory_bytes", memory_bytes)
    mp = _integer("mp", mp, minimum=1)
    return float(mp * memory / _bytes_per_param(world_size, stage, k))


def reduction_factor(world_size: int, stage: int, *, k: float = 12) -> float:
    """Baseline bytes divided by the stage's bytes at a finite N_d (independent of Ψ)."""
    return float(_bytes_per_param(world_size, 0, k) / _bytes_per_param(world_size, stage, k))


def asymptotic_reduction(stage: int, *, world_size: int | None = None, k: float = 12) -> float:
    """The paper's memory reduction for large N_d: 1x, 4x, 8x and N_d at K = 12 (Figure 1).

    Stages 1 and 2 tend to (4 + K)/4 and (4 + K)/2 as N_d grows (4Ψ + KΨ/N_d ≈ 4Ψ and
    2Ψ + (2 + K)Ψ/N_d ≈ 2Ψ). Stage 3's reduction is exactly N_d at every N_d, so it needs
    ``world_size``.
    """
    stage = _stage(stage)
    k = _real("k", k)
    if stage == 0:
        return 1.0
    if stage == 1:
        return float((4 + k) / 4)
    if stage == 2:
        return float((4 + k) / 2)
    if world_size is None:
        raise _fail("world_size", world_size, "an integer >= 1: stage 3 reduces memory N_d-fold")
    return float(_integer("world_size", world_size, minimum=1))


def optimizer_k(
    *, master_bytes: float = 4, optimizer_states: int = 2, state_bytes: float = 4
) -> float:
    """K = master_bytes + optimizer_states · state_bytes.

    12 for mixed-precision Adam (4 + 2·4), 8 for mixed-precision SGD with momentum (4 + 1·4),
    4 for plain mixed-precision SGD (4 + 0), 8 for pure fp32 Adam (0 + 2·4).
    """
    master = _real("master_bytes", master_bytes)
    states = _integer("optimizer_states", optimizer_states, minimum=0)
    return float(master + states * _real("state_bytes", state_bytes))


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Resident model-state bytes on one rank, by category (docs/design.md §3)."""

    params: float
    """Working copy of the parameters, in the compute dtype."""
    grads: float
    """Reduced gradients in the reduction dtype, plus the deterministic mode's partial sums."""
    master: float
    """fp32 master copy of the parameters (0 in pure fp32 training)."""
    optimizer: float
    """Optimizer states (Adam's m and v, SGD's momentum)."""
    frozen: float = 0.0
    """Frozen parameters (requires_grad=False), held in the compute dtype only."""
    _exact: tuple[Fraction, ...] | None = field(default=None, init=False, repr=False, compare=False)
    # The unrounded categories when model_state_breakdown built this, so that total is rounded
    # once ([Note: exact arithmetic]); None when a caller built it from its own numbers.

    @property
    def total(self) -> float:
        """params + grads + master + optimizer + frozen, summed exactly and rounded once."""
        parts = self._exact
        if parts is None:
            parts = tuple(
                Fraction(x)
                for x in (self.params, self.grads, self.master, self.optimizer, self.frozen)
            )
        return float(sum(parts))

    def to_dict(self) -> dict[str, float]:
        """The categories and the total, as plain floats for JSON records ("frozen" only when
        there are frozen parameters, as engine.memory_report() has it)."""
        out = {"params": self.params, "grads": self.grads, "master": self.master}
        out["optimizer"] = self.optimizer
        if self.frozen:
            out["frozen"] = self.frozen
        return {**out, "total": self.total}


def model_state_breakdown(
    *,
    num_params: float,
    world_size: int,
    stage: int,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    master_bytes: float = 4,
    optimizer_states: int = 2,
    state_bytes: float = 4,
    accumulation: int = 1,
    deterministic: bool = True,
    padding: int = 0,
    frozen_params: float = 0,
    frozen_padding: int = 0,
) -> MemoryBreakdown:
    """Resident model-state bytes per rank by category, the general form of docs/design.md §3.

    Rules, with numel = num_params + padding and N = world_size (the NumPy simulation of N ranks
    reports its per-rank bytes by the same rules, and tests compare the two for equality):

    - params (working copy, compute dtype of ``param_bytes``): numel·param_bytes at stages 0-2;
      numel·param_bytes/N at stage 3.
    - grads (reduced gradients in the reduction dtype, whose size is ``grad_bytes``):
      numel·grad_bytes at stages 0-1; numel·grad_bytes/N at stages 2-3. Plus, when
      ``deterministic`` and ``accumulation`` > 1,
      extra = floor(log2(accumulation))·numel·grad_bytes/N at every stage.
      Why shards at every stage: deterministic mode reduce-scatters every micro-step (docs/design.md
      §2), so the binary counter of the tree-ordered reduction holds shards, and the peak number
      of partial sums held besides the final one while streaming n micro-steps is
      max popcount(j) for 1 <= j < n, which is floor(log2 n). Fast mode accumulates in the
      gradient buffer itself: no extra.
    - master (fp32 master copy; ``master_bytes`` = 4 in mixed precision, 0 in pure fp32 training
      where the working copy is the master): numel·master_bytes at stage 0, /N at stages 1-3.
    - optimizer: numel·optimizer_states·state_bytes at stage 0, /N at stages 1-3.
      ``optimizer_states``: Adam/AdamW 2, SGD with momentum 1, plain SGD 0.

    K = master_bytes + optimizer_states·state_bytes (:func:`optimizer_k`). In the paper's
    configuration (param 2, grad 2, master 4, Adam, accumulation 1, padding 0) the total equals
    :func:`model_state_bytes` exactly. Pure fp32 Adam (param 4, grad 4, master 0) is 16Ψ at
    stage 0.

    - frozen (parameters with requires_grad=False, docs/design.md §2): their own buffers in the
      compute dtype, nothing else (no gradient, master or state): (frozen_params +
      frozen_padding)·param_bytes at stages 0-2, /N at stage 3. num_params counts the trainable
      parameters alone. A LoRA fine-tune at stage 3 with Ψ_f frozen and Ψ_t trainable elements
      holds 2Ψ_f/N + (2 + 2 + 12)Ψ_t/N in the paper's configuration.

    ``accumulation`` is M/N, micro-batches per step divided by N, an integer >= 1. ``padding`` is
    the number of padding elements of the flat buffers (alignment and equal shards, docs/design.md
    §3).
    Raises ValueError naming the field, its value and what is allowed.
    """
    numel = _real("num_params", num_params) + _integer("padding", padding, minimum=0)
    n = _integer("world_size", world_size, minimum=1)
    stage = _stage(stage)
    param_bytes = _real("param_bytes", param_bytes)
    grad_bytes = _real("grad_bytes", grad_bytes)
    master_bytes = _real("master_bytes", master_bytes)
    states = _integer("optimizer_states", optimizer_states, minimum=0)
    state_bytes = _real("state_bytes", state_bytes)
    accumulation = _integer("accumulation", accumulation, minimum=1)
    if not isinstance(deterministic, bool):
        raise _fail("deterministic", deterministic, "True or False")

    params = numel * param_bytes / (n if stage == 3 else 1)
    grads = numel * grad_bytes / (n if stage >= 2 else 1)
    if deterministic and accumulation > 1:
        # floor(log2(accumulation)), exactly, without a float logarithm.
        grads += (accumulation.bit_length() - 1) * numel * grad_bytes / n
    master = numel * master_bytes / (n if stage >= 1 else 1)
    optimizer = numel * states * state_bytes / (n if stage >= 1 else 1)
    frozen = _real("frozen_params", frozen_params)
    frozen += _integer("frozen_padding", frozen_padding, minimum=0)
    frozen = frozen * param_bytes / (n if stage == 3 else 1)
    return _rounded_once(params, grads, master, optimizer, frozen)


def _rounded_once(*exact: Fraction) -> MemoryBreakdown:
    """The breakdown of the exact categories (params, grads, master, optimizer, frozen), each
    rounded to a float once; total sums the exact ones ([Note: exact arithmetic])."""
    params, grads, master, optimizer, frozen = (float(x) for x in exact)
    out = MemoryBreakdown(
        params=params, grads=grads, master=master, optimizer=optimizer, frozen=frozen
    )
    object.__setattr__(out, "_exact", exact)  # frozen: set once, here, before anyone sees it
    return out


def checkpoint_bytes(
    *,
    layers: int,
    tokens: int,
    hidden: int,
    mp: int = 1,
    partitioned: bool = False,
    dtype_bytes: float = 2,
) -> float:
    """Activation checkpoints one rank keeps per micro-step: one input of b·s·h elements
    (tokens = b·s) per checkpointed block, L blocks (paper §6.1, docs/design.md §6).

    Under model parallelism every MP rank holds the whole replicated input; with P_a
    (``partitioned``) it keeps its part of ⌈b·s·h / N_m⌉ elements (zero/mp/partitioned.py, the
    last part zero-padded). Where they live (device, or host with P_a+cpu / offload) is the
    caller's: the bytes are the same."""
    layers = _integer("layers", layers, minimum=0)
    x = _integer("tokens", tokens, minimum=1) * _integer("hidden", hidden, minimum=1)
    mp = _integer("mp", mp, minimum=1)
    if not isinstance(partitioned, bool):
        raise _fail("partitioned", partitioned, "True or False")
    if partitioned and mp == 1:
        raise _fail("partitioned", partitioned, "False when mp=1 (P_a needs N_m > 1)")
    kept = -(-x // mp) if partitioned else x
    return float(layers * kept * _real("dtype_bytes", dtype_bytes))
