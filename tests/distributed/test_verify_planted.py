"""The harness has teeth: deliberately broken engines must be reported failing.

The bugs, their patches and where each is observable live in verify/planted/suite.py (BUGS: the base
bugs' table and each feature's record, verify/features/); this file runs them. Each bug is
planted by patching the library inside the worker function (undone when the cells are done) and
run on the --quick cells (or --resume rows) where it is observable. Every such cell must fail by
the check the bug names (a row that failed only by another check, or only by raising, is a
miss); the same cells pass unpatched in the --quick run
(tests/distributed/test_verify_cli.py). The fast tier runs the two cheapest observable cells per
bug; the release tier runs every observable cell, which also checks the predicates
(`python -m verify.planted` is the same run as a command, with its table).
"""

import pytest

from verify.cells.observable import OBSERVABLE
from verify.planted import BUGS, by_its_check, checks_of, cost, observable, run_bug

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def test_every_bug_has_a_predicate_and_the_quick_preset_a_cell_for_it():
    cells = {name for name, b in BUGS.items() if b.kind == "cells"}
    assert cells == set(OBSERVABLE)
    assert len(BUGS) >= 25
    for bug in BUGS:
        assert observable(bug), f"--quick (or --resume) has no cell where {bug} is observable"


@pytest.mark.parametrize("bug", list(BUGS))
def test_quick_cells_catch_the_planted_bug(bug):
    rows = run_bug(bug, sorted(observable(bug), key=cost)[:2])
    assert rows and all(by_its_check(BUGS[bug], r) for r in rows), [
        (r["config"], BUGS[bug].check, checks_of(r), r["first_mismatch"])
        for r in rows
        if not by_its_check(BUGS[bug], r)
    ]


@pytest.mark.full
@pytest.mark.parametrize("bug", list(BUGS))
def test_every_observable_quick_cell_catches_the_planted_bug(bug):
    rows = run_bug(bug, observable(bug))
    assert all(by_its_check(BUGS[bug], r) for r in rows), [
        (r["config"], BUGS[bug].check, checks_of(r), r["first_mismatch"])
        for r in rows
        if not by_its_check(BUGS[bug], r)
    ]
