"""World-size invariance (verify/cells/invariance.py): the table's logic on made-up digests, and on
real ranks that a different summation order at one world size breaks it."""

import pytest

from verify.cells import invariance
from zero import collectives
from zero.ranks.local import get_pool

RUNS = [
    {"stage": 0, "precision": "fp32", "optimizer": "adamw"},
    {"stage": 2, "precision": "fp32", "optimizer": "adamw"},
]


def test_table_passes_only_identical_digests():
    same = [["a", "b", "c"], ["a", "b", "c"]]  # per run: digests after each step
    per_n = {1: [same], 2: [same, same], 4: [same] * 4}
    rows = invariance.table(RUNS, per_n)
    assert len(rows) == 6 and all(r["passed"] for r in rows)

    late = [["a", "b", "c"], ["a", "b", "X"]]  # stage 2 differs at step 2 at N = 4
    rows = invariance.table(RUNS, {1: [same], 4: [late] * 4})
    bad = [r for r in rows if not r["passed"]]
    assert [(r["stage"], r["world_size"], r["first_difference"]) for r in bad] == [(2, 4, 2)]
    assert bad[0]["same_as_stage0"] is False

    split = {1: [same], 2: [same, late]}  # rank 1 disagrees with rank 0
    rows = invariance.table(RUNS, split)
    assert [r["ranks_agree"] for r in rows] == [True, True, True, False]
    assert [r["passed"] for r in rows] == [True, True, True, False]

    stages = {1: [[["a"], ["b"]]]}  # every N agrees, but stage 2 is not stage 0's run
    rows = invariance.table(RUNS, stages)
    assert [r["passed"] for r in rows] == [True, False]


def test_world_sizes_are_the_powers_of_two_dividing_m():
    assert invariance.world_sizes_for(RUNS) == [1, 2, 4, 8]
    assert invariance.world_sizes_for([{**RUNS[0], "micro_batches": 4}]) == [1, 2, 4]
    with pytest.raises(ValueError, match="micro_batches"):
        invariance.cell_for({**RUNS[0], "micro_batches": 6}, 4)


def digests_in_ring_order(rank, n, runs):
    """A broken engine: the deterministic reduce-scatter sums in ring order, not by T."""

    def ring(xs):
        acc = xs[(rank + 1) % n]
        for i in range(2, n + 1):
            acc = acc + xs[(rank + i) % n]
        return acc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(collectives, "tree_sum", ring)
        return invariance.run_digests(rank, n, runs)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_invariance_holds_and_a_ring_order_at_n4_breaks_it():
    runs = [{**r, "steps": 2} for r in RUNS]
    per_n = {n: get_pool(n).run(invariance.run_digests, runs) for n in (1, 2, 4)}
    assert all(r["passed"] for r in invariance.table(runs, per_n))
    per_n[4] = get_pool(4).run(digests_in_ring_order, runs)
    rows = invariance.table(runs, per_n)
    assert [(r["world_size"], r["passed"]) for r in rows if r["stage"] == 2] == [
        (1, True),
        (2, True),
        (4, False),
    ]
    assert next(r for r in rows if r["world_size"] == 4)["first_difference"] == 0
