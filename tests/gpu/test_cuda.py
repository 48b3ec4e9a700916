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
    # the memory pass on CUDA: the allocator's peak, at least the model states
    ours = next(r["result"]["memory"] for r in records if r["config"]["system"] == "zero-s0")
    assert "cuda" in ours["method"]
    assert ours["peak_bytes"] >= ours["engine_states_bytes"] >= ours["analytic_states_bytes"]


def test_tensor_memory_on_cuda_is_the_allocators_peak():
    """Sizes in whole 512-byte blocks (the caching allocator's rounding): exact phase peaks."""
    from measure.tensor_memory import tracking

    with tracking("cuda") as (mark, trace):
        mark("a")
        a = torch.empty(1 << 20, device="cuda")  # 4 MiB
        b = torch.empty(1 << 19, device="cuda")  # 2 MiB
        mark("b")
        del a
        c = torch.empty(1 << 18, device="cuda")  # 1 MiB: 3 alive
        del b, c
    assert trace.phase_peak == [6 * MiB, 6 * MiB] and trace.phase_end == [6 * MiB, 0]


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_deterministic_optimizer_on_cuda_gives_the_reference_bits(path):
    """zero/optim/update.py's deterministic update on CUDA against reference/optim.py, bit for bit:
    the Triton kernel (zero/optim/triton_kernels.py, the default where Triton imports: one kernel,
    no FMA contraction, div_rn and sqrt_rn) and the torch-op fallback with CUDA's sqrt. The
    values span 60 binades with signed zeros and subnormals, where an FMA or a flush to zero
    would show."""
    import numpy as np

    from reference import optim as ref
    from reference.optim import Hyper
    from zero.optim import triton_kernels as optim_triton
    from zero.optim import update as optim

    if path == "triton" and not optim_triton.available("cuda"):
        pytest.skip("Triton does not import here")
    rng = np.random.default_rng(0)
    n = 2 * optim.BLOCK + 777
    saved, optim_triton.ENABLED = optim_triton.ENABLED, path == "triton"
    try:
        for kind, hp in (
            ("adamw", Hyper(lr=1e-2, weight_decay=0.1)),
            ("adam", Hyper(lr=1e-2)),
            ("adam", Hyper(lr=1e-3, weight_decay=0.01, betas=(0.8, 0.99))),
        ):
            p = rng.standard_normal(n).astype(np.float32)
            g = (rng.standard_normal(n) * 2.0 ** rng.integers(-40, 20, n)).astype(np.float32)
            g[:4] = np.array([0.0, -0.0, 1e-45, -2e-39], np.float32)
            st = {
                k: np.abs(rng.standard_normal(n) * 2.0 ** rng.integers(-30, 0, n)).astype(
                    np.float32
                )
                for k in ("exp_avg", "exp_avg_sq")
            }
            want_p, want = ref.step(kind, p, g, st, hp, 3)
            tp = torch.from_numpy(p).cuda()
            tg = torch.from_numpy(g).cuda()
            ts = {k: torch.from_numpy(v).cuda() for k, v in st.items()}
            if path == "triton":  # the kernel really ran (not the fallback)
                run = (0, n, ref.step_scalars(kind, hp, 3), bool(hp.weight_decay))
                moments = (ts["exp_avg"], ts["exp_avg_sq"])
                assert optim_triton.adam_runs(kind, [run], tp, tg, *moments)
            else:
                optim.deterministic_step(kind, hp, 3, tp, tg, ts)
            assert np.array_equal(tp.cpu().numpy().view(np.uint32), want_p.view(np.uint32)), kind
            for k in want:
                got = ts[k].cpu().numpy().view(np.uint32)
                assert np.array_equal(got, want[k].view(np.uint32)), (kind, k)
    finally:
        optim_triton.ENABLED = saved


def test_one_steps_host_work_on_cuda_does_not_grow_with_the_model():
    """measure/hostwork.py on CUDA, where every read is a real synchronisation: at two widths
    with the same units the same counts, and the step's one read is the control exchange's."""
    done = run(
        [
            "-m",
            "measure.hostwork",
            "--device",
            "cuda",
            "--widths",
            "64",
            "256",
            "--layers",
            "2",
            "--stages",
            "0",
            "3",
            "--sites",
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        line.split("|")[1:-1]
        for line in done.stdout.splitlines()
        if line.startswith("| 0") or line.startswith("| 3")
    ]
    by = {}
    for stage, _, _, _, phase, *counts in rows:
        by.setdefault((stage.strip(), phase.strip()), set()).add(tuple(c.strip() for c in counts))
    assert len(by) == 6 and all(len(v) == 1 for v in by.values()), by
    sites = [line for line in done.stdout.splitlines() if " × " in line]
    assert sites and all("zero/control.py:exchange" in line for line in sites), sites


def test_norm_partials_on_cuda_give_the_reference_bits():
    """zero/control.py's chunk partials on CUDA (the Triton kernel where Triton imports, else
    the torch ops) = reference/tree.py's chunk_sumsq, with and without a keep mask, on values
    over 120 binades with signed zeros, subnormals, infinities and NaN (NaN compared as NaN)."""
    import numpy as np

    from reference.tree import chunk_sumsq as ref_sumsq
    from zero.control import chunk_sumsq

    rng = np.random.default_rng(1)
    for chunk in (128, 4096):
        n = chunk * 7
        x = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
        x[:6] = np.array([0.0, -0.0, 1e-45, np.inf, np.nan, 3e38], np.float32)
        keep = rng.random(n) < 0.7
        for mask in (None, keep):
            want = ref_sumsq(x if mask is None else np.where(mask, x, np.float32(0)), chunk)
            k = None if mask is None else torch.from_numpy(mask).cuda()
            got = chunk_sumsq(torch.from_numpy(x).cuda(), chunk, k).cpu().numpy()
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(got), nan)
            assert np.array_equal(got[~nan].view(np.uint64), want[~nan].view(np.uint64))
