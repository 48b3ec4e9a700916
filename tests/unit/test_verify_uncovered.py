"""verify/uncovered.py: the committed list of unrun library lines, and how it is matched.

The list must name existing code (a renamed function or an edited line makes an entry stale,
and that fails here, without running verify), every reason must be a known one, and the
matching rules (scope, text, a compound statement's body) must hold on a planted source.
"""

from pathlib import Path

import pytest

from verify import linecoverage, uncovered
from verify.uncovered import Entry, Scopes, check, parse, stale

ROOT = Path(__file__).resolve().parents[2]

SOURCE = """\
import os

LIMIT = {
    "a": 1,
}


def outer(x):
    if x is None:
        raise ValueError("x")
    elif x < 0:
        return -x
    else:
        y = x

    def inner():
        return os.sep

    return y


class K:
    def method(self):
        try:
            return 1
        except OSError:
            return 2


if __name__ == "__main__":
    outer(1)
"""


def entry(scope, match, reason="error-path", file="pkg/m.py"):
    return Entry(file=file, scope=scope, match=match, reason=reason, why="a test")


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(SOURCE)
    return tmp_path


def line(text):
    return next(i for i, t in enumerate(SOURCE.splitlines(), 1) if text in t)


def test_the_committed_list_names_existing_code():
    entries = uncovered.load()
    assert entries, "verify/uncovered.toml is empty"
    assert stale(entries, ROOT) == []
    assert len({(e.file, e.scope, e.match) for e in entries}) == len(entries), "duplicates"
    library = {p.relative_to(ROOT).as_posix() for p in linecoverage.library_files()}
    assert {e.file for e in entries} <= library, "an entry outside the library"


def test_the_library_definition_names_existing_files_and_scopes():
    for path in linecoverage.NOT_LIBRARY:
        assert (ROOT / path).is_file(), path
    for path, names in linecoverage.NOT_LIBRARY_SCOPES.items():
        if path == "*":
            continue
        scopes = Scopes.of((ROOT / path).read_text())
        assert [n for n in names if n not in scopes.ranges] == [], path
    files = linecoverage.library_files()
    assert ROOT / "zero" / "engine.py" in files and ROOT / "zero" / "digits.py" not in files


def test_scopes_and_matching_on_a_planted_source():
    s = Scopes.of(SOURCE)
    # an if's body only: its elif and else are separate
    assert s.explained(entry("outer", "if x is None:")) == {line("if x is None"), line("raise")}
    assert s.explained(entry("outer", "raise ValueError")) == {line("raise ValueError")}
    # a nested def belongs to its enclosing scope too, and has its own qualname
    assert line("return os.sep") in s.explained(entry("outer", "*"))
    assert s.explained(entry("outer.inner", "return")) == {line("return os.sep")}
    # an except clause opens a block; a method's qualname is Class.method
    got = s.explained(entry("K.method", "except OSError"))
    assert got == {line("except OSError"), line("return 2")}
    # module-level names and the __main__ block are scopes
    assert s.explained(entry("LIMIT", "*")) == set(range(line("LIMIT"), line('"a": 1') + 2))
    assert s.explained(entry("__main__", "outer(1)")) == {line("outer(1)")}
    # text outside the scope does not match
    assert s.explained(entry("K.method", "raise ValueError")) == set()


def test_a_planted_bad_entry_is_reported_stale(tree):
    good = entry("outer", "raise ValueError")
    assert stale([good], tree) == []
    (msg,) = stale([entry("outer", ("raise ValueError", "no such line"))], tree)
    assert "contains 'no such line'" in msg  # every text of a list must match
    for bad, why in (
        (entry("outer", "raise TypeError"), "no line of outer contains"),
        (entry("renamed", "*"), "no def or class 'renamed'"),
        (entry("outer", "*", file="pkg/gone.py"), "no such file"),
    ):
        (msg,) = stale([good, bad], tree)
        assert why in msg, msg
    # the committed list with one planted entry fails the same way
    planted = uncovered.load() + [entry("ZeroEngine.step", "no such text", file="zero/engine.py")]
    assert len(stale(planted, ROOT)) == 1


def test_malformed_entries_are_refused_naming_the_field():
    ok = '[[line]]\nfile = "f"\nscope = "s"\nmatch = "m"\nreason = "gpu-only"\nwhy = "w"\n'
    assert parse(ok) == [Entry("f", "s", ("m",), "gpu-only", "w")]
    assert parse(ok.replace('"m"', '["m", "n"]'))[0].match == ("m", "n")
    with pytest.raises(ValueError, match=r"\['match'\] missing"):
        parse(ok.replace('"m"', "[]"))
    with pytest.raises(ValueError, match="reason='flaky'"):
        parse(ok.replace("gpu-only", "flaky"))
    with pytest.raises(ValueError, match=r"\['why'\] missing"):
        parse(ok.replace('why = "w"', 'why = ""'))
    with pytest.raises(ValueError, match=r"\['lines'\] unknown"):
        parse(ok + "lines = '3-4'\n")
    with pytest.raises(ValueError, match="only \\[\\[line\\]\\]"):
        parse(ok + "[other]\nx = 1\n")


def test_check_splits_missed_lines_and_names_idle_entries(tree):
    statements = [line("raise ValueError"), line("return -x"), line("y = x"), line("outer(1)")]
    missed = [line("raise ValueError"), line("return -x")]
    files = {"pkg/m.py": (statements, missed)}
    listed = entry("outer", "raise ValueError")
    idle = entry("outer", "y = x")  # that line ran: the entry explains nothing
    r = check(files, [listed, idle], root=tree)
    assert (r.covered, r.total) == (2, 4) and r.percent == 50.0
    assert r.listed == {"pkg/m.py": [line("raise ValueError")]}
    assert r.unlisted == [f"pkg/m.py:{line('return -x')}: return -x"]
    assert r.idle == [str(idle)] and r.stale == []
    assert r.by_reason == {"error-path": 1}
    assert not r.ok(threshold=0)
    r = check(files, [listed, entry("outer", "elif x < 0")], root=tree)
    assert r.unlisted == [] and r.idle == [] and r.ok(threshold=50) and not r.ok(threshold=51)
    text = "\n".join(r.lines(threshold=90))
    assert "covered 2/4 statements = 50.0%" in text and "BELOW THRESHOLD" in text
