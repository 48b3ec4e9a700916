"""python -m verify.linecoverage: line coverage of the library, the forked ranks included.

A small run checks that the ranks are measured (a line only a rank runs must count as run) and
that a run the committed list was not written for fails loudly; the release tier runs the
default `--quick --resume` and holds it to the threshold with no unlisted or stale entry.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verify import linecoverage

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.dist


def run(tmp_path, *args, timeout=900):
    out = tmp_path / "coverage.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "verify.linecoverage", "--coverage-json", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, json.loads(out.read_text())


def line_of(path: str, text: str) -> int:
    lines = (ROOT / path).read_text().splitlines()
    (hit,) = [i for i, t in enumerate(lines, 1) if text in t]
    return hit


def test_the_ranks_are_measured_and_a_small_run_fails_the_list(tmp_path):
    proc, got = run(
        tmp_path, "--stages", "0", "--world-sizes", "2", "--precisions", "fp32",
        "--optimizers", "sgd", "--models", "mlp", "--steps", "1", "--no-invariance",
    )  # fmt: skip
    assert "verify itself failed" not in proc.stdout, proc.stdout[-3000:]
    # only a rank runs a stage's reduce-scatter: the parent never builds an engine
    path = "zero/stages/stage0.py"
    rank_only = line_of(path, "tree = self.cfg.deterministic or dist.get_backend")
    assert rank_only not in got["files"][path]["missed"]
    # the parent's own lines count too (the launcher's pool, run in this process only)
    path = "zero/ranks/local.py"
    assert line_of(path, "task = pickle.dumps((fn, args)") not in got["files"][path]["missed"]
    # one cell leaves much of the library unrun: lines the list does not explain, exit 1
    assert proc.returncode == 1 and got["percent"] < linecoverage.THRESHOLD
    assert got["unlisted"] and "UNLISTED zero/" in proc.stdout


@pytest.mark.full
def test_quick_resume_reaches_the_threshold_with_every_missed_line_listed(tmp_path):
    proc, got = run(tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert got["percent"] >= linecoverage.THRESHOLD
    assert got["unlisted"] == [] and got["stale"] == [] and got["covered_now"] == []
    assert got["covered"] + sum(got["listed_by_reason"].values()) == got["total"]
