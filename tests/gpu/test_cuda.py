"""The GPU tier: NCCL at world size 1, the CUDA paths of offload and contiguous memory, the
allocator-based measurements. Every test here is marked `gpu` and skipped, with the reason,
where torch.cuda.is_available() is False (tests/conftest.py). Run with `make test-gpu`, or on a
machine without the project's virtual environment: `PYTHONPATH=. python3 -m pytest tests/gpu`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from measure.resident import MemoryProbe

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
pytestmark = pytest.mark.gpu


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_injected_cells_give_the_reference_bits_on_cuda_with_nccl(tmp_path):
    """Every stage and precision, offload and contiguous buffers included, bit for bit."""
    out = tmp_path / "cells.json"
    done = run(["tests/gpu/cuda_cells.py", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    failed = [(r["config"], r["first_mismatch"]) for r in data["rows"] if not r["passed"]]
    assert failed == []
    assert all(r["bitwise"] for r in data["rows"]) and len(data["rows"]) == 36
    assert data["max_allocated"] > 0  # the engines lived on the GPU


def test_cuda_probe_counts_allocator_bytes():
    buffer = 64 * MiB
    probe = MemoryProbe(device="cuda")
    x = torch.ones(buffer // 4, device="cuda")
    s = probe.sample("buffer")
    # the caching allocator rounds a request up to its 2 MiB blocks for large sizes
    assert buffer <= s["bytes"] <= buffer + 2 * MiB
    del x
    assert probe.sample("freed")["bytes"] == 0


def test_fragmentation_reports_the_allocator_with_and_without_contiguous_buffers():
    args = ["-m", "measure.fragmentation", "--layers", "2", "--embd", "128", "--heads", "2"]
    done = run([*args, "--seq", "64", "--batch", "2", "--steps", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reserved" in done.stdout and "allocated" in done.stdout


def test_the_bench_runs_on_one_gpu_under_torchrun(tmp_path):
    out = tmp_path / "bench.json"
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    args += ["-m", "measure.bench", "--model", "small", "--systems", "zero-s0", "ddp"]
    done = run([*args, "--world-sizes", "1", "--repeats", "1", "--json", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    systems = {r["config"]["system"] for r in records}
    assert {"zero-s0", "ddp"} <= systems
    assert all(r["result"]["status"] == "ok" for r in records)
    assert all(r["config"].get("device", "").startswith("cuda") for r in records)
