"""measure.bench's plumbing: records, provenance, ratios and the table, at N = 2 on the small GPT.

Speed is never asserted: a step time on two shared cores says nothing about correctness, and
the benchmark's targets are goals reported in the README, not tests (docs/design.md §4).
"""

import dataclasses
import math
import statistics
import sys

import pytest
import torch

from measure import bench, mfu
from measure.bench import BenchConfig, run_bench
from measure.bench_table import format_memory, format_profile, format_table
from zero.common.results import SCHEMA_VERSION, read_json, write_json
from zero.ranks.local import WorkerPool, get_pool
from zero.workloads.models import GPT

SMALL = BenchConfig(
    model="small",
    systems=("zero-s0", "ddp"),
    world_sizes=(2,),
    repeats=1,
    steps=2,
    warmup=1,
    profile=True,
    retries=0,  # a test neither waits for a quiet machine nor re-times anything
    quiet_wait_s=0.0,
)


@pytest.fixture(scope="module")
def records():
    return run_bench(SMALL, pools=get_pool, say=lambda *a: None)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_records_have_the_full_config_and_provenance(records):
    assert [r["config"]["system"] for r in records] == ["zero-s0", "ddp"]
    for rec in records:
        assert rec["schema"] == SCHEMA_VERSION and rec["kind"] == bench.KIND
        c = rec["config"]
        assert c["world_size"] == c["micro_batches"] == 2  # M = N
        assert (c["precision"], c["reduce_dtype"], c["optimizer"]) == ("fp32", "fp32", "adamw")
        assert (c["lr"], c["weight_decay"], c["model"]) == (1e-3, 0.1, "small")
        assert c["gpt"]["n_layer"] == 2 and c["batch_size"] == 4 and c["seq_len"] == 64
        assert c["num_params"] == 120_576
        assert c["threads_per_rank"] == 1 and c["backend"] == "gloo" and c["device"] == "cpu"
        assert (c["repeats"], c["steps"], c["warmup"]) == (1, 2, 1)
        assert c["options"]
        p = rec["provenance"]
        for key in ("git_commit", "torch", "cpu", "cpu_count", "date_utc"):
            assert p[key] is not None, key
    ours = records[0]["config"]
    assert (ours["stage"], ours["mode"], ours["family"]) == (0, "fast", "ours")
    assert ours["options"]["deterministic"] is False
    assert ours["options"]["units"] == ["transformer.h.0", "transformer.h.1"]
    assert records[1]["config"]["family"] == "peer"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_timings_are_positive_and_complete(records):
    for rec in records:
        res = rec["result"]
        assert res["status"] == "ok"
        assert len(res["step_ms"]) == 1 and len(res["step_ms"][0]) == 2  # repeats × steps
        assert len(res["rank_step_ms"][0]) == 2  # one list per rank
        # a step's time is the slowest rank's
        for step, col in zip(res["step_ms"][0], zip(*res["rank_step_ms"][0])):
            assert step == max(col) > 0
        assert 0 < res["min_ms"] <= res["p25_ms"] <= res["median_ms"] <= res["p75_ms"]
        assert res["p75_ms"] <= res["max_ms"]
        assert all(math.isfinite(x) and x > 0 for x in res["losses"][0])
    ours, ddp = (r["result"] for r in records)
    # MFU is made of the model FLOPs (tests/unit/test_mfu.py proves them = torch's count), the
    # median step time and the peak every rank measured; both systems do the same FLOPs on one peak
    flops = mfu.step_flops(SMALL.workload.gpt, SMALL.workload.batch_size)
    for rec in records:
        res = rec["result"]
        assert rec["config"]["peak_dtype"] == "float32"
        assert res["flops_per_rank_step"] == flops
        assert len(res["rank_peak_flops"]) == 2 and min(res["rank_peak_flops"]) > 0
        assert res["peak_flops_per_rank"] == statistics.median(res["rank_peak_flops"])
        assert res["achieved_flops_per_rank"] == flops / (res["median_ms"] / 1e3)
        assert res["mfu"] == res["achieved_flops_per_rank"] / res["peak_flops_per_rank"]
    assert ours["peak_flops_per_rank"] == ddp["peak_flops_per_rank"]
    assert ddp["ratio_vs_ddp"] == 1.0
    assert ours["ratio_vs_ddp"] == pytest.approx(ours["median_ms"] / ddp["median_ms"])
    # the same model and data from the same seeds: both train the same thing
    assert len(ours["build_losses"]) == 2
    assert ours["max_abs_loss_diff_vs_ddp"] < 1e-4


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_cpu_time_per_step_and_its_table(records):
    """[Note: CPU time per step]: per repeat and rank, the timed loop's wall, CPU and kernel ms
    per step; a rank cannot use more CPU than the machine's cores in the loop's wall time, nor
    more kernel time than CPU (up to the tick of os.times on each end); the table is the
    medians and the difference to DDP's."""
    import os

    from measure.bench_table import cpu_per_step, format_cpu

    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    for rec in records:
        res = rec["result"]
        assert rec["config"]["malloc"] == "system"
        for key in ("rank_span_ms", "rank_cpu_ms", "rank_system_ms"):
            assert len(res[key]) == 1 and len(res[key][0]) == 2  # repeats × ranks
        for r in range(2):
            span, cpu = res["rank_span_ms"][0][r], res["rank_cpu_ms"][0][r]
            assert span >= statistics.mean(res["rank_step_ms"][0][r])  # the loop holds the steps
            assert 0 < cpu <= os.cpu_count() * span
            assert 0 <= res["rank_system_ms"][0][r] <= cpu + 2 * tick_ms / SMALL.steps
    head, *rows = format_cpu(records).splitlines()
    cols = head.split()
    assert cols[:4] == ["system", "N", "ms/step", "CPU"]
    ours, ddp = (cpu_per_step(r) for r in records)
    for row, cpu in zip(rows, (ours, ddp), strict=True):
        assert row.split()[3] == f"{cpu['cpu_ms']:.0f}"
        # user is CPU less kernel (exact as computed; (a - b) + b == a need not hold in floats)
        assert cpu["user_ms"] == cpu["cpu_ms"] - cpu["system_ms"]
    assert rows[0].split()[-1] == f"{ours['cpu_ms'] - ddp['cpu_ms']:+.0f}"
    assert rows[1].split()[-2:] == ["+0", "+0"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_table_has_a_ratio_column_and_rebuilds_from_json(records, tmp_path, capsys):
    table = format_table(records)
    head, *rows = table.splitlines()
    assert "×DDP" in head.split() and "ms/step" in head.split()
    col = head.split().index("MFU")
    assert [r.split()[col] for r in rows] == [f"{100 * r['result']['mfu']:.1f}%" for r in records]
    col = head.split().index("×DDP")
    assert [r.split()[col] for r in rows] == [
        f"{records[0]['result']['ratio_vs_ddp']:.2f}",
        "1.00",
    ]
    path = write_json(tmp_path / "bench.json", {"section": bench.KIND, "records": records})
    assert read_json(path)["records"] == records
    assert bench.main(["--from-json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(table + "\n")  # then the profile table
    assert format_profile(records) in printed
    md = format_table(records, markdown=True).splitlines()
    assert md[0].startswith("| system | N |") and md[1].startswith("|---|")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_profile_splits_the_step_into_phases(records):
    ours, ddp = (r["result"]["profile_ms"] for r in records)
    assert set(ddp) == {"step", "forward", "backward", "update"}
    assert {"update.reduce", "update.optimizer", "update.control", "backward.hooks"} <= set(ours)
    for prof in (ours, ddp):
        assert all(v >= 0 for v in prof.values())
        assert prof["forward"] + prof["backward"] + prof["update"] <= prof["step"]
    head, *rows = format_profile(records).splitlines()
    assert head.split()[:3] == ["system", "N", "step"] and "other" in head.split()
    assert [r.split()[0] for r in rows] == ["zero-s0", "ddp"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_deepspeed_missing_is_reported_and_the_rest_runs(monkeypatch):
    """Ranks forked from a process where `import deepspeed` fails report "not installed"."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import raises ModuleNotFoundError
    cfg = dataclasses.replace(SMALL, systems=("ddp", "deepspeed-s1"), steps=1, profile=False)
    with WorkerPool(2) as pool:  # forked now: the ranks inherit the missing module
        recs = run_bench(cfg, pools=lambda n: pool, say=lambda *a: None)
    assert [r["result"]["status"] for r in recs] == ["ok", "not installed"]
    assert "not installed" in format_table(recs).splitlines()[2]


def test_unavailable_system_is_reported_not_fatal():
    """A peer that cannot run (DeepSpeed not installed) gets a record and a table row saying so."""
    built = [{"status": "not installed"}, {"status": "not installed"}]
    rec = bench._record("deepspeed-s2", 2, SMALL, built, None, None, {"date_utc": "x"}, {}, None)
    assert rec["result"] == {"status": "not installed"}
    assert rec["config"]["stage"] == 2 and rec["config"]["family"] == "peer"
    bench.add_ratios([rec])
    row = format_table([rec]).splitlines()[1].split()
    assert row[:2] == ["deepspeed-s2", "2"] and "not installed" in " ".join(row)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"model": "huge"}, "model"),
        ({"systems": ("ddp", "megatron")}, "systems"),
        ({"systems": ("ddp", "ddp")}, "systems"),
        ({"world_sizes": (0,)}, "world_sizes"),
        ({"repeats": 0}, "repeats"),
        ({"steps": 0}, "steps"),
        ({"warmup": -1}, "warmup"),
        ({"lr": 0.0}, "lr"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"deepspeed_bucket": 0}, "deepspeed_bucket"),
        ({"deepspeed_bucket": True}, "deepspeed_bucket"),
        ({"deepspeed_bucket": 2.5e7}, "deepspeed_bucket"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BenchConfig(**kwargs)


def test_the_command_line_is_the_config(capsys):
    """Every BenchConfig field is an option (the README's spellings too); a bad value is an
    argparse error naming the field."""
    argv = ["--model", "small", "--systems", "zero-s0", "ddp", "--world-sizes", "2"]
    argv += ["--repeats", "1", "--steps", "2", "--profile", "--retries", "0", "--timeout", "60"]
    cfg, args = bench.parse([*argv, "--quiet-wait-s", "0", "--json", "out.json"])
    assert cfg == dataclasses.replace(SMALL, timeout_s=60.0) and args.json == "out.json"
    with pytest.raises(SystemExit):
        bench.parse(["--help"])
    assert "pip install deepspeed" in " ".join(capsys.readouterr().out.split())  # how to get it
    with pytest.raises(SystemExit) as exc:
        bench.parse(["--world-sizes", "0"])
    assert exc.value.code == 2 and "world_sizes=(0,)" in capsys.readouterr().err


def test_tensor_memory_peak_is_exact_on_a_known_pattern():
    """The running sum of the allocator's events: each phase's peak and end in bytes, worked
    out by hand from the sizes below; a tensor alive before the block is invisible, even when
    it is freed inside."""
    from measure.tensor_memory import tracking

    before = torch.ones(1000)
    with tracking("cpu") as (mark, trace):
        mark("a")
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(300, dtype=torch.float64)  # 2400
        del before  # allocated before the block: no event
        mark("b")
        c = torch.empty(10)  # 40: 6440 alive
        del a  # 2440
        d = torch.empty(5000, dtype=torch.uint8)  # 7440: the peak of b
        del b, d  # 40 alive at the end of b
        mark("c")
        x = torch.ones(250, requires_grad=True)  # 1000
        y = x * 2  # 1000
        y.sum().backward()  # autograd's allocations are seen: x.grad (1000) stays
        del y
    assert trace.marks == ["a", "b", "c"]
    assert trace.phase_peak[:2] == [6400, 7440] and trace.phase_end[:2] == [6400, 40]
    assert trace.end("c") == 40 + 1000 + 1000 and trace.peak("b") == 7440
    # x, y and x.grad at once, besides 0-dim float32 tensors (the sum, its seed gradient, the
    # wrapped scalar 2 and autograd's copies of it): at most 8 of those, 4 bytes each
    assert 40 + 3000 <= trace.peak_of("c") <= 40 + 3000 + 8 * 4
    del c, x
    with pytest.raises(ValueError, match="mark"):
        with tracking("cpu") as (mark, _):
            mark("a")
            mark("a")


def _timed_wait(rank, n):
    """One gloo all-to-all waited inside tracking and one outside: (seconds each wait took,
    whether Work.wait was patched inside, whether it was restored after)."""
    import time

    import torch.distributed as dist

    from measure import tensor_memory

    plain = dist.distributed_c10d.Work.wait
    x = torch.ones(8)
    took = []
    with tensor_memory.tracking("cpu") as (mark, _):
        mark("wait")
        inside = dist.distributed_c10d.Work.wait is not plain
        work = dist.all_to_all_single(torch.empty_like(x), x, async_op=True)
        t0 = time.perf_counter()
        work.wait()
        took.append(time.perf_counter() - t0)
    work = dist.all_to_all_single(torch.empty_like(x), x, async_op=True)
    t0 = time.perf_counter()
    work.wait()
    took.append(time.perf_counter() - t0)
    return took, inside, dist.distributed_c10d.Work.wait is plain


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_tracking_lets_gloo_drop_each_work_first():
    """[Note: frees on gloo's thread]: inside tracking every Work.wait() yields WAIT_SETTLE_S
    after it returns (so a wait takes at least that long), and the plain method is back after
    the block (a wait of 8 elements then takes far less: the assertion on it is only that
    the patch is gone, never a time)."""
    from measure.tensor_memory import WAIT_SETTLE_S

    with WorkerPool(2) as pool:
        for took, inside, restored in pool.run(_timed_wait):
            assert inside and restored
            assert took[0] >= WAIT_SETTLE_S


def test_model_sizes_are_the_stated_parameter_counts():
    """[Note: bench model sizes]: Ψ = V·d + T·d + L·(12d² + 13d) + 2d, against the built
    model's count, and the larger models' shorter default runs."""
    stated = {"small": 120_576, "anchor": 3_716_608, "mid": 26_334_208, "large": 100_902_912,
              "small-mp": 120_576, "mini": 675_328}  # fmt: skip
    for name, psi in stated.items():
        g = bench.MODELS[name].gpt
        d = g.n_embd
        formula = (g.vocab_size + g.block_size) * d + g.n_layer * (12 * d * d + 13 * d) + 2 * d
        assert formula == psi == GPT(g, device="meta").num_params(), name
    cfg = BenchConfig(model="large")
    assert (cfg.repeats, cfg.steps) == (3, 2) and BenchConfig(model="large", steps=1).steps == 1
    assert SMALL.workload is bench.MODELS["small"]  # the test path stays the small model


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_memory_pass_records_peaks_beside_the_analytic_states(records):
    ours, ddp = (r["result"]["memory"] for r in records)
    psi = records[0]["config"]["num_params"]
    for mem in (ours, ddp):
        assert mem["peak_bytes"] == max(mem["rank_peak_bytes"]) and len(mem["rank_peak_bytes"]) == 2
        assert mem["peak_bytes"] >= mem["resident_bytes"] > 0
        assert mem["activation_bytes"] > 0 and mem["sharding_level"] == 0
        assert mem["analytic_states_bytes"] == 16 * psi  # fp32 AdamW, stage 0: (4 + 4 + 8)Ψ
        assert mem["accounted_bytes"] == mem["analytic_states_bytes"] + mem["activation_bytes"]
        assert mem["peak_over_accounted"] == mem["peak_bytes"] / mem["accounted_bytes"]
        assert "profiler" in mem["method"]
    # our stage 0 holds at least its model states (the engine's accounting, which has padding)
    assert ours["peak_bytes"] >= ours["engine_states_bytes"] >= ours["analytic_states_bytes"]
    assert ddp["peak_vs_ddp"] == 1.0 and ddp["engine_states_bytes"] is None
    assert ours["peak_vs_ddp"] == ours["peak_bytes"] / ddp["peak_bytes"]
    assert ours["best_peer_at_level"] == "ddp" and ours["peak_vs_best_peer"] == ours["peak_vs_ddp"]
    # [Note: the memory bound] holds for the engine, and only ours has one
    assert ours["peak_bytes"] <= ours["bound_bytes"] and "bound_bytes" not in ddp
    head, *rows = format_memory(records).splitlines()
    assert head.split()[:4] == ["system", "N", "level", "peak"]
    assert [r.split()[3] for r in rows] == [f"{m['peak_bytes'] / 2**20:.2f}" for m in (ours, ddp)]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_peaks_above_its_model_states(stage):
    """Measured by the memory pass alone (no timing): stage k's peak holds at least the model
    states of the analytic model and of the engine's accounting."""
    cfg = dataclasses.replace(SMALL, systems=(f"zero-s{stage}",), profile=False)
    per_rank = get_pool(2).run(bench._memory, f"zero-s{stage}", cfg, timeout_s=120)
    psi = GPT(cfg.workload.gpt, device="meta").num_params()
    analytic = bench.analytic_states_bytes(f"zero-s{stage}", 2, psi)
    assert analytic < 16 * psi  # sharded
    for m in per_rank:
        assert m["peak_bytes"] >= m["engine_states_bytes"] >= analytic
        assert m["build_peak_bytes"] > 0


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_deepspeed_bucket_sets_its_buffers_and_its_peak():
    """--deepspeed-bucket reaches DeepSpeed's config, and its peak follows: at its default
    (5·10⁸ elements) the reduce bucket alone is 2·10⁹ bytes; sized 2**16 elements, the small
    GPT's whole step stays under 64 MiB."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed here")
    cfg = dataclasses.replace(
        SMALL, systems=("ddp", "deepspeed-s2"), steps=1, profile=False, memory=True,
        deepspeed_bucket=1 << 16,
    )  # fmt: skip
    recs = run_bench(cfg, say=lambda *a: None)
    ds = next(r for r in recs if r["config"]["system"] == "deepspeed-s2")
    assert ds["result"]["status"] == "ok", ds["result"]
    zero_cfg = ds["config"]["options"]["ds_config"]["zero_optimization"]
    assert zero_cfg["reduce_bucket_size"] == zero_cfg["allgather_bucket_size"] == 1 << 16
    assert ds["result"]["memory"]["peak_bytes"] < 64 << 20
