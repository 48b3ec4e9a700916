"""verify's model-parallel section (verify/mp/cells.py): its quick cells pass with clipping
active on every step, one digest per MP index over N_d, stages and P_a on/off; and planted
engine bugs fail their cells: the replicated parameters counted in the norm on every MP rank,
P_a's gather assembling the MP ranks' parts in the wrong order, and every row-parallel output
scaled by 1.0001 on every MP rank (the TP layers wrong but self-consistent: the reference
gradients come from the plain GPT, not zero/mp, so the engine no longer moves with them)."""

import pytest

from verify.mp import cells as mp_cells
from verify.mp.cells import MPCell, run_section

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_quick_mp_section_passes(quick_report):
    """The MP section of the session's --quick run (tests/distributed/conftest.py)."""
    rows, inv = quick_report["data"]["mp"], quick_report["data"]["mp_invariance"]
    assert len(rows) == len(mp_cells.quick_cells())
    for r in rows:
        assert r["passed"], (r["label"], r["first_failure"])
        assert len(r["clipped"]) == r["config"]["steps"], r["label"]
        if r["config"]["precision"] == "fp16":  # the first step overflows (skip, no norm)
            assert r["clipped"] == [False, True] and r["norms"][0] is None, r
        else:
            assert all(r["clipped"]), r["label"]
    meshes = {(r["config"]["dp"], r["config"]["mp"]) for r in rows}
    assert meshes == {(1, 2), (2, 2), (2, 1)}
    assert {r["config"]["p_a"] for r in rows} == {"off", "on", "cpu"}
    assert {x for r in rows for x in r["config"]["extra"]} == set(mp_cells.EXTRAS)
    by = {(r["mp"], r["precision"]): r for r in inv}
    assert all(r["passed"] for r in inv), inv
    # N_m = 2 fp32: one digest per m over N_d 1 and 2, stages 0-3 and P_a on and off
    assert by[(2, "fp32")]["dp"] == [1, 2] and by[(2, "fp32")]["stages"] == [0, 1, 3]
    assert by[(1, "fp32")]["stages"] == [0, 2, 3] and by[(2, "bf16")]["dp"] == [1, 2]
    assert by[(2, "fp16")]["dp"] == [1, 2]
    # the slices differ: two MP indices, two digest sequences
    two = next(r for r in rows if r["config"]["mp"] == 2)
    assert len(two["digests"]) == 2 and two["digests"][0] != two["digests"][1]


@pytest.mark.parametrize(
    "cell, why",
    [
        (MPCell(dp=1, mp=2, stage=1, steps=1, plant="double"), "global norm"),
        (MPCell(dp=2, mp=2, stage=3, steps=1, p_a="on", plant="p_a_order"), ""),
        (MPCell(dp=1, mp=2, stage=0, steps=1, plant="tp_scale"), "step 0: loss"),
        (MPCell(dp=2, mp=1, stage=3, steps=1, plant="tp_scale"), "step 0: loss"),
    ],
)
def test_planted_bug_fails_the_cell(cell, why):
    (r,), _ = run_section([cell], say=lambda *a: None)
    assert not r["passed"]
    assert why in r["first_failure"], r["first_failure"]


def test_mp_flag_runs_only_this_section(capsys):
    from verify.__main__ import main

    assert main(["--mp", "--list"]) == 0
    out = capsys.readouterr().out
    assert f"mp: {len(mp_cells.quick_cells())} cells" in out and "parity" not in out
    assert main(["--quick", "--no-mp", "--list"]) == 0
    assert "mp:" not in capsys.readouterr().out


@pytest.mark.full
@pytest.mark.timeout(300)
def test_under_torchrun_the_mesh_is_the_launched_world(tmp_path):
    """The same mesh code under `torchrun --nproc-per-node 4`: the cells whose N_d·N_m is the
    launched world run (the (2, 2) ones) and pass; the others are skipped by name."""
    import json

    from tests.helpers.torchrun import torchrun

    out = tmp_path / "v.json"
    done = torchrun("verify", ["--mp", "--world-sizes", "4", "--json", str(out)], nproc=4)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["mp"]
    want = [c for c in mp_cells.quick_cells() if c.world_size == 4]
    assert [r["label"] for r in rows] == [c.label for c in want]
    assert all(r["passed"] for r in rows), [r["first_failure"] for r in rows]
