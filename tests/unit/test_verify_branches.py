"""What the --quick preset exercises, and the expectations verify builds without an engine.

The branches are checked on the reference alone (verify.checks.harness.reference_trajectory): which
steps
of a cell clip, skip or overflow does not depend on the engine under test. The traffic and memory
expectations (verify/checks/expect.py) are checked against the design's tables written out again
here."""

import dataclasses

import numpy as np
import pytest

from paper_figures.comm_volume import factor, root_saving
from verify.cells import matrix
from verify.cells.cell import MODELS
from verify.cells.observable import BRANCH_PREDICATES, OBSERVABLE, coverage
from verify.checks.expect import (
    expected_memory,
    expected_traffic,
    reference_groups,
    reference_spec,
    reference_units,
)
from verify.checks.harness import reference_trajectory
from zero.common.memory import model_state_bytes


def quick_cells():
    return matrix.quick()[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_quick_clips_on_some_steps_and_not_on_others_at_every_stage(stage):
    found = []
    for c in quick_cells():
        if c.stage != stage or not matrix.clips_on_some_steps(c):
            continue
        infos = [i for i in reference_trajectory(c) if not i.skipped]
        clipped = [i.clip_coef is not None for i in infos]
        if any(clipped) and not all(clipped):
            found.append(c)
    assert found, f"no --quick cell at stage {stage} both clips and does not"


def test_cells_with_clip_norm_0_5_clip_on_every_step():
    # why BRANCHES exists: CLIP_NORM is below every norm of the covering cells
    c = next(c for c in quick_cells() if c.clip_norm == matrix.CLIP_NORM and not c.injected)
    assert all(i.clip_coef is not None for i in reference_trajectory(c))


def test_quick_holds_the_branches_the_covering_array_cannot_reach():
    cells = quick_cells()
    for name in (
        "bucket_elements (C_B pieces)",
        "fast mode + optimizer offload",
        "fast mode + persistent stage-3 units",
        "loss scale below 1/M (R checked itself)",
        "GPT (tied parameters)",
        "clips on some steps, not on others",
    ):
        assert any(BRANCH_PREDICATES[name](c) for c in cells), name
    assert "NOT COVERED" not in "\n".join(coverage(cells))


def test_the_low_loss_scale_cell_overflows_in_r_only():
    (c,) = [c for c in quick_cells() if OBSERVABLE["unchecked_reduced_overflow"](c)]
    assert c.loss_scale < 1 / c.micro_batches
    draw = c.gradient_draw()
    infos = reference_trajectory(c)
    assert infos[0].skipped and not any(i.skipped for i in infos[1:])
    # every micro-batch gradient of step 0 is finite: the overflow is in the sum R alone
    spec = reference_spec(MODELS[c.model][0](), c.zero_config(()))
    shapes = {s.name: s.shape for lay in spec.layouts for s in lay.slots}
    grads = draw.materialise(0, sorted(shapes), shapes, c.micro_batches, c.precision)
    assert all(np.isfinite(np.asarray(g[n], np.float32)).all() for g in grads for n in g)
    assert not all(np.isfinite(np.asarray(r, np.float32)).all() for r in infos[0].reduced.values())


def test_reference_units_put_tied_parameters_once_in_the_root():
    model = MODELS["gpt"][0]()
    cfg = dataclasses.replace(quick_cells()[0], units="tiny").zero_config(model.unit_names())
    units = reference_units(model, cfg)
    assert [u for u, _ in units] == ["", *model.unit_names()]
    names = [n for _, ps in units for n, _ in ps]
    assert len(names) == len(set(names)) == len(dict(model.named_parameters()))
    groups = reference_groups(model, cfg)
    assert {n for n, g in groups.items() if g == 0} == {
        n for n, p in model.named_parameters() if p.ndim >= 2
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("det", [True, False])
@pytest.mark.parametrize(("n", "k"), [(2, 1), (4, 4), (3, 2)])
def test_expected_traffic_is_the_design_table(stage, det, n, k):
    cell = dataclasses.replace(
        quick_cells()[0], stage=stage, world_size=n, accumulation=k,
        mode="deterministic" if det else "fast", model="gpt", gradients="backward", units="tiny",
    )  # fmt: skip
    model = MODELS["gpt"][0]()
    cfg = cell.zero_config(model.unit_names())
    spec = reference_spec(model, cfg)
    shards = [lay.shard_numel(n) for lay in spec.layouts]
    f, save = factor(stage, det, k), root_saving(stage, k)
    for rank in range(n):
        got = expected_traffic(cfg, spec, n, rank, forward=True)
        assert sum(e for _, e, _ in got.values()) == (n - 1) * (f * sum(shards) - save * shards[0])
    payload = sum(
        e - p
        for r in range(n)
        for _, e, p in expected_traffic(cfg, spec, n, r, forward=True).values()
    )
    numels = [lay.numel for lay in spec.layouts]
    assert payload == (n - 1) * (f * sum(numels) - save * numels[0])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expected_memory_is_the_papers_formula_without_padding(stage):
    # the paper's configuration (bf16, reduction in bf16, Adam, M = N) on a model whose units
    # have no padding at N = 2: the categories add up to Figure 1's formula exactly
    cell = dataclasses.replace(
        quick_cells()[0], stage=stage, world_size=2, precision="bf16", reduce_dtype="bf16",
        optimizer="adam", accumulation=1, model="params-even", gradients="random", units="huge",
    )  # fmt: skip
    model = MODELS[cell.model][0]()
    cfg = cell.zero_config(model.unit_names())
    spec = reference_spec(model, cfg)
    if any(lay.padded_numel(2) != lay.numel for lay in spec.layouts):
        psi = sum(lay.padded_numel(2) for lay in spec.layouts)
    else:
        psi = spec.numel
    got = expected_memory(cfg, spec, 2)
    assert sum(got.values()) == model_state_bytes(psi, 2, stage)
