"""python -m verify as users run it: locally spawned ranks, and under torchrun."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verify.__main__ import main

REPO = Path(__file__).resolve().parents[1]
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
    assert "2/2 cells passed" in capsys.readouterr().out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_under_torchrun_it_uses_the_given_world(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    out = tmp_path / "v.json"
    done = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "verify",
            "--world-sizes",
            "1",
            "2",
            "--stages",
            "2",
            "--precisions",
            "fp32",
            "--optimizers",
            "sgd",
            "--models",
            "mlp",
            "--steps",
            "2",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "world size 1 skipped" in done.stdout  # the launched world is 2
    cells = json.loads(out.read_text())["cells"]
    assert [c["world_size"] for c in cells] == [2] and cells[0]["passed"]
    assert done.stdout.count("1/1 cells passed") == 1  # rank 0 alone reports
