"""Parity with plain PyTorch (verify/parity/section.py): the quick cells pass for every family, with
steps that clip and steps that do not; deterministic cells give one digest over N and stage; and
every check fails where it must: planted semantics bugs in two or more families, and an error
of 10× each bound ([Note: non-vacuity] in verify/checks/lockstep.py)."""

import importlib.util
import math

import pytest
import torch

from verify.parity import section as parity
from verify.parity.section import FAMILIES, Family, ParityCell, run_section

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def quick(quick_report):
    """The parity section of the session's --quick run (tests/distributed/conftest.py)."""
    data = quick_report["data"]
    return data["parity"], data["parity_invariance"]


def test_quick_parity_cells_pass_for_every_family(quick):
    rows, inv = quick
    assert {r["config"]["family"] for r in rows} == set(FAMILIES)
    for r in rows:
        assert r["passed"], (r["config"], r["first_failure"])
        if r.get("skipped"):  # only a family whose requirement is missing
            assert not HAS_TRANSFORMERS and "transformers" in r["skipped"], r
            continue
        assert len(r["clipped"]) == r["config"]["steps"]
        # not vacuous: the bounds are close to what is measured somewhere in every cell
        assert max(r["worst"][k] for k in ("master", "exp_avg", "exp_avg_sq")) > 1e-3, r
    ran = {r["config"]["family"] for r in rows if not r.get("skipped")}
    # per family, one cell with steps that clip and steps that do not
    for family in ran:
        mine = [r["clipped"] for r in rows if r["config"]["family"] == family]
        assert any(any(c) and not all(c) for c in mine), (family, mine)
    # deterministic mode: one digest at N = 1 and 2 and at stages 0 and 1, per family
    assert {r["family"] for r in inv} == ran
    for r in inv:
        assert r["passed"] and r["world_sizes"] == [1, 2] and r["stages"] == [0, 1], r


def test_quick_parity_covers_the_buffers_of_batchnorm(quick):
    rows, _ = quick
    resnet = [r for r in rows if r["config"]["family"] == "resnet"]
    assert resnet and all(r["worst"]["buffers"] == 0.0 for r in resnet)


@pytest.mark.parametrize("plant", parity.PLANTS)
def test_planted_semantics_bugs_fail_in_two_families(plant):
    """Adam's coupled L2 decay in place of AdamW's decoupled decay, and micro-batch losses not
    divided by M, each planted in the plain side, must fail the parity checks."""
    cells = [
        ParityCell(family=f, stage=1, world_size=2, plant=plant, steps=2) for f in ("mlp", "gpt")
    ]
    rows, _ = run_section(cells, say=lambda *a: None)
    for r in rows:
        assert not r["passed"], (plant, r["config"]["family"], r["worst"])
    if plant == "no_mean":  # the gradient M times too large: the norm is off by far more
        assert all(r["worst"]["norm"] > 1e3 for r in rows), [r["worst"] for r in rows]
    else:  # the decay moves the parameters and moments, not the gradient's norm
        assert all(r["worst"]["master"] > 10 for r in rows), [r["worst"] for r in rows]


def test_every_check_fails_at_ten_times_its_bound():
    cells = [
        ParityCell(family=f, stage=s, world_size=2, mode=m, perturb=10.0, steps=1)
        for f, s, m in (("resnet", 3, "fast"), ("mlp", 0, "deterministic"))
    ]
    rows, _ = run_section(cells, say=lambda *a: None)
    for r in rows:
        assert not r["passed"]
        for k in ("loss", "norm", "master", "exp_avg", "exp_avg_sq"):
            assert r["worst"][k] >= 9, (r["config"]["family"], k, r["worst"])
    assert rows[0]["worst"]["buffers"] == math.inf  # one ulp in a BatchNorm statistic


def test_a_family_is_one_entry_and_a_missing_requirement_skips_it(monkeypatch):
    extra = Family(
        build=FAMILIES["mlp"].build,
        batch=FAMILIES["mlp"].batch,
        clip_norm=1.5,
        requires=("no_such_module_for_parity",),
    )
    monkeypatch.setitem(FAMILIES, "extra", extra)
    cells = [c for c in parity.quick_cells() if c.family == "extra"]
    assert len(cells) == 3 and len([c for c in parity.complete_cells() if c.family == "extra"])
    rows, inv = run_section(cells, say=lambda *a: None)
    assert all(r["skipped"] == "no_such_module_for_parity is not installed "
               "(pip install -e '.[models]')" for r in rows)  # fmt: skip
    assert inv == []


def test_bad_cells_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="family='nope'"):
        ParityCell(family="nope", stage=0, world_size=1)
    with pytest.raises(ValueError, match="world_size=3"):
        ParityCell(family="mlp", stage=0, world_size=3)
    with pytest.raises(ValueError, match="precision='fp16'"):
        ParityCell(family="mlp", stage=0, world_size=1, precision="fp16")
    with pytest.raises(ValueError, match="plant='x'"):
        ParityCell(family="mlp", stage=0, world_size=1, plant="x")


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_hf_curve_writes_both_curves_and_their_difference(tmp_path):
    """python -m paper_figures.hf_curve, a few steps: the record holds both curves, their
    first losses are equal bit for bit (the same bits and data; the float64 mean of M float32
    losses of similar size is exact in any order), and its max |Δloss| is the one recomputed."""
    from paper_figures.hf_curve import main

    out, fig = tmp_path / "curve.json", tmp_path / "curve.png"
    argv = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--json", str(out)]
    record = main([*argv, "--figure", str(fig)])
    r = record["result"]
    assert record["kind"] == "hf_curve.run" and "provenance" in record
    assert len(r["engine_losses"]) == len(r["plain_losses"]) == 3
    assert r["engine_losses"][0] == r["plain_losses"][0]
    diffs = [abs(a - b) for a, b in zip(r["engine_losses"], r["plain_losses"])]
    assert r["max_abs_diff"] == max(diffs)
    assert "location" not in record["config"]["corpus"]  # no machine path in the record
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_runs_the_parity_section_alone(tmp_path, capsys):
    """python -m verify --parity: only the parity section (here its N = 1 cells), in the JSON
    and Markdown reports, exit status 0."""
    import json

    from verify.__main__ import main

    out, md = tmp_path / "p.json", tmp_path / "p.md"
    argv = ["--parity", "--world-sizes", "1", "--json", str(out), "--markdown", str(md)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["cells"] == [] and data["world_size_invariance"] == []
    assert {r["config"]["world_size"] for r in data["parity"]} == {1}
    assert {r["config"]["family"] for r in data["parity"]} == set(FAMILIES)
    assert len(data["parity_invariance"]) == len(FAMILIES) - (0 if HAS_TRANSFORMERS else 2)
    assert "## Parity with plain PyTorch" in md.read_text()
    assert "cells passed in" not in capsys.readouterr().out


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_the_hugging_face_leg_passes_and_sees_a_value_the_import_moved(monkeypatch):
    """verify/parity/hf_leg.py: a GPT-2 cell's export reads back as the master in transformers
    and in a fresh engine (hf is ''); an import that moves one master element by 1 is named."""
    from zero.checkpoint import hfread
    from zero.ranks.local import spawn

    cell = ParityCell(family="gpt2", stage=3, world_size=2, steps=1)
    assert [r["hf"] for r in spawn(parity.run_cell, 2, cell, timeout_s=300)] == ["", ""]
    real = hfread._fill

    def fill(engine, u, source, where, *, master):
        out = real(engine, u, source, where, master=master)
        if master and engine.rank == 0 and not u.name:
            with torch.no_grad():
                u.master.view(-1)[0] += 1  # the root's first element: wte's first value
        return out

    monkeypatch.setattr(hfread, "_fill", fill)
    said = [r["hf"] for r in spawn(parity.run_cell, 2, cell, timeout_s=300)]
    assert all(s.startswith("hf: init_from_hf: ") for s in said), said
