"""House rule: a commit subject is at most 72 characters (docs/design.md §4.5), so that
`git log --oneline`, a shortlog and a review tool show it whole.

The rule holds from RULE_SINCE on: the commits before it are history, which is not rewritten
(forty-odd of them are longer, up to 450 characters). The check reads the repository's own log;
in a checkout without that history (an export, or a shallow clone that stops after RULE_SINCE)
there is nothing to read, and the test says so by skipping. The checker itself is shown to
report a planted long subject either way.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBJECT_MAX = 72
RULE_SINCE = "ef631fba33a80cfb0dfc5180854a2851315de408"
"""The last commit before the rule was kept by this test (its subjects are left as they are)."""


def long_subjects(log: str, limit: int = SUBJECT_MAX) -> list[str]:
    """Every commit over the limit in `git log --format=%h%x00%s` output, as
    'HASH: N characters: SUBJECT'."""
    out = []
    for line in log.splitlines():
        sha, _, subject = line.partition("\0")
        if len(subject) > limit:
            out.append(f"{sha}: {len(subject)} characters: {subject}")
    return out


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
    )


def log_since(base: str) -> str:
    """The subjects of base..HEAD, or a skip when this checkout cannot say."""
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: no history to check")
    if git("cat-file", "-e", f"{base}^{{commit}}").returncode != 0:
        pytest.skip(f"history before {base[:9]} is not in this checkout (shallow clone)")
    done = git("log", "--format=%h%x00%s", f"{base}..HEAD")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_commit_subjects_since_the_rule_are_short():
    bad = long_subjects(log_since(RULE_SINCE))
    assert not bad, f"commit subjects over {SUBJECT_MAX} characters:\n" + "\n".join(bad)


def test_a_planted_long_subject_is_reported():
    ok = "a" * SUBJECT_MAX
    planted = "b" * (SUBJECT_MAX + 1)
    log = f"1111111\0{ok}\n2222222\0{planted}\n"
    assert long_subjects(log) == [f"2222222: {SUBJECT_MAX + 1} characters: {planted}"]


def test_a_subject_with_a_separator_inside_is_measured_whole():
    """Only the first NUL separates hash from subject; git cannot put one in a subject, but a
    subject with spaces, colons or non-ASCII text is counted in characters, not bytes."""
    subject = "zero/: é" * 9  # 72 characters, 81 bytes in UTF-8
    assert len(subject) == SUBJECT_MAX
    assert long_subjects(f"3333333\0{subject}\n") == []
