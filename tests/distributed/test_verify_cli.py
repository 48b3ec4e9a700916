"""python -m verify as users run it: locally spawned ranks, and under torchrun."""

import json
import re
from pathlib import Path

import pytest
from torchrun import torchrun

from verify.__main__ import main
from verify.cells import matrix
from verify.cells.cell import Cell
from verify.cells.observable import OBSERVABLE
from verify.mp import cells as mp_cells
from verify.mp import lockstep as mp_lockstep
from verify.parity import section as parity

REPO = Path(__file__).resolve().parents[2]
KEYS = {
    "stage",
    "world_size",
    "precision",
    "optimizer",
    "mode",
    "steps",
    "bitwise",
    "max_abs_diff",
    "max_ulp",
    "tolerance",
    "passed",
    "config",
}


@pytest.mark.dist
def test_cli_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "v.json"
    argv = [
        "--stages",
        "1",
        "--world-sizes",
        "2",
        "--precisions",
        "bf16",
        "--optimizers",
        "adam",
        "--models",
        "mlp",
        "--steps",
        "2",
        "--mode",
        "both",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert len(data["cells"]) == 2 and {"git_commit", "torch"} <= set(data["provenance"])
    for cell in data["cells"]:
        assert KEYS <= set(cell) and cell["passed"]
        assert cell["config"]["stage"] == 1 and cell["config"]["world_size"] == 2
    det, fast = data["cells"]
    assert det["bitwise"] is True and fast["bitwise"] is None
    assert 0 < max(fast["bound_ratio"].values()) <= 1
    # the fast row prints the worst check's measured error beside its bound
    worst = max(fast["errors"].values(), key=lambda e: e["ratio"])
    assert 0 < worst["error"] <= worst["bound"]
    out = capsys.readouterr().out
    assert "2/2 cells passed" in out
    assert f"{worst['error']:.2e}/{worst['bound']:.2e}" in out


@pytest.mark.dist
def test_baseline_flags_a_cell_whose_final_digest_changed(tmp_path, capsys):
    """--baseline compares each cell's end-state digest with an earlier report: the same code
    passes; a report whose digest for one cell was changed makes the run fail naming it."""
    base = tmp_path / "base.json"
    argv = ["--stages", "0", "2", "--world-sizes", "2", "--precisions", "fp32"]
    argv += ["--optimizers", "adamw", "--models", "mlp", "--steps", "2"]
    assert main([*argv, "--json", str(base)]) == 0
    data = json.loads(base.read_text())
    digests = [c["digest"] for c in data["cells"]]
    assert all(re.fullmatch(r"[0-9a-f]{32}", d) for d in digests)
    assert main([*argv, "--baseline", str(base)]) == 0
    data["cells"][1]["digest"] = "0" * 32
    base.write_text(json.dumps(data))
    capsys.readouterr()
    assert main([*argv, "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "1/2 common cells end in the same digest" in out and "changed:" in out


@pytest.mark.dist
def test_digests_file_is_a_baseline_that_names_its_cpu_kernels(tmp_path, capsys):
    """--digests writes each cell's configuration and digest with the run's CPU kernels; it
    serves as --baseline on the same kernels, and a file taken under other kernels is refused
    before any cell runs, naming the field, both values and the environment that matches it."""
    from zero.common.results import cpu_kernels

    slim = tmp_path / "digests.json"
    argv = ["--stages", "1", "--world-sizes", "2", "--precisions", "fp32"]
    argv += ["--optimizers", "sgd", "--models", "mlp", "--steps", "2"]
    assert main([*argv, "--digests", str(slim)]) == 0
    data = json.loads(slim.read_text())
    assert set(data) == {"about", "cells", "injected", "provenance"}
    assert [set(c) for c in data["cells"]] == [{"config", "digest"}]
    assert data["provenance"]["cpu_kernels"] == cpu_kernels()
    capsys.readouterr()
    assert main([*argv, "--baseline", str(slim)]) == 0
    out = capsys.readouterr().out
    assert "1/1 common cells end in the same digest" in out and "records no" not in out
    # a machine with weaker kernels than this one's: this one can use them, and is told how
    data["provenance"]["cpu_kernels"] = {"aten": "DEFAULT", "onednn": "DEFAULT"}
    slim.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--baseline", str(slim)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "provenance.cpu_kernels={'aten': 'DEFAULT', 'onednn': 'DEFAULT'}" in err
    assert str(cpu_kernels()) in err
    assert "ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41" in err


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_under_torchrun_it_uses_the_given_world(tmp_path):
    out = tmp_path / "v.json"
    args = ["--world-sizes", "1", "2", "--stages", "2", "--precisions", "fp32"]
    args += ["--optimizers", "sgd", "--models", "mlp", "--steps", "2", "--json", str(out)]
    done = torchrun("verify", args, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "world size 1 skipped" in done.stdout  # the launched world is 2
    cells = json.loads(out.read_text())["cells"]
    assert [c["world_size"] for c in cells] == [2] and cells[0]["passed"]
    assert done.stdout.count("1/1 cells passed") == 1  # rank 0 alone reports


@pytest.mark.dist
def test_resume_section_is_wired_in(tmp_path):
    """--resume adds the checkpoint resume/reshard table of verify/checkpoints/resume.py as its own
    section, in the JSON and the Markdown, and its rows count towards the exit status."""
    pytest.importorskip("verify.checkpoints.resume")
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    argv = ["--stages", "2", "--world-sizes", "2", "--precisions", "fp32", "--optimizers", "sgd"]
    argv += ["--models", "mlp", "--steps", "1", "--resume", "--json", str(out)]
    assert main([*argv, "--markdown", str(md)]) == 0
    rows = json.loads(out.read_text())["resume"]
    assert rows and all(r["passed"] and r["from_world_size"] == 2 for r in rows)
    assert "## Checkpoint resume and resharding" in md.read_text()


SECTION_KEYS = {"cells", "injected", "world_size_invariance", "timing", "provenance"}


def check_preset_report(data, cells):
    """Every section present with rows that passed; each cell's full config recorded."""
    assert SECTION_KEYS <= set(data)
    rows = data["cells"] + data["injected"]
    assert len(rows) == len(cells)
    for row in rows:
        assert KEYS <= set(row) and row["passed"], row
        assert set(row["config"]) >= {"clip_norm", "units", "overlap", "delays", "gradients"}
        assert (row["gradients"] == "backward") == (row in data["cells"])
        # no vacuous cell: at least one step reached the optimizer and was compared
        assert row["skipped_steps"] < row["steps"], row["config"]
        # the delays really slowed collectives down where asked, and nowhere else
        delayed = row["config"]["delays"] and row["world_size"] > 1
        assert (row["delayed_launches"] > 0) == delayed, row["config"]
    # each row's config is the full configuration: it rebuilds the very cell that ran
    assert sorted(json.dumps(r["config"], sort_keys=True) for r in rows) == sorted(
        json.dumps(c.as_dict(), sort_keys=True) for c in cells
    )
    ran = [Cell.from_config(r["config"]) for r in rows]
    assert sorted(map(repr, ran)) == sorted(map(repr, cells))
    for bug, observable in OBSERVABLE.items():
        assert any(observable(c) for c in ran), f"no cell in the report where {bug} shows"
    inv = data["world_size_invariance"]
    assert inv and all(r["passed"] for r in inv)
    return inv


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_quick_preset_passes_and_has_teeth(quick_report):
    """python -m verify --quick: the CI preset (tests/distributed/conftest.py runs it once).
    Every cell and invariance row passes, and for every planted bug
    (tests/distributed/test_verify_planted.py) a cell where it is observable ran."""
    assert quick_report["rc"] == 0
    took, data = quick_report["took"], quick_report["data"]
    cells, runs = matrix.quick()
    inv = check_preset_report(data, cells)
    assert {(r["stage"], r["world_size"]) for r in inv} == {
        (s, n) for s in range(4) for n in (1, 2, 4, 8)
    }
    assert {c["world_size"] for c in (r["config"] for r in data["cells"] + data["injected"])} == {
        1,
        2,
        3,
        4,
        8,
    }
    text = quick_report["markdown"]
    assert "## World-size invariance" in text and "## Injected gradients" in text
    # the parity section (verify/parity/section.py): at least one cell per model family, all passing
    assert {r["config"]["family"] for r in data["parity"]} == set(parity.FAMILIES)
    assert all(r["passed"] for r in data["parity"] + data["parity_invariance"])
    assert "## Parity with plain PyTorch" in text
    # the model-parallel section (verify/mp/cells.py): its quick cells, all passing
    assert len(data["mp"]) == len(mp_cells.quick_cells()) and data["mp_invariance"]
    assert all(r["passed"] for r in data["mp"] + data["mp_invariance"])
    # and N_m = 2 against N_m = 1, operator by operator (verify/mp/lockstep.py)
    assert len(data["mp_operators"]) == len(mp_lockstep.quick_cells())
    assert all(r["passed"] for r in data["mp_operators"]) and "## Model parallelism against" in text
    printed = quick_report["printed"]
    assert re.search(r"\d+/\d+ cells passed", printed)
    print(f"--quick took {took:.0f} s")  # visible with -s; the CLI's JSON keeps timing too


@pytest.mark.full
@pytest.mark.dist
@pytest.mark.timeout(2400)
def test_complete_preset_passes(tmp_path):
    """python -m verify --complete: the 3-wise covering run with its slices; release tier."""
    out = tmp_path / "complete.json"
    assert main(["--complete", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    cells, runs = matrix.complete()
    inv = check_preset_report(data, cells)
    assert len(inv) == 4 * len(runs)  # every run at N = 1, 2, 4, 8


def test_cells_is_the_product_of_its_axes():
    """matrix.cells: one value or several per axis, the first axis outermost, dicts setting
    fields together (a later axis wins); `python -m verify`'s explicit grid is that product."""
    got = matrix.cells(
        stage=(0, 3),
        world_size=2,
        optimizer="adam",
        numerics=[{"precision": "bf16", "optimizer": "sgd"}, {"precision": "fp32"}],
        mode="fast",
    )
    want = [
        Cell(stage=s, world_size=2, precision=p, optimizer=o, mode="fast")
        for s in (0, 3)
        for p, o in (("bf16", "sgd"), ("fp32", "adam"))
    ]
    assert got == want
    from verify.command.options import parse
    from verify.command.section_runs import cells_for

    args = parse(["--stages", "1", "2", "--world-sizes", "2", "--mode", "both", "--models", "gpt"])
    assert cells_for(args) == matrix.cells(
        world_size=2, stage=(1, 2), precision=matrix.PRECISIONS, optimizer=matrix.OPTIMIZERS,
        mode=("deterministic", "fast"), model="gpt",
    )  # fmt: skip


@pytest.mark.dist
def test_the_quick_preset_under_torchrun_of_one_rank_exits_zero(tmp_path):
    """The README's GPU command on a CPU: `torchrun --nproc-per-node 1 -m verify --quick`.
    Every section runs what the launched world of 1 can run and skips the rest with one line;
    the watchdog section, which breaks its worlds on purpose, is skipped whole (it crashed the
    run before: a 2-rank pool started inside a torchrun world of 1)."""
    out = tmp_path / "q.json"
    done = torchrun("verify", ["--quick", "--json", str(out)], nproc=1, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "watchdog skipped under torchrun" in done.stdout
    assert "world size 2 skipped" in done.stdout
    report = json.loads(out.read_text())
    cells = report["cells"] + report["injected"]
    assert cells and {c["world_size"] for c in cells} == {1}
    assert all(c["passed"] for c in cells)
    assert report["watchdog"] == []
