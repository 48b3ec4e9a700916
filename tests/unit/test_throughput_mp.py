"""Figure 2's shape at our scale (paper_figures/performance/throughput_mp.py) from the committed
measurements: every size's records are complete and their counted MP traffic is docs/design.md
§6's (the performance model refuses them otherwise), the figure and table render, and the INDEX
rows name the fastest system of each size with its ratio to Megatron recomputed here from the
timings."""

import pytest

from measure.bench_table import MP_SYSTEMS
from paper_figures.common import Outputs
from paper_figures.performance import throughput_model as pm
from paper_figures.performance import throughput_mp as tm
from zero.common.results import read_json

FILES = tm.measured_files()


def test_the_committed_runs_cover_three_sizes_and_every_system():
    records = [r for f in FILES for r in read_json(f)["records"]]
    sizes = {r["config"]["model"]: r["config"]["num_params"] for r in records}
    assert len(sizes) >= 3, sizes
    for model in sizes:
        here = {r["config"]["system"] for r in records if r["config"]["model"] == model}
        assert here == set(tm.SYSTEMS), model
        for r in records:
            c = r["config"]
            assert c["world_size"] == 4 and c["note"].startswith("noisy"), c["system"]
            if c["system"] in MP_SYSTEMS:
                assert c["dp"] * c["mp"] == 4 and c["micro_batches"] == c["dp"]


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_committed_mp_counts_are_the_design_table(path):
    """Every fast MP record's counted elements per step (each rank) = mp_elements at its size;
    N_m = 1 sends none; megatron-lm's ZeRO traffic is empty (a DP group of one rank)."""
    for r in read_json(path)["records"]:
        c = r["config"]
        if c["system"] not in MP_SYSTEMS:
            continue
        counted, formula = pm.record_mp_elements(r)
        assert counted == formula, c["system"]
        per_rank = {t["elements"]["mp"] for t in r["result"]["traffic_per_step"]}
        assert per_rank == {formula}, c["system"]
        if c["system"] == "megatron-lm":
            assert {t["elements"]["model"] for t in r["result"]["traffic_per_step"]} == {0}


def test_section_renders_and_the_index_names_each_sizes_fastest(tmp_path):
    out = Outputs(root=tmp_path)
    tm.run(profile="quick", out=out)
    payload = read_json(out.result(tm.NAME))
    assert out.figure(tm.NAME).stat().st_size > 10_000
    table = out.table(tm.NAME).read_text()
    rows = tm.index_rows(payload)
    models = {r["config"]["model"] for r in payload["records"]}
    assert len(rows) == len(models)
    for model in models:
        here = [
            r
            for r in payload["records"]
            if r["config"]["model"] == model and r["config"]["system"] in MP_SYSTEMS
        ]
        best = min(here, key=lambda r: r["result"]["median_ms"])
        mega = next(r for r in here if r["config"]["system"] == "megatron-lm")
        ratio = best["result"]["median_ms"] / mega["result"]["median_ms"]
        want = f"{best['config']['system']} {ratio:.2f}"
        assert [row[2] for row in rows if f" {model} GPT" in row[0]] == [want], model
        assert f"## {model} GPT" in table
