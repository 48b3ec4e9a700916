"""python -m measure.gpu_bench's CPU dry run (the tiny GPT, gloo, N = 1), checked from its records:
every system ran, the losses agree, the roofline and MFU follow from their inputs, the table can
be printed again, a failing system is recorded and the others still run, and
tools/gpu_check.sh --dry-run runs its parts (about 60 s on 2 cores).

Speed is never asserted (a CPU step time says nothing about correctness); everything here is
computed again from the model's shape or the records' own fields.
"""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero.workloads.models import GPT, GPTConfig, gpt_flops, gpt_microbatches

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, n_head=2)  # --model tiny
BATCH, WARMUP, STEPS = 2, 1, 2
SYSTEMS = ["plain", "ddp", "fsdp2", "fsdp2-reshard", "zero-s0", "zero-s1", "zero-s2", "zero-s3"]
SYSTEMS += ["zero-s0-det", "zero-s3-det"]
# AdamW's update per parameter: read master p, g (as fp32), m, v = 16 B, write p, m, v = 12 B;
# plain and ours also write the bf16 working copy (2 B). DDP and FSDP2 cast in forward instead.
UPDATE_BYTES = {s: 28 if s == "ddp" or s.startswith("fsdp2") else 30 for s in SYSTEMS}


def bench(*args: str, code: str | None = None, timeout: float = 120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    head = ["-c", code] if code else ["-m", "measure.gpu_bench"]
    return subprocess.run(
        [sys.executable, *head, *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_bench") / "bench.json"
    args = ["--model", "tiny", "--device", "cpu", "--steps", str(STEPS), "--warmup", str(WARMUP)]
    done = bench(*args, "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(path.read_text())["records"]
    return path, done.stdout, {r["config"]["system"]: r for r in records}


def test_every_default_system_has_an_ok_record(dry_run):
    _, stdout, by = dry_run
    assert list(by) == SYSTEMS
    for name, r in by.items():
        c, res = r["config"], r["result"]
        assert r["kind"] == "bench.gpu_step" and res["status"] == "ok", (name, res)
        assert c["device"] == "cpu" and c["backend"] == "gloo" and c["precision"] == "bf16"
        assert c["gpt"]["n_layer"] == 2 and c["batch_size"] == BATCH and c["world_size"] == 1
        assert len(res["step_ms"]) == len(res["update_ms"]) == STEPS
        assert len(res["losses"]) == WARMUP + STEPS and all(map(math.isfinite, res["losses"]))
        assert res["median_ms"] == pytest.approx(statistics.median(res["step_ms"]))
        assert res["min_ms"] == min(res["step_ms"]) and res["max_ms"] == max(res["step_ms"])
        assert res["update_median_ms"] == pytest.approx(statistics.median(res["update_ms"]))
        assert all(0 < u <= s for u, s in zip(res["update_ms"], res["step_ms"]))
        assert res["peak_allocated_bytes"] is None  # not measured on a CPU, and says so
        assert "not measured" in res["peak_memory"]
    assert "dry run on cpu: targets not evaluated" in stdout
    # one peak and one bandwidth per run, in every record
    assert len({r["result"]["peak_flops"] for r in by.values()}) == 1
    assert len({r["result"]["copy_bandwidth"] for r in by.values()}) == 1


def test_first_step_losses_agree_with_the_plain_loop(dry_run):
    """Step 0 starts from the same weights (seed 0) on the same batch everywhere, so the losses
    differ only by how bf16 computes them. The bound, derived:
    - the plain loop's loss is bf16: cross-entropy rounds each token's log-softmax and then the
      mean to bf16, two roundings of values in [4, 8), where an ulp is 2^-5: at most 2 · 2^-6;
    - a system computing its logits z differently (DDP: autocast keeps LayerNorm and the residual
      stream in fp32) moves the loss by at most 2·max|Δz| (the cross-entropy's gradient in z has
      an L1 norm of at most 2 per token); to first order each of the ~12 bf16 roundings per block
      on the path to a logit (LayerNorms, matmuls, softmax, GELU, adds), plus 4 outside the
      blocks, moves z by at most u = 2^-8 of max|z|, taken here from the fp32 model."""
    _, _, by = dry_run
    x, y = gpt_microbatches(TINY, seed=0, data_step=0, count=1, batch_size=BATCH)[0]
    with torch.no_grad():
        z, fp32_loss = GPT(TINY, seed=0)(x, y)
    roundings = 12 * TINY.n_layer + 4
    bound = 2 * 2.0**-6 + 2 * roundings * 2.0**-8 * float(z.abs().max())
    plain = by["plain"]["result"]["losses"][0]
    assert 4 <= plain < 8 and abs(plain - float(fp32_loss)) <= bound
    off = {s: r["result"]["losses"][0] - plain for s, r in by.items()}
    assert all(abs(d) <= bound for d in off.values()), (off, bound)


def test_the_deterministic_stages_give_the_same_bits(dry_run):
    """Deterministic mode is the reference's step at every stage: zero-s0-det and zero-s3-det
    must give the same losses, every step, bit for bit."""
    _, _, by = dry_run
    det0, det3 = (by[s]["result"]["losses"] for s in ("zero-s0-det", "zero-s3-det"))
    assert [x.hex() for x in det0] == [x.hex() for x in det3]


def test_the_roofline_is_bytes_times_params_over_the_copy_bandwidth(dry_run):
    _, _, by = dry_run
    psi = sum(p.numel() for p in GPT(TINY, device="meta").parameters())  # tied head once
    for name, r in by.items():
        res = r["result"]
        want = 1e3 * UPDATE_BYTES[name] * psi / res["copy_bandwidth"]
        assert r["config"]["num_params"] == psi
        assert res["roofline_bytes_per_param"] == UPDATE_BYTES[name], name
        assert res["roofline_ms"] == pytest.approx(want, rel=1e-12), name
        assert res["update_over_roofline"] == pytest.approx(res["update_median_ms"] / want)


def test_mfu_is_model_flops_over_step_time_over_peak(dry_run):
    _, _, by = dry_run
    gpt = (BATCH, TINY.block_size, TINY.n_layer, TINY.n_embd, TINY.vocab_size)
    flops = gpt_flops(*gpt, recompute=False)
    for name, r in by.items():
        res = r["result"]
        assert res["flops_per_step"] == flops, name
        want = res["flops_per_step"] / (res["median_ms"] / 1e3) / res["peak_flops"]
        assert res["mfu"] == pytest.approx(want, rel=1e-12), name


def test_from_json_prints_a_table_naming_every_system(dry_run):
    path, _, _ = dry_run
    done = bench("--from-json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| system | ms/step (median [min-max]) | ×ddp | MFU | peak GiB |")
    assert [r.split("|")[1].strip() for r in rows[1:]] == SYSTEMS
    assert "dry run on cpu: targets not evaluated" in done.stdout


def test_a_system_that_raises_is_recorded_and_the_others_still_run(tmp_path):
    path = tmp_path / "b.json"
    code = (
        "import sys\n"
        "from measure import gpu_bench, gpu_systems as g\n"
        "real = g.Ours.update\n"
        "def update(self):\n"
        "    if self.engine.config.stage == 1:\n"
        "        raise RuntimeError('planted failure')\n"
        "    real(self)\n"
        "g.Ours.update = update\n"
        "sys.exit(gpu_bench.main(sys.argv[1:]))\n"
    )
    args = ["--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--json"]
    done = bench(*args, str(path), "--systems", "plain", "zero-s1", "zero-s2", code=code)
    assert done.returncode == 1, done.stderr[-3000:]  # not every system measured
    by = {r["config"]["system"]: r["result"] for r in json.loads(path.read_text())["records"]}
    assert [by[s]["status"] for s in ("plain", "zero-s1", "zero-s2")] == ["ok", "error", "ok"]
    assert by["zero-s1"]["error"] == "planted failure"
    assert "| zero-s1 | error: planted failure |" in done.stdout


def test_the_gpu_check_dry_run_runs_every_part(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.rstrip().splitlines()
    head = lines.index("| part | exit code | seconds | log file |")
    summary = lines[head:]  # the summary table is printed last
    assert len(summary) == 2 + 8
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in summary[2:]}
    parts = ["env", "gpu", "bench", "verify", "hostwork", "fast", "gloo2x", "figures"]
    assert list(rows) == parts
    assert rows["env"] == "0" and rows["bench"] == "0" and rows["gpu"].startswith("skipped")
    assert rows["verify"] not in ("124", "137")  # finished within its time (its result: verify's)
    # the new parts' CPU stand-ins: lock-step cells under torchrun, local gloo pools at N = 1, 2
    # with their invariance, and a simulated rank measured
    assert rows["fast"] == rows["gloo2x"] == rows["figures"] == "0", done.stdout[-3000:]
    assert "12/12 cells passed" in (out / "fast.log").read_text()
    gloo = (out / "gloo2x.log").read_text()
    assert "ranks: backend gloo, device cpu (local worker pools)" in gloo
    assert "4/4 cells passed" in gloo and "world_size_invariance: 12/12 passed" in gloo
    assert (out / "figures" / "results" / "simulated_ranks.json").is_file()
    records = json.loads((out / "bench_gpu.json").read_text())["records"]
    assert [r["config"]["system"] for r in records] == SYSTEMS
    assert all(r["config"]["device"] == "cpu" for r in records)
    assert "| zero-s3-det |" in done.stdout and (out / "summary.md").is_file()


def test_the_offload_check_dry_run_trains_both_models(tmp_path):
    """tools/gpu_check.sh --dry-run --offload: measure.largest's two parts on the CPU (small
    shapes), each a record with its parameters, RSS per parameter and host bytes per
    parameter at the floor: 16 (master, m, v, fp32 gradient) + two bf16 staging slots of the
    largest unit (4 bytes per its element; here the root: embeddings and the last norm), plus
    at most the padding (each unit to whole 4096-element chunks, each parameter to 256 bytes)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--dry-run", "--offload"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.rstrip().splitlines()
    rows = lines[lines.index("| part | exit code | seconds | log file |") + 2 :]
    assert [r.split("|")[1].strip() for r in rows] == ["env", "largest25", "largest7b"]
    assert all(r.split("|")[2].strip() == "0" for r in rows)
    from measure.largest import BLOCK, VOCAB

    for name, layers in (("largest25", 4), ("largest7b", 6)):
        (rec,) = json.loads((out / f"{name}.json").read_text())["memory"]
        assert rec["layers"] == layers and "failed" not in rec
        psi, d = rec["params"], rec["width"]
        root = (VOCAB + BLOCK + 2) * d  # wte, wpe, ln_f (a block: 12d² + 13d, smaller here)
        floor = 16 * psi + 4 * root
        pad = (layers + 1) * 4096 * 20 + 64 * 20 * (12 * layers + 4)  # bytes, generous
        assert floor <= rec["split_bytes"]["host"] <= floor + pad, (rec["split_bytes"], floor)
        assert len(rec["step_s"]) == 2
