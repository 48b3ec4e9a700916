"""Two torchrun agents on one machine, as two nodes of two ranks each, train the same bits as one
agent of four ranks: `python -m zero.workloads.train` at stage 3 trains two steps and checkpoints,
is resumed by a second pair of agents for a third step, and ends with the final master digest
of an uninterrupted single-agent run of three steps.

Each agent is started with --nnodes 2, its --node-rank and --nproc-per-node 2, meeting at a c10d
rendezvous on 127.0.0.1 (a free port, a fresh run id each launch). c10d gives the agents their
GROUP_RANK in the order they join (--node-rank only orders a static rendezvous), and either order
numbers the ranks node-major. --ranks-per-node states each run's layout: the engine refuses a
value that disagrees with the launcher's LOCAL_WORLD_SIZE (zero/ranks/nodes.py), so the runs
below are 2 x 2 and 1 x 4 as named.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
# the tiny GPT, stage 3, one micro-batch per rank; a log line and a checkpoint only at the end
TRAIN = ["-m", "zero.workloads.train", "--model", "tiny", "--stage", "3", "--eval-every", "0"]
TRAIN += ["--eval-batches", "4", "--log-every", "100", "--ckpt-every", "0"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
TIMEOUT_S = 120  # one launch takes ~10 s on 2 shared cores

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    """The test's environment without launcher variables it may have inherited."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


def two_agents(args: list[str]) -> list[subprocess.CompletedProcess]:
    """Both agents of one 2 x 2 launch, started together; their results once both have ended."""
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    procs = [
        subprocess.Popen(
            [TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2"]
            + [*rdzv, "--rdzv-id", run_id, *TRAIN, "--ranks-per-node", "2", *args],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        stop(procs)
    return [
        subprocess.CompletedProcess(p.args, p.returncode, o)
        for p, o in zip(procs, outs, strict=True)
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill what is still running (a launch that timed out or whose test failed)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def one_agent(args: list[str]) -> subprocess.Popen:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "4", *TRAIN]
    command += ["--ranks-per-node", "4", *args]
    return subprocess.Popen(
        command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def log(out: Path) -> dict:
    return json.loads((out / "train_log.json").read_text())


@pytest.mark.dist
def test_two_torchrun_agents_train_resume_and_match_one_agent_bit_for_bit(tmp_path):
    corpus = tmp_path / "corpus.txt"  # this project's own sources: ~0.2 MB, quick to load
    corpus.write_bytes(b"\n".join(p.read_bytes() for p in sorted((REPO / "zero").glob("*.py"))))
    data = ["--data", str(corpus)]
    single = one_agent([*data, "--steps", "3", "--out", str(tmp_path / "one")])  # alongside
    try:
        first = two_agents([*data, "--steps", "2", "--out", str(tmp_path / "two")])
        for d in first:
            assert d.returncode == 0, d.stdout[-3000:]
        assert (tmp_path / "two" / "ckpt" / "step-00000002").is_dir()
        resumed = two_agents([*data, "--steps", "3", "--resume", "--out", str(tmp_path / "two")])
        for d in resumed:
            assert d.returncode == 0, d.stdout[-3000:]
        out, _ = single.communicate(timeout=TIMEOUT_S)
    finally:
        stop([single])
    assert single.returncode == 0, out[-3000:]
    two, one = log(tmp_path / "two"), log(tmp_path / "one")
    for run in (two, one):
        c = run["config"]
        assert (c["launcher"], c["backend"], c["world_size"]) == ("torchrun", "gloo", 4)
    assert two["config"]["zero"]["ranks_per_node"] == 2
    assert one["config"]["zero"]["ranks_per_node"] == 4
    assert [h["loss"] for h in two["result"]["history"]["train"]] == [
        h["loss"] for h in one["result"]["history"]["train"]
    ]
    assert two["result"]["final_master_sha256"] == one["result"]["final_master_sha256"]
