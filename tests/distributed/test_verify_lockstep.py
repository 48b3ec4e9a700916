"""Fast mode in lock-step (verify/checks/lockstep.py): every check reports its measured error
beside its
derived bound, and each check fails when an error of 10× its bound is injected ([Note:
non-vacuity]): the check is not vacuous."""

import functools

import pytest

from verify.cells.cell import Cell
from verify.checks import harness
from verify.checks.harness import run_cells
from verify.checks.lockstep import check_fast_step
from verify.checks.report import merge
from zero.ranks.local import get_pool

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

CHECKS = ("reduced", "master", "optimizer", "working")


def fast_cells():
    # M = 2N so that the reduced gradient's bound (2·γ_{M-1}·Σ|g_j|) is not zero
    return [
        Cell(
            stage=s,
            world_size=2,
            precision=p,
            optimizer="adam",
            mode="fast",
            model=mdl,
            gradients=g,
            nonfinite="skip",
            accumulation=2,
            steps=2,
        )
        for s, p, mdl, g in (
            (1, "fp32", "mlp", "backward"),
            (3, "bf16", "params-uneven", "random"),
            (2, "fp16", "params-even", "extreme"),
        )
    ]


def run_perturbed(rank, n, cells, check, factor):
    """The harness with `factor` × the bound added to one element of `check` on this rank."""
    patched = functools.partial(check_fast_step, perturb={check: factor})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "check_fast_step", patched)
        return run_cells(rank, n, cells)


def rows(check, factor):
    cells = fast_cells()
    per_rank = get_pool(2).run(run_perturbed, cells, check, factor)
    return [merge(c, [r[i] for r in per_rank]) for i, c in enumerate(cells)]


def test_fast_cells_pass_and_report_error_beside_bound():
    for row in rows("master", 0.0):
        assert row["passed"], row["first_mismatch"]
        assert set(row["errors"]) == set(CHECKS)
        for check, e in row["errors"].items():
            assert 0 <= e["error"] <= e["bound"], (check, e)
            assert e["ratio"] == (e["error"] / e["bound"] if e["bound"] else 0.0)


@pytest.mark.parametrize("check", CHECKS)
def test_ten_times_the_bound_fails(check):
    for row in rows(check, 10.0):
        assert not row["passed"], row["config"]
        # the original error is within the bound, so the perturbed one is at least 9 bounds
        assert row["bound_ratio"][check] >= 9.0, row["bound_ratio"]
        assert "bound exceeded" in row["first_mismatch"]
