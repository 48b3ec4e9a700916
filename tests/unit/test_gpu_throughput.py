"""The GPU step-time figure (paper_figures/performance/gpu_throughput.py) and the benchmark's
targets line (measure/gpu_bench_table.py), on synthetic records: a CUDA record is drawn and listed
in the index, a CPU dry run never is ("not yet measured"), and each target is judged from the
records.

Legend: ms/step the median step time; ×roofline the update over its memory-bound floor.
"""

from pathlib import Path

from measure import gpu_bench_table as table
from paper_figures.common import Outputs
from paper_figures.performance import gpu_throughput as gt
from zero.common.results import make_record, write_json

NOT_MEASURED = "GPU step time: not yet measured (no committed GPU record)"


def record(system: str, ms: float, *, device="cuda:0", mfu=0.5, roofline=1.2, status="ok"):
    config = {
        "system": system,
        "device": device,
        "device_name": "NVIDIA H100" if device.startswith("cuda") else "cpu",
        "gpt": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50304},
        "num_params": 354_871_296,
        "batch_size": 8,
        "seq_len": 1024,
        "precision": "bf16",
        "peak_dtype": "bfloat16",
        "warmup": 3,
        "steps": 10,
    }
    result = {
        "status": status,
        "median_ms": ms,
        "min_ms": 0.9 * ms,
        "max_ms": 1.2 * ms,
        "mfu": mfu,
        "update_median_ms": 3.0,
        "update_over_roofline": roofline,
        "peak_allocated_bytes": 15 << 30,
        "peak_flops": 8e14,
        "copy_bandwidth": 4e12,
        "losses": [10.9, 10.1],
    }
    if status != "ok":
        result = {"status": status, "error": "CUDA out of memory"}
    return make_record(config=config, result=result, kind="bench.gpu_step", provenance={})


def run_of(**ms) -> list[dict]:
    return [record(name.replace("_", "-"), v) for name, v in ms.items()]


def test_a_cuda_record_is_drawn_and_listed(tmp_path):
    recs = run_of(ddp=60.0, zero_s0=58.0, zero_s3=90.0) + [record("fsdp2", 0, status="error")]
    png = gt.draw(recs, tmp_path / "fig.png")
    assert png == tmp_path / "fig.png" and png.stat().st_size > 0
    rows = gt.index_rows({"records": recs})
    assert [r[0].split()[3] for r in rows] == ["ddp", "zero-s0", "zero-s3"]  # the ok ones
    assert rows[1][2] == "58.0 ms, MFU 50%"
    # the section, end to end, from a committed file
    measured = tmp_path / "measured"
    write_json(measured / "bench_gpu_h100.json", {"records": recs})
    write_json(measured / "bench_gpu_cpu.json", {"records": [record("ddp", 5, device="cpu")]})
    payload = gt.compute("quick", directory=measured)
    assert len(payload["records"]) == 4 and "bench_gpu_h100.json" in payload["source"]
    out = Outputs(root=tmp_path / "out")
    path, summary = gt.render(payload, out)
    assert path == out.figure(gt.NAME) and path.stat().st_size > 0
    assert summary.startswith("3 systems timed on a GPU")
    text = out.table(gt.NAME).read_text()
    assert (
        "| zero-s0 | 58.00 [52.20-69.60] | 0.97 |" in text and "error: CUDA out of memory" in text
    )


def test_without_a_cuda_record_it_says_not_yet_measured(tmp_path):
    cpu = [record("ddp", 5.0, device="cpu"), record("zero-s0", 6.0, device="cpu")]
    assert gt.NOT_MEASURED == NOT_MEASURED
    assert gt.draw(cpu, tmp_path / "fig.png") == NOT_MEASURED
    assert gt.draw([], tmp_path / "fig.png") == NOT_MEASURED
    assert not (tmp_path / "fig.png").exists()
    assert gt.index_rows({"records": cpu}) == [[NOT_MEASURED, "–", "–", "–", "–", "–"]]
    assert gt.drawn_in({"records": cpu}) == "tables/gpu_throughput.md"
    payload = gt.compute("quick", directory=tmp_path)  # no bench_gpu*.json at all
    out = Outputs(root=tmp_path / "out")
    path, summary = gt.render(payload, out)
    assert summary == NOT_MEASURED and path == out.table(gt.NAME)
    assert NOT_MEASURED in path.read_text() and not out.figure(gt.NAME).exists()


def test_the_committed_records_are_real_gpu_runs_or_absent():
    """No fake record is committed: any bench_gpu*.json holds records of a CUDA device whose
    provenance names a GPU."""
    for path in sorted(Path(gt.MEASURED).glob(gt.PATTERN)):
        payload = gt.compute("quick", directory=path.parent)
        for r in payload["records"]:
            assert r["provenance"].get("gpu"), path


def test_the_targets_are_judged_from_the_records():
    recs = run_of(
        ddp=60.0, fsdp2_reshard=100.0, zero_s0=59.0, zero_s1=60.0, zero_s2=61.0, zero_s3=99.0,
        zero_s0_det=64.0, zero_s3_det=120.0,
    )  # fmt: skip
    found = {t: (status, values) for t, status, values in table.targets(recs)}
    assert list(found) == list(table.TARGETS)
    assert found["ours fast stages 0-2 ≤ 1.00× ddp"][0] == "not met"  # zero-s2 at 1.02×
    assert "zero-s2 1.02×" in found["ours fast stages 0-2 ≤ 1.00× ddp"][1]
    assert found["zero-s3 ≤ fsdp2-reshard"][0] == "met"
    assert found["det ≤ 1.10× the same stage's fast"][0] == "not met"  # s3: 120/99 = 1.21
    assert found["fast update ≤ 1.5× roofline"][0] == "met"  # 1.2 everywhere
    assert found["MFU ≥ 45% at stages 0-2"][0] == "met"  # 50% everywhere
    # a missing system is not judged; a CPU run is a dry run
    partial = {
        t: s for t, s, _ in table.targets([r for r in recs if "det" not in r["config"]["system"]])
    }
    assert partial["det ≤ 1.10× the same stage's fast"] == "not evaluated"
    cpu = [record("ddp", 5.0, device="cpu")]
    assert table.targets(cpu) == [] and table.format_targets(cpu) == table.DRY_RUN
    assert table.format_targets(recs).startswith("targets met: 4/6")
