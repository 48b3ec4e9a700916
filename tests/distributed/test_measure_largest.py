"""python -m measure.largest as a process, on tiny shapes (seconds each): a run that trains both
offload tiers exits 0 with its report (the disk's bandwidth beside the disk tier's records), the
disk folder and the report's folder made for it; a run whose one shape cannot be trained (the
address space capped at 1 GiB for it and its child) exits 1 with one line naming the shape, its
--json record still written; and a bad option is one line and exit status 2 from the entry point
itself."""

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m measure.largest"
pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def largest(*args, limit_as: int | None = None, timeout: float = 120):
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run(
        [sys.executable, "-m", "measure.largest", *map(str, args)], cwd=REPO,
        capture_output=True, text=True, timeout=timeout, preexec_fn=cap if limit_as else None,
    )  # fmt: skip


def test_a_tiny_shape_trains_in_both_offload_tiers(tmp_path):
    work, out = tmp_path / "new" / "disk", tmp_path / "reports" / "r.json"
    done = largest("--shape", 1, 128, "--tiers", "memory", "disk", "--steps", 1,
                   "--probe-gib", 0.01, "--dir", work, "--json", out)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["disk_bandwidth"]["bytes"] == 64 << 20  # one chunk: the probe's least
    for tier in ("memory", "disk"):
        (rec,) = report[tier]
        assert "failed" not in rec and rec["layers"] == 1 and rec["width"] == 128
        assert len(rec["step_s"]) == 1
    assert work.is_dir() and list(work.iterdir()) == []  # the probe's file removed


def test_a_shape_that_cannot_train_exits_1_with_its_record(tmp_path):
    out = tmp_path / "r.json"
    done = largest("--shape", 4, 1024, "--tiers", "memory", "--steps", 1, "--json", out,
                   limit_as=1 << 30)  # fmt: skip
    err = done.stderr.strip()
    assert done.returncode == 1, (done.returncode, err[-2000:])
    (line,) = err.splitlines()
    assert line.startswith(f"{PROG}: error: measurement failed: tier 'memory': shape 4x1024")
    (rec,) = json.loads(out.read_text())["memory"]
    assert rec["layers"] == 4 and rec["width"] == 1024 and rec["failed"] in line


def test_a_bad_option_from_the_entry_point(tmp_path):
    done = largest("--host-gib", "nan", "--dir", tmp_path / "work", timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == f"{PROG}: error: host_gib=nan: allowed is a finite number > 0 (GiB)\n"
    assert not (tmp_path / "work").exists()
