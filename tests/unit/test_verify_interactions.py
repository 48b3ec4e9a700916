"""verify/cells/interactions.py: every feature pair is run by the --quick plan (the GPU's by a test
of
tests/gpu), each pair's planted bug is a bug verify.planted knows with a --quick cell to show it,
and verify.checks.expect.expected_released states the release_grads contract by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verify import planted
from verify.cells import interactions, matrix
from verify.cells.interactions import PAIRS, Pair, covering
from verify.cells.observable import OBSERVABLE
from verify.checkpoints.resume import resume_cases
from verify.checks.expect import expected_released
from verify.faults import watchdog_cells
from verify.mp.cells import quick_cells as mp_quick_cells

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def quick_plans() -> dict[str, list]:
    from verify.mp import resume as mp_resume

    return {
        "cells": matrix.quick()[0],
        "resume": resume_cases(quick=True),
        "mp": list(mp_quick_cells()) + list(mp_resume.row_names()),
        "watchdog": list(watchdog_cells.CELLS),
        "gpu": [t for t in interactions.GPU_TESTS if (ROOT / t).is_file()],
    }


def test_every_pair_is_covered_by_the_quick_plan():
    missing = [p.features for p, idx in covering(PAIRS, quick_plans()) if not idx]
    assert missing == []


def test_a_pair_no_plan_covers_is_reported():
    planted_pair = Pair("dropout × fp16", "masks in half precision", "cells",
                        lambda c: c.model == "gpt-dropout" and c.precision == "fp16")  # fmt: skip
    ((pair, idx),) = covering([planted_pair], quick_plans())
    assert idx == []
    lines = interactions.lines({"cells": matrix.quick()[0]})
    assert lines[0] == "per feature pair (interactions):"
    assert len(lines) == 1 + len(PAIRS)
    assert any("NOT COVERED" not in x and "dropout × N >= 2" in x for x in lines)


def test_every_place_is_known_and_every_pair_named_once():
    assert {p.where for p in PAIRS} <= {"cells", "resume", "mp", "watchdog", "gpu"}
    names = [p.features for p in PAIRS]
    assert len(names) == len(set(names))


def test_each_pairs_bug_is_planted_and_observable_on_a_quick_cell():
    cells = matrix.quick()[0]
    for name, pred in interactions.OBSERVABLE.items():
        assert name in planted.BUGS, name
        assert OBSERVABLE[name] is pred
        assert any(pred(c) for c in cells), name


def test_the_interaction_cells_are_in_both_presets():
    quick, complete = matrix.quick()[0], matrix.complete()[0]
    for c in interactions.CELLS:
        assert c in quick and c in complete


def _config(**kw):
    base = dict(release_grads=True, contiguous_memory=False, offload_optimizer=False, stage=1,
                persist_below=0)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


SPEC = SimpleNamespace(layouts=[SimpleNamespace(numel=816), SimpleNamespace(numel=2352)])


@pytest.mark.parametrize(
    "kw, device, want",
    [
        (dict(release_grads=None), "cpu", [False, False]),  # None: on CUDA only
        (dict(release_grads=None), "cuda", [True, True]),
        (dict(release_grads=False), "cuda", [False, False]),
        (dict(), "cpu", [True, True]),
        (dict(contiguous_memory=True), "cpu", [False, False]),  # arena views stay
        (dict(offload_optimizer=True, stage=1), "cpu", [True, True]),  # the device buffer goes
        (dict(offload_optimizer=True, stage=2), "cpu", [False, False]),  # host shards stay
        # stage 3's persistent unit (816 <= 1000) is stage 0's: its device buffer goes
        (dict(offload_optimizer=True, stage=3, persist_below=1000), "cpu", [True, False]),
    ],
)
def test_expected_released_states_the_contract(kw, device, want):
    assert expected_released(_config(**kw), SPEC, device) == want
