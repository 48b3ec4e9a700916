"""Figure 1, Table 1 and Table 2 of the paper, re-derived, and the main job that draws them.

The expected values are the paper's printed numbers (docs/paper.md §1.1-1.3), typed in this file
again, independently of paper_figures.paper, which is checked against them too: a typo in
either shows.

Legend: Ψ = num_params, N_d = world_size (the DP column), K = 12 (mixed-precision Adam),
MP = the model-parallel degree, GB = 1e9 bytes.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from paper_figures import paper
from paper_figures.common import Outputs
from paper_figures.model_states import table1_memory
from paper_figures.paper import format_size, paper_round, table2_round
from zero.common.memory import max_model_params, model_state_bytes
from zero.common.results import read_json, write_json

REPO = Path(__file__).resolve().parents[2]

# Table 1 (docs/paper.md §1.2), as printed. Columns: 7.5B, 128B, 1T × (P_os, P_os+g, P_os+g+p).
TABLE1 = """
1    120  120  120   2048 2048 2048  16000 16000 16000
4    52.5 41.3 30    896  704  512   7000  5500  4000
16   35.6 21.6 7.5   608  368  128   4750  2875  1000
64   31.4 16.6 1.88  536  284  32    4187  2218  250
256  30.4 15.4 0.47  518  263  8     4046  2054  62.5
1024 30.1 15.1 0.12  513  257  2     4011  2013  15.6
"""
MODELS = (7.5e9, 128e9, 1e12)
TABLE1_CELLS = [
    (int(row[0]), MODELS[j // 3], 1 + j % 3, float(value))
    for row in (line.split() for line in TABLE1.strip().splitlines())
    for j, value in enumerate(row[1:])
]

# Table 2 (docs/paper.md §1.3), theoretical columns as printed (markup stripped). Stages 0..3.
TABLE2 = {
    1: ("2B", "7.6B", "14.4B", "128B"),
    2: ("4B", "15.2B", "28.8B", "256B"),
    4: ("8B", "30.4B", "57.6B", "0.5T"),
    8: ("16B", "60.8B", "115.2B", "1T"),
    16: ("32B", "121.6B", "230.4B", "2T"),
}


def test_table1_has_54_cells():
    assert len(TABLE1_CELLS) == 54


@pytest.mark.parametrize(
    ("dp", "num_params", "stage", "printed"),
    TABLE1_CELLS,
    ids=[f"DP{c[0]}-{c[1] / 1e9:g}B-stage{c[2]}" for c in TABLE1_CELLS],
)
def test_table1_cell(dp, num_params, stage, printed):
    assert paper_round(model_state_bytes(num_params, dp, stage) / 1e9) == printed


def test_paper_module_table1_transcription():
    for dp, num_params, stage, printed in TABLE1_CELLS:
        assert paper.table1_cell(dp, num_params, stage) == printed


def test_figure1():
    # Figure 1 prints one decimal throughout (1.9); Table 1 prints the stage-3 value as 1.88.
    ours = [model_state_bytes(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert [paper_round(x, fine_below=0) for x in ours] == [120, 31.4, 16.6, 1.9]
    assert paper_round(ours[3]) == 1.88
    assert paper.FIG1_GB == {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("mp", sorted(TABLE2))
@pytest.mark.parametrize("stage", range(4))
def test_table2_theoretical(mp, stage):
    printed = TABLE2[mp][stage]
    ours = table2_round(max_model_params(32e9, 64, stage, mp=mp) / 1e9, mp)
    if printed.endswith("T"):
        # T cells: ours/1000 to the printed decimals (512B -> 0.5T, 1024B -> 1T, 2048B -> 2T).
        decimals = len(printed[:-1].split(".")[1]) if "." in printed else 0
        assert format_size(ours, "T", decimals) == printed
    else:
        assert ours == float(printed[:-1])
        assert format_size(ours, "B", 0) == printed
    assert paper.TABLE2_THEORETICAL[mp][stage].text == printed


def test_table2_is_rounded_before_multiplying_by_mp():
    # 7.64B × 2 = 15.28B would round to 15.3B; the paper prints 2 × 7.6 = 15.2B.
    assert table2_round(max_model_params(32e9, 64, 1, mp=2) / 1e9, 2) == 15.2


@pytest.mark.parametrize(
    ("x", "printed"),
    [
        (41.25, 41.3),
        (1.875, 1.88),
        (4187.5, 4187),
        (2218.75, 2218),
        (2054.69, 2054),
        (513.5, 513),
        (257.75, 257),
        (0.46875, 0.47),
        (0.1171875, 0.12),
        (35.625, 35.6),
        (99.96, 100.0),  # half up to 1 decimal, not truncated: it was under 100
        (100.0, 100),
        (2.0, 2),
    ],
)
def test_paper_round(x, printed):
    assert paper_round(x) == printed


def test_python_round_is_half_to_even():
    # Why paper_round uses ROUND_HALF_UP: 41.25 is exact in binary, and Python rounds it to even.
    assert round(41.25, 1) == 41.2
    assert paper_round(41.25) == 41.3


# --- the main job --------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def table_rows(markdown: str) -> str:
    return "\n".join(line for line in markdown.splitlines() if line.startswith("|"))


def test_main_job(tmp_path):
    # The smoke profile: every section on its smallest case (make repro runs quick).
    done = subprocess.run(
        [sys.executable, "-m", "paper_figures", "--out", str(tmp_path), "--profile", "smoke"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr

    png = tmp_path / "figures" / "fig1_memory.png"
    width, height = png_size(png)
    assert width > 300 and height > 200
    assert png.stat().st_size > 10_000

    table1 = (tmp_path / "tables" / "table1_memory.md").read_text()
    assert "54/54 cells equal the paper's printed value under its rounding." in table1
    assert "5/5 bold cells where the paper has them." in table1
    assert "**31.4 (31.4)**" in table1 and "≠" not in table_rows(table1)
    table2 = (tmp_path / "tables" / "table2_max_model.md").read_text()
    assert "20/20 theoretical cells equal the paper's printed value." in table2
    assert "0.5T (0.5T)" in table2 and "≠" not in table_rows(table2)

    sim = (tmp_path / "tables" / "sim_check.md").read_text()
    assert "32/32 checks equal the formula." in sim and "≠" not in table_rows(sim)

    comm = (tmp_path / "tables" / "comm_volume.md").read_text()
    assert "16/16 cells equal the expected volume exactly." in comm
    assert "≠" not in table_rows(comm)
    for name in ("comm_volume", "activation_memory"):
        width, height = png_size(tmp_path / "figures" / f"{name}.png")
        assert width > 300 and height > 200
    ranks = (tmp_path / "tables" / "simulated_ranks.md").read_text()
    assert "1/1 ranks measured within 8 MiB + 1% of the engine's bytes." in ranks
    index = (tmp_path / "INDEX.md").read_text()
    for row in ("Figure 1, P_os+g+p", "Table 1, 54 cells", "Communication, P_os+g+p", "about 60"):
        assert row in index, row

    for name, count in [
        ("fig1_memory", 4),
        ("table1_memory", 54),
        ("table2_max_model", 20),
        ("sim_check", 16),
        ("comm_volume", 16),
        ("simulated_ranks", 2),
    ]:
        records = read_json(tmp_path / "results" / f"{name}.json")["records"]
        assert len(records) == count
        assert {"schema", "kind", "config", "result", "provenance"} <= set(records[0])
    assert not list(tmp_path.rglob("*.tmp")), "a temporary file was left behind"

    for expected in ["fig1_memory", "table1_memory", "table2_max_model", "54/54", "20/20", "4/4"]:
        assert expected in done.stdout


def test_main_job_only(tmp_path):
    from paper_figures.__main__ import main

    assert main(["--out", str(tmp_path), "--only", "table2_max_model"]) == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*")) == [
        "results/table2_max_model.json",
        "tables/table2_max_model.md",
    ]
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--only", "no_such_section"])


def test_the_default_output_is_under_runs_and_the_index_is_the_committed_one(tmp_path, monkeypatch):
    """Without --out, results, figures and tables go to runs/paper_figures/ (not into the
    package) and INDEX.md to paper_figures/INDEX.md, its links pointing back into runs/."""
    from paper_figures.__main__ import outputs

    monkeypatch.chdir(tmp_path)
    out = outputs(None)
    assert out.root == tmp_path / "runs" / "paper_figures"
    assert out.index_path == REPO / "paper_figures" / "INDEX.md"
    link = out.linked("figures/fig1_memory.png")
    assert (out.index_path.parent / link).resolve() == out.figure("fig1_memory")
    given = outputs(tmp_path / "x")
    assert given.index_path == tmp_path / "x" / "INDEX.md"
    assert given.linked("figures/fig1_memory.png") == "figures/fig1_memory.png"


def test_table1_is_drawn_from_the_records(tmp_path):
    # Change one record and the table must show it: the numbers come from the JSON, not the code.
    payload = table1_memory.compute("quick")
    cell = next(r for r in payload["records"] if r["config"]["world_size"] == 64)
    cell["result"]["bytes"] *= 1.01
    path = write_json(tmp_path / "results" / "table1_memory.json", payload)
    table_path, matches = table1_memory.render(read_json(path), Outputs(root=tmp_path))
    text = table_path.read_text()
    assert "53/54 cells equal the paper's printed value" in text
    assert table_rows(text).count("≠") == 1
    assert matches.startswith("53/54")


def test_write_json_is_atomic_and_strict(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json(path, {"a": [1, 2.5]})
    assert json.loads(path.read_text()) == {"a": [1, 2.5]}
    # An unserialisable payload leaves the old file as it was, and no temporary file.
    with pytest.raises(ValueError):
        write_json(path, {"a": float("nan")})
    with pytest.raises(TypeError):
        write_json(path, {"a": object()})
    assert read_json(path) == {"a": [1, 2.5]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_measured_ranks_reach_figure1_table1_and_the_index(tmp_path):
    """A measured rank of Figure 1's configuration (a record as simulated_ranks writes it) is
    drawn as a measured bar, shown as a measured Table 1 cell (†) and listed in INDEX.md as
    measured, with the paper's value and the ratio beside it."""
    from paper_figures import index
    from paper_figures.model_states import fig1_memory
    from zero.common.results import make_record, provenance

    out = Outputs(root=tmp_path)
    psi, n, stage = 7.5e9, 64, 3
    built = 7_518_191_616
    analytic = model_state_bytes(built, n, stage)
    measured = analytic + 5e6
    result = {
        "config": {"num_params": built},
        "rss_after_construction": measured,
        "rss_after_steps": [measured + 4e7],
        "rss_peak": 4.9e9,
        "analytic_model_states": analytic,
        "engine_model_states": analytic,
        "estimate": {"peak": 5.9e9},
    }
    config = {"num_params": psi, "world_size": n, "stage": stage, "device": "cpu"}
    ranks = {
        "records": [
            make_record(
                config=config, result=result, kind="memory.measured", provenance=provenance()
            )
        ]
    }
    fig_path = write_json(out.result("fig1_memory"), fig1_memory.compute("quick", ranks=ranks))
    _, line = fig1_memory.render(read_json(fig_path), out)
    assert "1 measured (within" in line
    t1_path = write_json(out.result("table1_memory"), table1_memory.compute("quick", ranks=ranks))
    text = table1_memory.render(read_json(t1_path), out)[0].read_text()
    assert f"{paper_round(measured / 1e9)}†".replace(".0†", "†") in text
    assert "54/54 cells equal the paper's printed value" in text
    rows = index.build(out)[0]
    assert "Figure 1, P_os+g+p, measured" in rows
    assert f"{measured / 1e9 / 1.9:.3f}" in rows  # measured over the printed 1.9 GB


def test_throughput_and_perf_model_sections_render_their_records(tmp_path):
    """The quick profile draws the committed bench measurement: one table row per record, one
    INDEX row per stage of ours, size and N that has a ×DDP (a system timed in several groups
    once; one timed only beside its fast stage none); the performance model's INDEX rows are its
    four groups
    (fitted apart from held out), each with the error its records state."""
    from measure import bench
    from paper_figures.common import Outputs
    from paper_figures.performance import perf_model, throughput

    out = Outputs(root=tmp_path)
    throughput.run(profile="quick", out=out)
    payload = json.loads(out.result("throughput").read_text())
    table = out.table("throughput").read_text().splitlines()
    # a section per model size (MEASURED's order), each a head, a rule and one row per record
    models = list(dict.fromkeys(r["config"]["model"] for r in payload["records"]))
    assert [x for x in table if x.startswith("## ")] == [f"## {m} GPT" for m in models]
    rows = [x for x in table if x.startswith("| ") and not x.startswith("| system |")]
    systems = [(x.split("|")[1].strip(), int(x.split("|")[2])) for x in rows]
    assert systems == [
        (r["config"]["system"], r["config"]["world_size"]) for r in payload["records"]
    ]
    assert models[0] == "anchor" and set(models) <= set(throughput.MEASURED)
    ours = [r for r in payload["records"] if r["config"]["system"] in bench.OURS]
    with_ddp = {
        (r["config"]["model"], r["config"]["world_size"], r["config"]["system"])
        for r in ours
        if r["result"]["status"] == "ok" and r["result"].get("ratio_vs_ddp") is not None
    }
    assert len(throughput.index_rows(payload)) == len(with_ddp)
    assert out.figure("throughput_cpu").stat().st_size > 10_000
    assert out.figure("throughput_phases").stat().st_size > 10_000  # the records have profiles
    perf_model.run(profile="quick", out=out)
    payload = json.loads(out.result("perf_model").read_text())
    rows = perf_model.index_rows(payload)
    assert sorted(r[0].split(",")[1].split("(")[0].strip() for r in rows) == [
        "fitted: Figure 4",
        "held out: Figure 2 Megatron",
        "held out: Figure 2 ZeRO",
        "held out: Figure 3",
    ]


def test_a_full_run_stopped_part_way_keeps_its_cells_and_the_earlier_ones(monkeypatch, tmp_path):
    """[Note: archived large ranks]: the archive is rewritten after every large cell, with the
    earlier run's records for the cells not reached yet; a stop leaves a whole file."""
    from paper_figures.model_states import simulated_ranks as sr

    cells = [(7.5e9, 64, 3), (7.5e9, 64, 2), (7.5e9, 64, 1)]
    monkeypatch.setattr(sr, "large_cells", lambda: list(cells))
    monkeypatch.setattr(sr, "small_cells", lambda profile: [])

    def record(psi, n, s, note):
        c = {"num_params": psi, "world_size": n, "stage": s, "device": "cpu"}
        return {"kind": "memory.measured", "config": c, "result": {"note": note}}

    calls = []

    def measure_cell(psi, n, stage, *, device, vocab, prov):
        calls.append((psi, n, stage))
        if (psi, n, stage) == cells[2]:
            raise KeyboardInterrupt  # the job is interrupted during the third cell
        return record(psi, n, stage, "new")

    monkeypatch.setattr(sr, "measure_cell", measure_cell)
    previous = {"records": [record(*c, "old") for c in cells[1:]]}
    archive = tmp_path / "measured" / "large.json"
    with pytest.raises(KeyboardInterrupt):
        sr.compute("full", previous=previous, archive=archive)
    kept = read_json(archive)["records"]
    got = [(r["config"]["stage"], r["result"]["note"], r.get("carried", False)) for r in kept]
    assert got == [(3, "new", False), (2, "new", False), (1, "old", True)]
    assert calls[0] == (sr.SMALL_PARAMS, 64, 3) and calls[1:] == cells  # the control, then these
    assert list(archive.parent.iterdir()) == [archive]  # no temporary left behind


def test_a_rank_that_times_out_is_recorded_as_skipped_with_its_reason(monkeypatch):
    import subprocess

    from measure import fake_rank as simulate
    from paper_figures.model_states import simulated_ranks as sr

    def too_slow(**kwargs):
        assert kwargs["timeout_s"] == 5.0
        raise subprocess.TimeoutExpired(cmd="measure.fake_rank", timeout=kwargs["timeout_s"])

    monkeypatch.setattr(simulate, "measure_rank", too_slow)
    monkeypatch.setattr(simulate, "fits_here", lambda est, device: (True, "estimated peak fits"))
    monkeypatch.setenv("PAPER_FIGURES_RANK_TIMEOUT_S", "5")
    rec = sr.measure_cell(1.28e11, 1024, 3, device="cpu", vocab=50257, prov={})
    assert rec["kind"] == "memory.skipped"
    assert rec["result"]["reason"] == (
        "estimated peak fits, but the rank did not finish within 5 s here"
    )
    monkeypatch.setenv("PAPER_FIGURES_RANK_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PAPER_FIGURES_RANK_TIMEOUT_S='soon'"):
        sr.measure_cell(1.28e11, 1024, 3, device="cpu", vocab=50257, prov={})
