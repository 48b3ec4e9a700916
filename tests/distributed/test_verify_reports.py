"""python -m verify always reports: work that raises (in a rank, a cell, a resume case or a whole
section) becomes a failing row naming it and the error; the rows after it still run, the summary
is printed, the JSON is written, and the exit status is 1 ([Note: a row that raised])."""

import functools
import json

import pytest

import verify.cells.run
import verify.command.section_runs
from verify.__main__ import main
from verify.checkpoints import resume
from verify.checkpoints.resume import ResumeCase
from verify.checks import harness
from verify.checks.report import error_text
from verify.planted.plants import Patch
from zero.checkpoint import CheckpointError, reshard
from zero.ranks.launch import RankError

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ONE_CELL = ["--stages", "0", "--world-sizes", "1", "--precisions", "fp32"]
ONE_CELL += ["--optimizers", "sgd", "--models", "mlp", "--steps", "1"]
"""A matrix of one cheap cell (stage 0, N = 1): the rest of the report around it."""

# -- a resume case whose resumed rank refuses a valid checkpoint --------------------------------

REFUSED = ResumeCase(n1=1, s1=1, n2=1, s2=2, precision="fp32", optimizer="sgd", steps_after=1)
RESUMED = ResumeCase(n1=1, s1=0, n2=1, s2=1, precision="fp32", optimizer="sgd", steps_after=1)
PLANTED = "manifest check refused a valid checkpoint (planted)"


def refuse(step_dir):
    raise CheckpointError(f"{step_dir}: {PLANTED}")


def refusing_rank(rank, n, case, stage, steps, save_to=None, load_from=None, first=False):
    """verify.checkpoints.resume.run_rank, whose loader's manifest read refuses the checkpoint in
    the REFUSED
    case: patched here, in the rank's own process, and undone when it returns."""
    with Patch() as p:
        if load_from is not None and case == REFUSED:
            p.setattr(reshard, "read_manifest", refuse)
        return resume.run_rank(rank, n, case, stage, steps, save_to, load_from, first)


def full_disk(*args, **kwargs):
    raise OSError("no space left on device (planted)")


def failing_saver(rank, n, case, stage, steps, save_to=None, load_from=None, first=False):
    """verify.checkpoints.resume.run_rank whose save raises in the REFUSED case: in a pool's
    worker, so
    the pool breaks (zero.ranks.local.WorkerPool)."""
    from zero.engine import ZeroEngine

    with Patch() as p:
        if save_to is not None and case == REFUSED:
            p.setattr(ZeroEngine, "save", full_disk)
        return resume.run_rank(rank, n, case, stage, steps, save_to, load_from, first)


def test_a_rank_that_refuses_a_valid_checkpoint_fails_its_resume_row_only(
    tmp_path, capsys, monkeypatch
):
    """python -m verify --resume where the resumed rank's loader refuses a valid checkpoint
    (the saving run's checkpoint passed check_saved's verification in this process): that
    case's row fails naming it and the error; the next case, the summary and the reports
    follow; the exit status is 1."""
    out, md = tmp_path / "v.json", tmp_path / "v.md"
    monkeypatch.setattr(resume, "resume_cases", lambda quick, world_sizes: [REFUSED, RESUMED])
    planted = functools.partial(resume.run_case, rank_fn=refusing_rank)
    monkeypatch.setattr(resume, "run_case", planted)
    argv = [*ONE_CELL, "--resume", "--json", str(out), "--markdown", str(md)]
    assert main(argv) == 1
    said = capsys.readouterr().out
    data = json.loads(out.read_text())  # complete: every section, the provenance
    assert {"cells", "injected", "resume", "errors", "timing", "provenance"} <= set(data)
    assert [r["passed"] for r in data["cells"]] == [True] and data["errors"] == []
    refused, resumed = data["resume"]
    assert refused["passed"] is False and resumed["passed"] is True  # the next case still ran
    assert refused["name"] == "N=1 stage 1 -> N=1 stage 2 fp32 sgd mlp"
    assert refused["config"]["s2"] == 2 and refused["to_stage"] == 2
    # raised in the resumed rank (a forked process), reported with its type, message and rank
    assert refused["error"].startswith("CheckpointError: ")
    assert refused["error"].endswith(f"{PLANTED} (rank 0)")
    assert refused["first_mismatch"] == f"raised {refused['error']}"
    assert "error" not in resumed and set(resumed) <= set(refused)  # the row's every field
    # the summary is printed, and counts the failing row
    assert "1/1 cells passed" in said and "resume: 1/2 passed" in said
    assert "FAIL raised CheckpointError: " in said
    text = md.read_text()
    assert "## Rows that raised" in text and f"| resume | {refused['name']} |" in text


def test_a_rank_error_that_breaks_the_pool_fails_its_row_and_the_next_row_runs(monkeypatch):
    """The saving run's rank raises in a pool worker: the pool breaks, that case fails naming
    the error, and the next case runs on a fresh pool and passes."""
    from zero.ranks.local import get_pool

    monkeypatch.setattr(resume, "resume_cases", lambda quick, world_sizes: [REFUSED, RESUMED])
    monkeypatch.setattr(
        resume, "run_case", functools.partial(resume.run_case, rank_fn=failing_saver)
    )
    before = get_pool(1)
    refused, resumed = resume.resume_rows(world_sizes=(1,), timeout_s=120)
    assert before.broken and get_pool(1) is not before
    assert refused["passed"] is False and resumed["passed"] is True
    assert refused["name"] == "N=1 stage 1 -> N=1 stage 2 fp32 sgd mlp"
    assert refused["error"] == "OSError: no space left on device (planted) (rank 0)"


# -- a cell whose build or check raises -------------------------------------------------------


def raise_for_stage_1(real):
    """real(rank, cell) (build_cell) or real(run, verdict) (check_memory), raising for a cell
    of stage 1."""

    def planted(first, second):
        cell = second if real.__name__ == "build_cell" else first.cell
        if cell.stage == 1:
            raise RuntimeError(f"planted in {real.__name__}\nsecond line")
        return real(first, second)

    return planted


def cells_with_a_raising(name, rank, n, cells):
    """verify.checks.harness.run_cells with harness.<name> raising in stage-1 cells, in the
    worker."""
    with Patch() as p:
        p.setattr(harness, name, raise_for_stage_1(getattr(harness, name)))
        return harness.run_cells(rank, n, cells)


@pytest.mark.parametrize("name", ["build_cell", "check_memory"])
def test_a_cell_that_raises_is_a_failing_row_naming_it(name, tmp_path, capsys, monkeypatch):
    out = tmp_path / "v.json"
    monkeypatch.setattr(
        verify.cells.run, "run_cells", functools.partial(cells_with_a_raising, name)
    )
    argv = [*ONE_CELL[:1], "0", "1", *ONE_CELL[2:], "--json", str(out)]  # stages 0 and 1
    assert main(argv) == 1
    said = capsys.readouterr().out
    stage0, stage1 = json.loads(out.read_text())["cells"]
    assert stage0["passed"] and "error" not in stage0  # the other cell still passes
    assert stage1["passed"] is False
    assert stage1["name"] == "stage 1 N=1 fp32 sgd deterministic mlp backward M=2"
    assert stage1["error"] == f"RuntimeError: planted in {name} (rank 0)"
    assert stage1["first_mismatch"] == f"rank 0: raised RuntimeError: planted in {name}"
    assert "1/2 cells passed" in said and "FAIL rank 0: raised RuntimeError: planted" in said


# -- a whole section that raises --------------------------------------------------------------


def broken(*args, **kwargs):
    raise RuntimeError("planted: the section broke\nsecond line")


@pytest.mark.parametrize(
    ("section", "target", "extra"),
    [
        ("resume", (resume, "run_table"), ["--resume"]),
        ("cells", (verify.command.section_runs, "run_matrix"), []),
    ],
)
def test_a_section_that_raises_still_gives_the_summary_and_json(
    section, target, extra, tmp_path, capsys, monkeypatch
):
    out, md = tmp_path / "v.json", tmp_path / "v.md"
    monkeypatch.setattr(*target, broken)
    assert main([*ONE_CELL, *extra, "--json", str(out), "--markdown", str(md)]) == 1
    said = capsys.readouterr().out
    data = json.loads(out.read_text())
    error = "RuntimeError: planted: the section broke"
    assert data["errors"] == [{"name": section, "passed": False, "error": error}]
    assert "resume" not in data and "provenance" in data
    # the cells ran when the resume section broke; none when the matrix itself did
    assert [r["passed"] for r in data["cells"]] == ([True] if section == "resume" else [])
    cells = "1/1" if section == "resume" else "0/0"
    assert f"{cells} cells passed" in said
    assert "errors: 1 section(s) raised" in said and f"  {section}: {error}" in said
    assert f"| errors | {section} | {error} |" in md.read_text()


def test_a_rank_error_is_reported_as_the_rank_s_own_exception():
    """A pool's RankError carries the rank's traceback: the row names that exception, not the
    RankError, with its first line and the rank."""
    child = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "ValueError: inner\n\nThe above exception was the direct cause of the following "
        "exception:\n\nTraceback (most recent call last):\n"
        '  File "x.py", line 3, in g\n'
        "    raise CheckpointError(...)\n"
        "zero.checkpoint.format.CheckpointError: refused\nmore\n"
    )
    assert error_text(RankError(3, child)) == "CheckpointError: refused (rank 3)"
    assert error_text(TimeoutError("ranks [1] did not report\n")) == (
        "TimeoutError: ranks [1] did not report"
    )
    assert error_text(AssertionError()) == "AssertionError"


def test_a_world_that_dies_fails_its_invariance_rows_naming_the_error(monkeypatch):
    """The invariance table's world N = 2 raises (a stand-in pool): its rows fail with the
    rank's error; the other worlds' rows pass."""
    child = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: boom\n'

    def pool(n, fn, runs, timeout_s, where=None):
        if n == 2:
            raise RankError(1, child)
        return [[["same digest"] * 3 for _ in runs]] * n

    monkeypatch.setattr(verify.cells.run, "pool_run", pool)
    runs = [{"stage": 0, "precision": "fp32", "optimizer": "sgd"}]
    rows = verify.cells.run.invariance_table(
        runs, timeout_s=10, say=lambda *a: None, sizes=[1, 2, 4]
    )
    by_n = {r["world_size"]: r for r in rows}
    assert sorted(by_n) == [1, 2, 4]
    assert by_n[1]["passed"] and by_n[4]["passed"] and "error" not in by_n[4]
    assert by_n[2]["passed"] is False and by_n[2]["name"] == "world_size_invariance N=2"
    assert by_n[2]["error"] == "world N=2 failed: ValueError: boom (rank 1)"
