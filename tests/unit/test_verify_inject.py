"""Gradient injection with hypothesis-drawn gradients: the engine equals the reference bitwise
after every step, on every rank, at every stage, for inputs no model would produce.

Hypothesis draws the whole cell in the parent (world size, stage, precision, optimizer, M/N,
unit size, parameter sizes, clipping) and the gradients' GradientDraw: the bulk exponent range
(down into the subnormals, up to the fp16 maximum), a fraction of exact zeros, and special
values at drawn places: any float32 or float16 (inf, NaN and subnormals included) and the
edges themselves (±65504, 2^-24, 2^-14, -0.0). The cell is shipped to the ranks, which
materialise the same M micro-batches each (verify/cells/inject.py), so shrinking never strands a
world. A non-finite value anywhere must make every rank skip the step, as the reference does.
"""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.precision import cast
from verify.cells.cell import Cell
from verify.cells.inject import FINITE_MAX, PLANS, GradientDraw, ParamModel, draw_for
from verify.checks.harness import run_cells
from verify.checks.report import merge
from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(600)

EDGES = [65504.0, -65504.0, 65503.99, 2.0**-24, 2.0**-14, -(2.0**-149), -0.0, 0.0]
special_value = st.one_of(
    st.floats(width=16),
    st.floats(width=32),
    st.sampled_from(EDGES + [math.inf, -math.inf, math.nan]),
).map(float.hex)


@st.composite
def injected_cells(draw, *, steps=2):
    n = draw(st.sampled_from([1, 2, 3, 4]))
    accumulation = draw(st.sampled_from([1, 2, 4]))
    lo = draw(st.integers(-150, 15))
    hi = draw(st.integers(lo, 15))
    specials = draw(
        st.lists(
            st.tuples(
                st.integers(0, steps - 1),
                st.integers(0, n * accumulation - 1),
                st.integers(0, 16),
                st.integers(0, 4000),
                special_value,
            ),
            max_size=5,
        )
    )
    gd = GradientDraw(
        seed=draw(st.integers(0, 2**16)),
        exponents=(lo, hi),
        zeros=draw(st.sampled_from([0.0, 0.3])),
        specials=tuple(specials),
    )
    return Cell(
        stage=draw(st.integers(0, 3)),
        world_size=n,
        precision=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        optimizer=draw(st.sampled_from(["sgd", "adam", "adamw"])),
        mode="deterministic",
        steps=steps,
        model=draw(st.sampled_from(["params-even", "params-uneven"])),
        accumulation=accumulation,
        clip_norm=draw(st.sampled_from([None, 0.5])),
        units=draw(st.sampled_from(["tiny", "huge"])),
        gradients="drawn",
        draw=gd,
        nonfinite="skip",
    )


def verdict(cell):
    per_rank = get_pool(cell.world_size).run(run_cells, [cell], timeout_s=300)
    return merge(cell, [r[0] for r in per_rank])


@settings(max_examples=max(10, settings().max_examples // 2))
@given(cell=injected_cells())
def test_drawn_gradients_give_the_reference_bits_on_every_rank(cell):
    row = verdict(cell)
    assert row["passed"], (row["first_mismatch"], cell)


@settings(max_examples=max(5, settings().max_examples // 4))
@given(cell=injected_cells(steps=3), poisoned=st.sampled_from([math.inf, -math.inf, math.nan]))
def test_one_nonfinite_value_on_one_rank_skips_the_step_everywhere(cell, poisoned):
    """The poisoned value sits on the last micro-batch, which only rank N-1 holds; step 1
    must be skipped by every rank (and by the reference), the other steps compared bitwise."""
    last = cell.micro_batches - 1
    special = (1, last, 0, 0, poisoned.hex())
    draw = GradientDraw(seed=cell.draw.seed, exponents=cell.draw.exponents, specials=(special,))
    cell = dataclasses.replace(cell, draw=draw)
    row = verdict(cell)
    assert row["passed"], (row["first_mismatch"], cell)
    assert row["skipped_steps"] >= 1


# -- the draws themselves (no ranks) -----------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_extreme_draws_reach_subnormals_and_the_fp16_maximum(precision):
    m = 8
    d = draw_for("extreme", precision, seed=3, world_size=4, micro_batches=m)
    model = ParamModel("uneven")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    names = sorted(shapes)
    grads = d.materialise(0, names, shapes, m, precision)
    values = np.concatenate([g[n].astype(np.float64).ravel() for g in grads for n in names])
    assert np.isfinite(values).all()
    finfo_min_normal = {"fp32": 2.0**-126, "bf16": 2.0**-126, "fp16": 2.0**-14}[precision]
    nonzero = np.abs(values[values != 0])
    assert (nonzero < finfo_min_normal).any(), "no subnormal drawn"
    top = float(cast(np.float64(FINITE_MAX["fp16"]), precision))  # 65504; 65536 in bf16
    assert (np.abs(values) == top).sum() >= 2, "the fp16 maximum is not among the values"
    assert np.abs(values).max() == top
    assert ((values == 0) & np.signbit(values)).any(), "no -0.0"


def test_nonfinite_draws_poison_one_rank_and_then_another():
    n, m = 3, 6
    d = draw_for("nonfinite", "bf16", seed=0, world_size=n, micro_batches=m)
    model = ParamModel("even")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    names = sorted(shapes)
    for step, micro_batch in ((0, m - 1), (2, 0)):
        grads = d.materialise(step, names, shapes, m, "bf16")
        bad = [
            j
            for j, g in enumerate(grads)
            if any(not np.isfinite(g[k].astype(np.float32)).all() for k in names)
        ]
        assert bad == [micro_batch]
    assert all(
        np.isfinite(g[k].astype(np.float32)).all()
        for g in d.materialise(1, names, shapes, m, "bf16")
        for k in names
    )


def test_uneven_plan_has_no_count_divisible_by_any_world_size():
    counts = [math.prod(s) for shapes in PLANS["uneven"].values() for s in shapes]
    assert all(c % n for c in counts for n in (2, 3, 4, 8))
    even = [math.prod(s) for shapes in PLANS["even"].values() for s in shapes]
    assert all(c % 24 == 0 for c in even)
