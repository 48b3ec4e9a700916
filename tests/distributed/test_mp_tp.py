"""Tensor parallelism (zero/mp) on gloo ranks against the N_m = 1 GPT (docs/design.md §6).

Lock-step over operators (verify/mp/lockstep.py, for the reason docs/design.md §6 gives: a
difference of one rounding changes every later rounding, so whole models have no derivable
bound): each MP rank runs its slice of every split operator on the N_m = 1 model's real input
and output gradient. Outputs and input gradients must lie within verify/mp/bounds.py's derived
bound, weight gradients must be the exact slices (bitwise), and a planted error (a missing sum,
a sum scaled by 1/N_m, a row-parallel bias added on every rank) must fail.
"""

import pytest

from verify.mp.lockstep import CHECKS, LockCell, run_section

pytestmark = pytest.mark.timeout(600)


def check_lockstep(n, deterministic):
    (r,) = run_section([LockCell(mp=n, deterministic=deterministic)], say=lambda *a: None)
    assert "error" not in r.get("first_failure", ""), r
    # every ratio is error / derived bound (verify/mp/bounds.py, docs/design.md §6): <= 1
    for key in CHECKS:
        assert r["ratios"][key] <= 1.0, (key, r["ratios"][key])
    assert r["passed"], r["first_failure"]
    return r


@pytest.mark.dist
@pytest.mark.parametrize("deterministic", [True, False])
def test_tp_operators_within_the_derived_bound_at_2(deterministic):
    check_lockstep(2, deterministic)


@pytest.mark.dist
@pytest.mark.full
@pytest.mark.parametrize("deterministic", [True, False])
def test_tp_operators_within_the_derived_bound_at_4(deterministic):
    check_lockstep(4, deterministic)


@pytest.mark.dist
@pytest.mark.parametrize("plant", ["no_sum", "mean"])
def test_a_planted_error_fails_the_bound(plant):
    """A missing g/f sum or one scaled by 1/N_m must break the forward and backward bounds
    by far (ratio > 10), and the cell must fail."""
    (r,) = run_section([LockCell(mp=2, plant=plant)], say=lambda *a: None)
    assert not r["passed"]
    assert r["ratios"]["row_fwd"] > 10 and r["ratios"]["col_dx"] > 10, r["ratios"]


@pytest.mark.dist
def test_a_bias_added_on_every_rank_fails_the_forward_bound():
    """The row-parallel bias added before g's sum, on each MP rank (N_m·b): only the
    row-parallel forward moves, by (N_m - 1)·|b|, far outside its bound on the redrawn values
    (mp_lockstep.redraw; on the GPT's own zero biases the same plant passed)."""
    (r,) = run_section([LockCell(mp=2, plant="bias_every_rank")], say=lambda *a: None)
    assert not r["passed"] and r["ratios"]["row_fwd"] > 10, r["ratios"]
    assert all(v <= 1 for k, v in r["ratios"].items() if k != "row_fwd"), r["ratios"]


@pytest.mark.dist
def test_the_real_sum_is_back_after_a_plant():
    """Pool workers outlive a cell: after a planted cell the next one runs the real code."""
    run_section([LockCell(mp=2, plant="no_sum")], say=lambda *a: None)
    check_lockstep(2, True)
