"""Reports (verify/checks/report.py): rows merged from per-rank verdicts, JSON-safe values, Markdown
tables and the per-precision heatmap, on made-up verdicts (no ranks)."""

import json
import math

import matplotlib
import pytest

from verify.cells.cell import Cell
from verify.checks.report import failed_rows, heatmap, markdown, merge, sanitize

matplotlib.use("Agg")


def verdict(rank, passed=True, **kw):
    return {
        "rank": rank,
        "bitwise": passed,
        "max_abs_diff": 0.0,
        "max_ulp": 0,
        "first": "" if passed else "step 1: unit 0 (root) master",
        "skipped_steps": 0,
        "clipped_steps": 2,
        "ratios": {},
        "errors": {},
        "passed": passed,
        **kw,
    }


def cell(**kw):
    base = dict(stage=2, world_size=2, precision="bf16", optimizer="adam", mode="deterministic")
    return Cell(**{**base, **kw})


def test_a_cell_fails_when_any_rank_fails_and_names_it():
    row = merge(cell(), [verdict(0), verdict(1, passed=False)])
    assert row["passed"] is False and row["bitwise"] is False
    assert row["first_mismatch"] == "rank 1: step 1: unit 0 (root) master"
    assert row["config"]["world_size"] == 2 and row["config"]["micro_batches"] == 4
    assert merge(cell(), [verdict(0), verdict(1)])["passed"] is True


def test_fast_rows_keep_the_worst_rank_error_beside_its_bound():
    fast = cell(mode="fast")
    a = verdict(0, ratios={"master": 0.2}, errors={"master": (1e-8, 5e-8)})
    b = verdict(1, ratios={"master": 0.5}, errors={"master": (2e-8, 4e-8)})
    row = merge(fast, [a, b])
    assert row["bitwise"] is None
    assert row["errors"]["master"] == {"error": 2e-8, "bound": 4e-8, "ratio": 0.5}
    assert row["bound_ratio"] == {"master": 0.5}


def test_sanitize_makes_strict_json():
    raw = {"a": [math.inf, -math.inf, math.nan, 1.5], "b": {"c": float("nan")}}
    text = json.dumps(sanitize(raw), allow_nan=False)
    assert json.loads(text) == {"a": ["inf", "-inf", "nan", 1.5], "b": {"c": "nan"}}


def test_failed_world_marks_every_cell():
    rows = failed_rows([cell(), cell(stage=3)], "world N=2 failed: TimeoutError")
    assert [r["passed"] for r in rows] == [False, False]
    assert all("TimeoutError" in r["first_mismatch"] for r in rows)


def test_markdown_has_a_table_per_section():
    good, bad = merge(cell(), [verdict(0), verdict(1)]), merge(cell(), [verdict(0, False)])
    inj = merge(cell(gradients="random", model="params-even", nonfinite="skip"), [verdict(0)])
    inv = [
        {
            "stage": s,
            "precision": "bf16",
            "optimizer": "adamw",
            "world_size": n,
            "steps": 3,
            "passed": (s, n) != (1, 4),
            "first_difference": None if (s, n) != (1, 4) else 2,
        }
        for s in (0, 1)
        for n in (1, 4)
    ]
    text = markdown({"cells": [good, bad], "injected": [inj], "world_size_invariance": inv})
    assert "- cells: 1/2 passed" in text and "- injected: 1/1 passed" in text
    assert "- world_size_invariance: 3/4 passed" in text
    assert "**FAIL** rank 0: step 1" in text
    assert "| 1 | bf16 | adamw | 3 | ✓ | ✗ (step 2) |" in text


@pytest.mark.parametrize("precisions", [("fp32", "bf16", "fp16"), ("fp16",)])
def test_heatmap_has_a_labelled_panel_per_precision(precisions):
    import matplotlib.pyplot as plt

    rows = [
        merge(cell(stage=s, world_size=n, precision=p), [verdict(0, passed=(s, n) != (3, 4))])
        for p in precisions
        for s in (0, 3)
        for n in (1, 2, 4)
    ]
    fig = heatmap(rows)
    try:
        panels = [ax for ax in fig.axes if ax.get_title() in precisions]
        assert [ax.get_title() for ax in panels] == list(precisions)
        assert panels[0].get_ylabel() == "ZeRO stage"
        for ax in panels:
            assert ax.get_xlabel() == "world size N"
            data = ax.images[0].get_array()
            assert data.shape == (2, 3)
            assert data[1, 2] == 0.0 and data[0, 0] == 1.0  # stage 3 at N = 4 failed
            assert "0/1" in [t.get_text() for t in ax.texts]
    finally:
        plt.close(fig)


def test_baseline_matches_cells_across_a_newer_cell_field_only_at_its_default(tmp_path):
    """A report written before a Cell field existed still matches the cells that hold the
    field's default; a cell that sets it is new, never compared; a changed digest is flagged."""
    from verify.__main__ import compare_baseline

    cell = Cell(stage=1, world_size=2, precision="fp32", optimizer="sgd", mode="deterministic")
    old_config = {k: v for k, v in cell.as_dict().items() if k != "loss_scale"}
    (tmp_path / "old.json").write_text(
        json.dumps({"cells": [{"config": old_config, "digest": "a" * 32}]})
    )
    row = failed_rows([cell], "a row as the report writes it")[0]
    same = {**row, "digest": "a" * 32}
    newer = {**row, "config": {**cell.as_dict(), "loss_scale": 0.5}, "digest": "b" * 32}
    said = []
    assert compare_baseline(str(tmp_path / "old.json"), [same, newer], said.append) == []
    assert "records no CPU kernels" in said[0]  # an old report: compared, with a warning
    assert "1/1 common cells end in the same digest (1 cells only here)" in said[1]
    moved = {**same, "digest": "c" * 32}
    assert compare_baseline(str(tmp_path / "old.json"), [moved], said.append) == [moved]


def test_cpu_kernels_follow_the_onednn_cap_and_never_exceed_the_cpu(monkeypatch):
    """The kernel record's oneDNN rung is the CPU's best capped by ONEDNN_MAX_CPU_ISA, and
    kernel_caps turns a record back into the environment that caps a stronger CPU to it."""
    import torch

    from zero.common import results

    best = results._cpu_isa()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert results.cpu_kernels() == {
        "aten": torch.backends.cpu.get_cpu_capability(),
        "onednn": best,
    }
    for cap, rung in (("AVX2", "AVX2"), ("avx512_core_bf16", "AVX512_BF16"), ("SSE41", "DEFAULT")):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        lower = min(best, rung, key=results.ISA_LADDER.index)  # a cap never raises the CPU's rung
        assert results.cpu_kernels()["onednn"] == lower
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert results.cpu_kernels()["onednn"] == best
    for rung in results.ISA_LADDER:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", results.ONEDNN_CAP[rung])
        assert results.cpu_kernels()["onednn"] == min(best, rung, key=results.ISA_LADDER.index)
    caps = results.kernel_caps({"aten": "AVX2", "onednn": "AVX2"})
    assert caps == "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"
