"""verify's refusals section (verify/refusals/section.py): every row passes on the real library,
and a
refusal planted away, a wrong expected text or another exception fails exactly its row, saying
what happened instead."""

import dataclasses

import pytest

from verify.command import sections
from verify.command.options import parse
from verify.refusals import section as refusals
from verify.refusals.damage import damage_rows
from verify.refusals.rows import Refusal, judge_here, result
from zero.checkpoint import validate


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    """The whole section once (pools of 1 and 2 ranks), its checkpoints kept for the plants."""
    directory = tmp_path_factory.mktemp("refusals")
    lines = []
    rows = refusals.run_section(timeout_s=120, say=lines.append, directory=directory)
    return rows, directory, lines


def test_every_row_passes_and_every_place_runs(section):
    rows, _, lines = section
    failed = [(r["row"], r["message"]) for r in rows if not r["passed"]]
    assert failed == []
    assert len(rows) == sum(refusals.row_counts().values())
    assert {r["where"] for r in rows} == {"here", "N=1", "N=2"}
    modules = {r["module"] for r in rows}
    for m in ("config", "build", "engine", "materialize", "mp/mesh", "checkpoint/validate",
              "checkpoint/format", "checkpoint/mpformat", "checkpoint/reshard"):  # fmt: skip
        assert m in modules
    assert not any("FAIL" in line for line in lines)


def test_a_rule_planted_away_fails_exactly_its_row(section, monkeypatch):
    """validate.py made to accept an optimizer step count beyond t: that row alone fails, as
    accepted (the planted manifest verifies)."""
    _, directory, _ = section
    fail = validate._Fields.fail

    def lenient(self, field, message):
        if field != "params[0].step":
            fail(self, field, message)

    monkeypatch.setattr(validate._Fields, "fail", lenient)
    rows = judge_here(damage_rows(directory))
    failed = [r for r in rows if not r["passed"]]
    assert [r["row"] for r in failed] == ["checkpoint/validate: more steps than t"]
    assert failed[0]["message"].startswith("accepted: nothing raised, expected CheckpointError")


def test_a_refusal_naming_something_else_fails_its_row():
    row = refusals.config_rows()[0]  # stage 4
    wrong = dataclasses.replace(row, says="stage=5")
    (got,) = judge_here([wrong])
    assert not got["passed"]
    assert got["message"].startswith("ValueError does not say 'stage=5': stage=4")


def test_another_exception_type_fails_its_row():
    row = dataclasses.replace(refusals.config_rows()[0], error=TypeError)
    (got,) = judge_here([row])
    assert not got["passed"] and got["message"].startswith("raised ValueError, not TypeError")


def test_a_row_whose_ranks_disagree_names_the_rank():
    row = Refusal("two ranks", "build", lambda: None, ValueError, ("a", "b"), world=2)
    right = {"raised": "ValueError", "right_type": True, "message": "a"}
    wrong = {"raised": "ValueError", "right_type": True, "message": "a"}  # rank 1 must say "b"
    got = result(row, [right, wrong])
    assert not got["passed"] and got["message"].startswith("rank 1: ValueError does not say 'b'")


def refusals_section(argv: list[str], say):
    """What verify/command/sections.py's table runs of the refusals section for these options."""
    invocation = sections.invocation(parse(argv), say)
    return sections.run(sections.named("refusals"), invocation, {})


def test_the_presets_list_the_section_and_other_runs_skip_it():
    said = []
    assert refusals_section(["--quick", "--list"], said.append) is None
    assert said == [refusals.count_line()] and said[0].startswith("refusals: ")
    assert refusals_section(["--stages", "0"], said.append) is None
    assert refusals_section(["--parity"], said.append) is None
    assert len(said) == 1


def test_a_world_whose_rows_do_not_come_back_is_one_failing_row(section, monkeypatch):
    """The parent expects a row the ranks never ran (their pool was forked before the plant):
    the world's rows become one failing row naming the error, and the section goes on."""
    from verify.refusals import ranks as refusal_ranks

    _, directory, _ = section
    extra = Refusal("a row the ranks never ran", "build", lambda: None, ValueError, "x", world=1)
    real = refusal_ranks.rank_rows
    monkeypatch.setattr(refusal_ranks, "rank_rows", lambda r, n, d: [*real(r, n, d), extra])
    (row,) = refusals.on_pool(1, directory / "again", 120)
    assert row["row"] == "N=1 ranks" and not row["passed"]
    assert row["message"] == "raised KeyError: 'a row the ranks never ran'"
