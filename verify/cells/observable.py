"""Where a planted bug can show, and what a plan covers: verify/cells/matrix.py's cells read.

OBSERVABLE states, per planted bug (verify/planted/suite.py), the cells that exercise it, as
predicates
([Note: observable] in verify/cells/matrix.py): the base bugs' here, the base pairs' from
verify/cells/interactions.py, each feature's from its record (verify/features/). BRANCH_PREDICATES
names the engine's branches a plan should reach, LISTED_FIELDS the cell fields whose values
`verify --list` counts, and coverage() prints both, per planted bug and per feature pair.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import features
from . import interactions
from .cell import Cell
from .matrix import CLIP_NORM, clips_on_some_steps


def _det(c: Cell) -> bool:
    return c.mode == "deterministic"


OBSERVABLE: dict[str, Callable[[Cell], bool]] = {
    # every rank's extents are compared, so one ULP anywhere fails a bitwise cell
    "one_ulp": lambda c: _det(c) and c.world_size >= 2,
    # a shifted shard exists only where state is partitioned
    "shard_offset": lambda c: _det(c) and c.world_size >= 2 and c.stage >= 1,
    "one_over_n_for_m": lambda c: _det(c) and c.accumulation > 1 and c.clip_norm is None,
    "bias_correction_t_minus_1": lambda c: (
        _det(c) and c.optimizer in ("adam", "adamw") and c.optimizer_steps >= 2
    ),
    "reduce_order": lambda c: (
        _det(c) and c.world_size >= 3 and (c.precision == "fp32" or c.gradients == "extreme")
    ),
    "stale_prefetch": lambda c: (
        c.stage == 3
        and c.overlap
        and c.gradients == "backward"
        and c.units == "tiny"
        and c.persist_below == 0
        and c.steps >= 2
    ),
    # at stages 1-3 a rank that ignores the agreed flag leaves collectives unmatched (a hang,
    # which the pool's timeout reports); at stage 0 the update has no collective to miss
    "overflow_one_rank": lambda c: (
        c.stage == 0 and c.world_size >= 2 and c.gradients == "nonfinite"
    ),
    # the reported loss is the mean over M micro-batches: M/N times it needs M > N
    "loss_m_over_n": lambda c: c.accumulation > 1,
    # counted collectives are compared every step: any stage-3 cell with a sharded unit
    "extra_all_gather_stage3": lambda c: c.stage == 3 and c.model != "params-even",
    # groups differ in their hyper-parameters (GROUPS), and every model has biases
    "decay_on_biases": lambda c: c.optimizer_steps >= 1 and c.groups == "two",
    # the groups are compared with verify/checks/expect.py's table when the engine is built, before
    # any step; every verify model has a parameter of group 1 (a bias or a vector); cells of
    # one group (no group_of) never call the predicate
    "decay_rule_vectors": lambda c: c.groups == "two",
    # min(1, coef) matters only on a step that does not clip
    "uncapped_clip": lambda c: clips_on_some_steps(c),
    # below 1/M the engine must check R itself; needs an overflow in R only
    "unchecked_reduced_overflow": lambda c: (
        c.loss_scale is not None and c.loss_scale < 1 / c.micro_batches and c.gradients == "drawn"
    ),
    # resident bytes are compared in every cell; the streaming tree (deterministic mode, every
    # stage) reports its partial sums each step
    "extra_partial_sum": _det,
    # the reported norm is compared in fast mode too (bitwise against the pinned order)
    "fast_norm_misreported": lambda c: c.mode == "fast" and c.optimizer_steps >= 1,
    # the step count is compared after every step; needs a skipped step
    "t_advances_on_skip": lambda c: c.gradients == "nonfinite" or c.loss_scale is not None,
    # a branch whole steps skip: the skipped parameters are compared (fast mode: bound 0)
    "unused_updated": lambda c: c.model in ("mlp-branch", "mlp-skip"),
}


# -- planted bugs of the features (verify/planted/suite.py)
# ---------------------------------------------
# Where each is observable, and PLANTED_GAPS: cells --quick lacked for one of them (a planted
# bug that no --quick cell can catch is a bug in the preset).


def _units_of(c: Cell) -> tuple[tuple[int, ...], bool]:
    """(numel of each unit, whether a parameter of a new group starts strictly inside some
    rank's master extent) of a cell's model, from the reference side's layout
    (verify/checks/expect.py): a group boundary exactly at a shard start has no run before it."""
    from ..checks.expect import expected_extents, reference_spec
    from ..checks.harness import reference_config

    key = (c.model, c.features, c.units, c.stage, c.world_size, c.persist_below)
    if key not in _UNITS:
        model = c.builder()[0]()
        spec = reference_spec(model, reference_config(c, model))
        inside = False
        for lay in spec.layouts:
            slots = sorted(lay.slots, key=lambda s: s.offset)
            starts = [
                b.offset
                for a, b in zip(slots, slots[1:])
                if spec.group_of[a.name] != spec.group_of[b.name]
            ]
            for r in range(c.world_size):
                ext, _ = expected_extents(c.stage, c.persist_below, lay, r, c.world_size)
                inside |= any(ext.start < x < ext.stop - 1 for x in starts)
        _UNITS[key] = tuple(lay.numel for lay in spec.layouts), inside
    return _UNITS[key]


_UNITS: dict = {}


OBSERVABLE.update({
    # fp32 sums of different micro-batches in another grouping round differently
    "microbatch_rank_major": lambda c: (
        _det(c) and not c.injected and c.world_size >= 2 and c.accumulation > 1
        and c.precision == "fp32"
    ),
    # every unit but the first keeps its unclipped gradient: needs steps that clip, two units
    "clip_first_unit_only": lambda c: (
        _det(c) and c.units == "tiny" and c.optimizer_steps >= 1
        and (c.clip_norm == CLIP_NORM or clips_on_some_steps(c))
    ),
    # the scale after a skipped step is compared (cells that are sure to skip one)
    "scaler_backoff_quarter": lambda c: (
        c.precision == "fp16" and (c.gradients == "nonfinite" or c.loss_scale is not None)
    ),
    # a parameter of another group starting inside some rank's extent (not at a shard start)
    # (one group: no previous group to take the hyper-parameters of)
    "group_run_boundary": lambda c: (
        _det(c) and c.optimizer_steps >= 1 and c.groups == "two" and _units_of(c)[1]
    ),
    # the counted all-gathers: a unit gathered again after its backward
    "prefetch_wrong_unit": lambda c: (
        c.stage == 3 and c.overlap and not c.injected and c.units == "tiny"
        and c.persist_below == 0
    ),
    # a unit exactly at the threshold (PLANTED_GAPS): extents, traffic, memory
    "persist_threshold_off_by_one": lambda c: (
        c.stage == 3 and c.persist_below in _units_of(c)[0]
    ),
    # an fp32 input is not copied by the cast: the engine's forward sees the reference's halving
    "model_scales_input_in_place": lambda c: (
        not c.injected and c.model in ("mlp", "mlp-uneven") and c.precision == "fp32"
    ),
})  # fmt: skip
OBSERVABLE.update(interactions.OBSERVABLE)  # the base pairs' bugs
OBSERVABLE.update({b.name: b.observable for b in features.bugs() if b.kind == "cells"})


BRANCH_PREDICATES: dict[str, Callable[[Cell], bool]] = {
    "clips on some steps, not on others": clips_on_some_steps,
    "clips on every step (CLIP_NORM)": lambda c: c.clip_norm == CLIP_NORM,
    "no clipping": lambda c: c.clip_norm is None,
    "fast mode + persistent stage-3 units": lambda c: (
        c.mode == "fast" and c.stage == 3 and c.persist_below > 0
    ),
    "deterministic + persistent stage-3 units": lambda c: (
        c.mode == "deterministic" and c.stage == 3 and c.persist_below > 0
    ),
    "loss scale below 1/M (R checked itself)": lambda c: (
        c.loss_scale is not None and c.loss_scale < 1 / c.micro_batches
    ),
    "GPT (tied parameters)": lambda c: c.model == "gpt",
    "unused parameters (a branch whole steps skip)": lambda c: (
        c.model in ("mlp-branch", "mlp-skip")
    ),
    "reduction in the compute dtype": lambda c: c.reduce_dtype not in (None, "fp32"),
    "non-finite gradients skipped": lambda c: c.gradients == "nonfinite",
    "injected delays": lambda c: c.delays,
    "stage 3 with a forward and overlap (prefetch)": lambda c: (
        c.stage == 3 and c.overlap and not c.injected
    ),
}
"""Branches of the engine a plan should reach, as predicates on cells (verify --list)."""

LISTED_FIELDS = (
    "stage", "world_size", "precision", "optimizer", "mode", "model", "accumulation",
    "clip_norm", "units", "gradients", "overlap", "delays", "reduce_dtype", "persist_below",
    "loss_scale", "nonfinite", "features",
)  # fmt: skip


def _ids(idx: list[int], most: int = 12) -> str:
    shown = " ".join(f"#{i}" for i in idx[:most])
    return f"{len(idx):>4}  {shown}{' …' if len(idx) > most else ''}"


def coverage(cells: list[Cell], plans: dict | None = None) -> list[str]:
    """Lines of `verify --list`: per field value, per branch and per planted bug, which cells
    (#index in the plan) cover it, a branch no cell covers saying so; then per feature pair
    (verify/cells/interactions.py) the items of `plans` (resume, mp, watchdog, gpu) or cells."""
    out = ["per field value (cells, first indices):"]
    for f in LISTED_FIELDS:
        values: dict = {}
        for i, c in enumerate(cells):
            values.setdefault(repr(getattr(c, f)), []).append(i)
        for v, idx in sorted(values.items()):
            out.append(f"  {f + '=' + v:<46} {_ids(idx)}")
    out.append("per branch:")
    for name, pred in BRANCH_PREDICATES.items():
        idx = [i for i, c in enumerate(cells) if pred(c)]
        out.append(f"  {name:<46} {_ids(idx) if idx else '   0  NOT COVERED'}")
    out.append("per planted bug (OBSERVABLE):")
    for name, pred in OBSERVABLE.items():
        idx = [i for i, c in enumerate(cells) if pred(c)]
        out.append(f"  {name:<46} {_ids(idx) if idx else '   0  NOT COVERED'}")
    return out + interactions.lines({"cells": cells, **(plans or {})})


BRANCH_PREDICATES.update(
    {
        "units='auto' (the engine's detection)": lambda c: c.units == "auto",
        "model built on the meta device": lambda c: c.meta,
        "meta model with its own initialisation (init='own')": lambda c: c.init == "own",
        "buffers (BatchNorm), broadcast before forward": lambda c: c.model == "mlp-bn",
    }
)
BRANCH_PREDICATES.update(features.branches())
LISTED_FIELDS += ("meta", "init", "groups")
