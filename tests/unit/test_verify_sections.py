"""verify/command/sections.py: the sections python -m verify runs are one table, and which of
them an invocation runs follows from its options and the table alone (nothing here starts a
rank). A section added to the table is one entry: its option, its choice, its report keys."""

import pytest

from verify.cells.run import Where
from verify.command import options, sections
from verify.command.section_runs import Invocation

PRESET = ["cells", "parity", "mp", "watchdog", "refusals"]


@pytest.mark.parametrize(
    "argv, want",
    [
        ([], ["cells"]),
        (["--resume"], ["cells", "resume"]),
        (["--quick"], PRESET),
        (["--complete", "--resume"], ["cells", "resume", *PRESET[1:]]),
        (["--quick", "--no-mp"], ["cells", "parity", "watchdog", "refusals"]),
        (["--parity"], ["cells", "parity"]),
        (["--quick", "--mp"], ["cells", "mp"]),
        (["--parity", "--mp", "--resume"], ["cells", "resume", "parity", "mp"]),
    ],
)
def test_an_invocation_runs_the_sections_its_options_choose(argv, want):
    args = options.parse(argv)
    assert [s.name for s in sections.TABLE if sections.chosen(s, args)] == want
    assert sections.alone(args) == any(a in argv for a in ("--parity", "--mp"))


def test_the_table_names_every_section_once_with_its_report_keys():
    names = [s.name for s in sections.TABLE]
    assert len(set(names)) == len(names) and names[0] == "cells"
    keys = [k for s in sections.TABLE for k in s.keys]
    assert len(set(keys)) == len(keys)
    assert set(keys) | {"errors"} <= set(sections.row_keys())


def test_a_section_added_to_the_table_is_one_entry(monkeypatch):
    rows = [{"passed": True}]
    extra = sections.Section(
        "extra",
        lambda inv: {"extra": rows},
        keys=("extra",),
        flag=sections.Flag("--extra", "an added section"),
        quick=True,
        timed=True,
        tally=lambda got, timing: f"extra: {len(got['extra'])} rows",
    )
    monkeypatch.setattr(sections, "TABLE", (*sections.TABLE, extra))
    assert "an added section" in options.parser().format_help()
    assert sections.chosen(extra, options.parse(["--extra"]))
    assert sections.chosen(extra, options.parse(["--quick"]))
    assert not sections.chosen(extra, options.parse(["--complete"]))
    assert not sections.chosen(extra, options.parse(["--quick", "--parity"]))  # parity alone
    assert "extra" in sections.row_keys()
    said, report = [], {"timing": {}}
    args = options.parse(["--extra"])
    invocation = Invocation(args, said.append, [], [], where=Where(), alone=False)
    assert sections.run(extra, invocation, report) == {"extra": rows}
    assert report["extra"] == rows and "extra_s" in report["timing"]
    assert said == ["extra: 1 rows"]
