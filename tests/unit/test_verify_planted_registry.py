"""The planted-bug registry (verify/planted/suite.py): its size, its predicates, its table.

Every bug must have a predicate and at least one --quick cell (or --resume quick row) where it is
observable; the table in docs/verification.md must list exactly the registry's bugs with their
one-line descriptions. Patches must undo themselves. Running the bugs is
tests/distributed/test_verify_planted.py's job.
"""

import re
from pathlib import Path

import pytest

from verify.cells import matrix
from verify.cells.observable import OBSERVABLE
from verify.features import CHECKS, RESUME_CHECKS
from verify.planted import BUGS, Patch, markdown, observable

ROOT = Path(__file__).resolve().parents[2]


def test_at_least_25_bugs_each_with_a_predicate_and_an_observable_cell():
    assert len(BUGS) >= 25
    cells = {name for name, b in BUGS.items() if b.kind == "cells"}
    assert cells == set(OBSERVABLE)
    for name, bug in BUGS.items():  # a check it names, among those its kind has
        assert bug.check in (RESUME_CHECKS if bug.kind == "resume" else CHECKS), name
    quick = matrix.quick()[0]
    for name in BUGS:
        assert observable(name, quick=quick), f"no --quick cell or --resume row shows {name}"


def test_the_persist_threshold_bug_is_observable_only_through_the_gap_cell():
    """A bug that --quick could not catch is a gap in the preset: PLANTED_GAPS fills it."""
    quick = [c for c in matrix.quick()[0] if c not in matrix.PLANTED_GAPS]
    assert not [c for c in quick if OBSERVABLE["persist_threshold_off_by_one"](c)]
    assert all(OBSERVABLE["persist_threshold_off_by_one"](c) for c in matrix.PLANTED_GAPS)


def test_the_docs_table_lists_exactly_the_registry():
    text = (ROOT / "docs" / "verification.md").read_text()
    section = text.split("## Planted bugs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.M)
    assert [name for name, _ in rows] == list(BUGS)
    for name, breaks in rows:
        assert breaks.strip() == BUGS[name].breaks, name


def test_every_plant_is_undone():
    """Planting and undoing leaves every attribute it touched as it was."""
    import sys

    def snapshot():
        mods = [m for k, m in sys.modules.items() if k.split(".")[0] in ("zero", "reference")]
        out = {}
        for m in mods:
            for k, v in vars(m).items():
                out[(m.__name__, k)] = v
                if isinstance(v, type):
                    out.update({(m.__name__, k, a): x for a, x in vars(v).items()})
        return out

    before = snapshot()
    for name, bug in BUGS.items():
        with Patch() as p:
            bug.plant(p)
        after = snapshot()
        changed = [k for k in before if after.get(k, None) is not before[k]]
        assert not changed, (name, changed[:3])


def test_patch_restores_and_removes():
    class A:
        x = 1

    class B(A):
        pass

    with Patch() as p:
        p.setattr(B, "x", 2)
        p.setattr(A, "y", 3)
        assert B.x == 2 and A.y == 3
    assert B.x == 1 and "x" not in vars(B) and not hasattr(A, "y")


@pytest.mark.parametrize("ran", [2, 5])
def test_markdown_says_when_fewer_cells_ran_than_are_observable(ran):
    row = {"bug": "one_ulp", "breaks": "x", "kind": "cells", "observable": 5, "ran": ran,
           "caught": ran, "first_check": "state", "check": "state"}  # fmt: skip
    line = markdown([row]).splitlines()[-1]
    assert ("run (5 observable" in line) == (ran != 5)


def test_a_bug_caught_only_by_another_check_is_a_miss():
    """The suite counts a row as caught only where the bug's named check failed."""
    from verify.planted import by_its_check

    bug = BUGS["stale_prefetch"]  # must fail "traffic"
    assert by_its_check(bug, {"passed": False, "checks": ["traffic", "state"]})
    assert not by_its_check(bug, {"passed": False, "checks": ["state"]})
    assert not by_its_check(bug, {"passed": False, "checks": ["raised"]})
    state = BUGS["one_ulp"]  # must fail "state": the bounds in a fast cell
    fast, det = {"config": {"mode": "fast"}}, {"config": {"mode": "deterministic"}}
    assert by_its_check(state, {**fast, "passed": False, "checks": ["bound"]})
    assert by_its_check(state, {**fast, "passed": False, "checks": ["state"]})
    assert not by_its_check(state, {**det, "passed": False, "checks": ["bound"]})


def test_a_bug_that_names_raising_must_say_why():
    from verify.features import Bug

    with pytest.raises(ValueError, match="why_raise"):
        Bug(name="x", breaks="x", where="x", plant=None, observable=None, check="raised")
    with pytest.raises(ValueError, match="check='memo'"):
        Bug(name="x", breaks="x", where="x", plant=None, observable=None, check="memo")
