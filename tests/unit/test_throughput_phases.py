"""paper_figures.performance.throughput.phase_figure draws the per-phase stacked bars from bench
records: each bar's segments are the record's phases (measure.bench_table.phase_parts), in
order."""

import numpy as np
import pytest

from measure import bench_table
from paper_figures.performance import throughput


def record(system: str, n: int, prof: dict | None) -> dict:
    result = {"status": "ok"} | ({"profile_ms": prof} if prof else {})
    return {"config": {"system": system, "world_size": n, "model": "small"}, "result": result}


OURS = {
    "step": 100.0,
    "forward": 30.0,
    "backward": 50.0,
    "backward.hooks": 6.0,
    "backward.finalize": 4.0,
    "update": 18.0,
    "update.reduce": 5.0,
    "update.optimizer": 7.0,
    "update.control": 2.0,
}
PEER = {"step": 90.0, "forward": 31.0, "backward": 44.0, "update": 12.0}


def test_parts_are_disjoint_and_sum_to_the_phases():
    ours = bench_table.phase_parts(record("zero-s0", 2, OURS))
    assert list(ours) == [k for k, _ in bench_table.PHASE_PARTS]
    assert ours["backward.rest"] == 40.0 and ours["update.other"] == 4.0  # 18 - 5 - 7 - 2
    assert sum(ours.values()) == OURS["forward"] + OURS["backward"] + OURS["update"]
    peer = bench_table.phase_parts(record("ddp", 2, PEER))
    assert peer["backward.rest"] == 44.0 and peer["update.other"] == 12.0
    assert peer["update.optimizer"] == 0.0 and sum(peer.values()) == 87.0
    assert bench_table.phase_parts(record("ddp", 2, None)) == {}


def test_figure_is_drawn_from_the_records():
    recs = [
        record("zero-s0", 2, OURS),
        record("ddp", 2, PEER),
        record("zero-s0", 4, OURS),
        record("fsdp2", 4, None),  # not profiled: left out
    ]
    fig = throughput.phase_figure(recs)
    axes = fig.axes
    assert len(axes) == 2
    for ax, n in zip(axes, (2, 4)):
        assert ax.get_title().startswith(f"N = {n}, small GPT")
        assert ax.get_xlabel().startswith("ms per step") and ax.get_ylabel() == "system"
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert labels == ["zero-s0", "ddp"]
    # the segments, part by part: widths are the record's parts, each starting where the last ended
    bars = axes[0].patches
    parts = [bench_table.phase_parts(r) for r in recs[:2]]
    keys = [k for k, _ in bench_table.PHASE_PARTS]
    assert len(bars) == len(keys) * 2
    for j, key in enumerate(keys):
        for i in range(2):
            bar = bars[2 * j + i]
            assert bar.get_width() == parts[i][key]
            assert bar.get_x() == sum(parts[i][k] for k in keys[:j])  # same order of sums
    assert axes[0].get_legend() is None  # one legend, right of the last panel (outside it)
    assert (
        axes[-1].get_legend().get_bbox_to_anchor().transformed(axes[-1].transAxes.inverted()).x0 > 1
    )
    legend = [t.get_text() for t in axes[-1].get_legend().get_texts()]
    assert legend == [label for _, label in bench_table.PHASE_PARTS]
    assert "phase by phase" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="records"):
        throughput.phase_figure([record("ddp", 2, None)])


def test_one_panel_per_model_size_and_n():
    """Records of several model sizes (the measured files of MEASURED, one per size): a panel for
    each (size, N) present, sizes in MEASURED's order whatever the records' order, and a size
    without a record at some N leaves that cell out rather than drawing another size's there."""

    def rec(model, system, n):
        r = record(system, n, OURS if system.startswith("zero") else PEER)
        r["config"]["model"] = model
        return r

    recs = [rec("mid", "zero-s0", 2), rec("anchor", "zero-s0", 4), rec("anchor", "ddp", 2)]
    recs.append(rec("anchor", "zero-s0", 2))
    keys = [(m, n) for m, n, _ in throughput.panels(recs)]
    assert keys == [("anchor", 2), ("anchor", 4), ("mid", 2)]
    fig = throughput.phase_figure(recs)
    titles = [ax.get_title() for ax in fig.axes]
    assert [t.split(" GPT")[0] for t in titles] == ["N = 2, anchor", "N = 4, anchor", "N = 2, mid"]
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["ddp", "zero-s0"]  # the anchor's N = 2 records only, in record order


def test_a_system_in_several_groups_is_drawn_once():
    recs = [_timed("ddp", 200.0, "a"), _timed("zero-s3", 210.0, "a"), _timed("ddp", 100.0, "b")]
    ((_, _, here),) = throughput.panels(recs)
    assert [(r["config"]["system"], r["config"]["group"]) for r in here] == [
        ("ddp", "a"),
        ("zero-s3", "a"),
    ]


def test_a_system_is_drawn_from_the_group_that_has_its_ddp_ratio():
    """A system timed in a group without `ddp` (beside its deterministic stage only) has no ×DDP
    there: the panel takes it from the group that has one, whichever came first."""
    recs = [
        _timed("zero-s0", 105.0, "fast-det"),
        _timed("zero-s0-det", 110.0, "fast-det"),
        _timed("ddp", 100.0, "plain"),
        _timed("zero-s0", 99.0, "plain"),
    ]
    bench_table.add_ratios(recs)
    ((_, _, here),) = throughput.panels(recs)
    got = {
        r["config"]["system"]: (r["config"]["group"], r["result"].get("ratio_vs_ddp")) for r in here
    }
    assert got["zero-s0"] == ("plain", 0.99)
    assert got["zero-s0-det"] == ("fast-det", None)  # kept in the panel's records, not drawn


def test_ratio_noise_is_the_quartiles_over_rounds():
    """×DDP/round and ×fast/round: the ratio round by round (each round's medians, paired), and
    its quartiles in the table; DDP against itself is exactly 1 in every round."""

    def rec(system, medians):
        return {
            "config": {"system": system, "world_size": 2, "model": "small"},
            "result": {
                "status": "ok",
                "median_ms": float(np.median(medians)),
                "p25_ms": 0.0,
                "p75_ms": 0.0,
                "repeat_medians_ms": medians,
                "build_losses": [],
                "first_data_steps": [],
                "losses": [],
            },
        }

    recs = [
        rec("ddp", [100.0, 200.0, 100.0, 200.0, 100.0]),
        rec("zero-s1", [110.0, 180.0, 90.0, 220.0, 100.0]),
        rec("zero-s1-det", [121.0, 180.0, 99.0, 220.0, 100.0]),
    ]
    bench_table.add_ratios(recs)
    fast, det = recs[1]["result"], recs[2]["result"]
    assert fast["ratio_vs_ddp_by_repeat"] == [1.1, 0.9, 0.9, 1.1, 1.0]
    assert det["ratio_vs_fast_by_repeat"] == [1.1, 1.0, 1.1, 1.0, 1.0]
    assert "ratio_vs_fast_by_repeat" not in fast
    head, _, *rows = bench_table.format_table(recs, markdown=True).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    at, atf = cols.index("×DDP/round"), cols.index("×fast/round")
    # numpy's linear quartiles (the 2nd and 4th of 5 sorted values): zero-s1 over DDP
    # [0.9, 0.9, 1.0, 1.1, 1.1]; zero-s1-det over DDP [0.9, 0.99, 1.0, 1.1, 1.21]; over fast
    # [1.0, 1.0, 1.0, 1.1, 1.1]
    assert [c[at] for c in cells] == ["1.00-1.00", "0.90-1.10", "0.99-1.10"]
    assert [c[atf] for c in cells] == ["—", "—", "1.00-1.10"]


def _timed(system, median, group, peak=None):
    result = {
        "status": "ok",
        "median_ms": median,
        "repeat_medians_ms": [median],
        "build_losses": [],
        "first_data_steps": [],
        "losses": [],
    }
    if peak is not None:
        result["memory"] = {"peak_bytes": peak, "analytic_states_bytes": 1, "activation_bytes": 1}
    config = {"system": system, "world_size": 2, "model": "large", "group": group, **_ANCHOR}
    if system.startswith("zero-s"):
        config["stage"] = int(system[6])
        config["options"] = {"chunk": 4096, "deterministic": system.endswith("-det")}
    return {"config": config, "result": result}


_ANCHOR = {
    "gpt": {"vocab_size": 2048, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256},
    "batch_size": 8,
    "seq_len": 128,
}
"""The anchor GPT's shape, as a record's config holds it."""


def test_memory_bound_terms_by_hand():
    """[Note: the memory bound] at the anchor GPT (d 256, 4 blocks, V 2048, T 128, B 8), N = 2,
    chunks of 4096, worked out by hand. Every parameter of a block is a multiple of 64
    elements, so the block's layout is its 789,760 elements, rounded up to 193 chunks; L is
    97 chunks (397,312) and N·L 794,624 elements: G_b = 3,178,496 bytes. The root (wte
    524,288 + wpe 32,768 + ln_f 512 = 557,568) is 137 chunks, L 69 chunks, G_r = 4·2·282,624
    = 2,260,992. The whole padded model Σ = G_r + 4·G_b = 14,974,976 bytes; X = 8·128·2048·4
    = 8,388,608."""
    g_b, g_r, x = 3_178_496, 2_260_992, 8_388_608
    whole = g_r + 4 * g_b
    want = {
        "zero-s0": dict(reductions=0, held=0, gathered=0, step=2 * whole),
        "zero-s0-det": dict(reductions=2 * g_b, held=whole / 2, gathered=0, step=2 * whole),
        "zero-s1": dict(reductions=2 * g_b, held=0, gathered=0, step=3 * whole / 2),
        "zero-s2-det": dict(reductions=4 * g_b, held=0, gathered=0, step=3 * whole / 2),
        "zero-s3": dict(reductions=4 * g_b, held=0, gathered=g_r + 2 * g_b, step=whole),
    }
    for system, terms in want.items():
        got = bench_table.memory_bound(_timed(system, 1.0, "")["config"])
        assert got == {"loss": 3 * x, "waiting": g_r + g_b, **terms}, system
    assert bench_table.memory_bound(_timed("ddp", 1.0, "")["config"]) is None


def test_bound_is_states_plus_the_larger_of_backward_and_step():
    """The record's bound: S + max(A + loss + the backward terms, step); ÷bound the peak over
    it. With one sequence per micro-batch (X = 1,048,576) and activations of 1 byte the step
    term (2Σ at stage 0) is the larger; with 8 and a large A the backward sum is."""
    whole, waiting = 2_260_992 + 4 * 3_178_496, 2_260_992 + 3_178_496
    for batch, acts, expect in ((1, 1, 2 * whole), (8, 10**9, 10**9 + 3 * 8_388_608 + waiting)):
        rec = _timed("zero-s0", 1.0, "", peak=5 * 10**8)
        rec["config"]["batch_size"] = batch
        rec["result"]["memory"].update(analytic_states_bytes=7, activation_bytes=acts)
        bench_table.add_ratios([rec])
        mem = rec["result"]["memory"]
        assert mem["bound_bytes"] == 7 + expect
        assert mem["peak_over_bound"] == 5 * 10**8 / (7 + expect)


def test_groups_pair_time_within_a_run_and_peers_through_ddp():
    """[Note: system groups]: ×DDP and ×fast use the record's own group; a peer in another group
    is compared as the quotient of the two ×DDP; memory compares across groups directly."""
    recs = bench_table.merge_records(
        [
            [_timed("ddp", 200.0, "a", 50), _timed("zero-s3", 210.0, "a", 20)],
            [_timed("ddp", 400.0, "b", 50), _timed("zero-s3-det", 440.0, "b", 21)],
            [_timed("ddp", 100.0, "c", 50), _timed("fsdp2-reshard", 125.0, "c", 25)],
        ]
    )
    bench_table.add_ratios(recs)
    s3, s3det, fsdp = (r["result"] for r in (recs[1], recs[3], recs[5]))
    assert s3["ratio_vs_ddp"] == 210 / 200 and s3det["ratio_vs_ddp"] == 440 / 400
    assert fsdp["ratio_vs_ddp"] == 125 / 100
    assert "ratio_vs_fast" not in s3det  # its fast stage ran in another group: no pairing
    assert s3["ratio_vs"]["fsdp2-reshard"] == (210 / 200) / (125 / 100)
    assert s3["memory"]["best_peer_at_level"] == "fsdp2-reshard"
    assert s3["memory"]["peak_vs_best_peer"] == 20 / 25
    assert s3det["memory"]["peak_vs_ddp"] == 21 / 50


def test_one_run_compares_its_medians_directly():
    recs = [_timed("ddp", 200.0, ""), _timed("zero-s3", 210.0, ""), _timed("fsdp2", 300.0, "")]
    bench_table.add_ratios(recs)
    assert recs[1]["result"]["ratio_vs"]["fsdp2"] == 210 / 300


def test_a_system_measured_twice_in_one_group_is_refused():
    with pytest.raises(ValueError, match=r"'ddp' at N = 2 in group 'a' appears twice"):
        bench_table.merge_records([[_timed("ddp", 1.0, "a")], [_timed("ddp", 2.0, "a")]])


def test_targets_table_reads_each_ratio_against_its_target():
    """format_targets: fast stages 0-2 against 1.00× DDP, stage 3 against 1.05×, deterministic
    stages against 1.03× their fast stage; a record without the ratio (its pair ran in another
    group) gives no row, and a peer none at all."""
    recs = [
        _timed("ddp", 100.0, "a"),
        _timed("zero-s2", 101.0, "a"),
        _timed("zero-s3", 105.0, "a"),
        _timed("zero-s3-det", 108.0, "a"),
        _timed("zero-s1-det", 50.0, "b"),
    ]
    for r in recs:
        r["result"]["repeat_medians_ms"] = [r["result"]["median_ms"]] * 2
    bench_table.add_ratios(recs)
    head, *rows = bench_table.format_targets(recs).splitlines()
    cells = [r.split() for r in rows]
    # records of named groups: each row names its group (a system may stand in several)
    assert head.split() == [
        "model",
        "N",
        "system",
        "group",
        "ratio",
        "per",
        "round",
        "target",
        "met",
    ]
    # 101/100 over 1.00; 105/100 at 1.05; 108/105 = 1.029 within 1.03
    assert [(c[2], c[3], c[4], c[-1]) for c in cells] == [
        ("zero-s2", "a", "1.01", "no"),
        ("zero-s3", "a", "1.05", "yes"),
        ("zero-s3-det", "a", "1.03", "yes"),
    ]
    for r in recs:
        r["config"]["group"] = ""  # one run: no group column
    head = bench_table.format_targets(recs).splitlines()[0]
    assert head.split() == ["model", "N", "system", "ratio", "per", "round", "target", "met"]
    assert "group" not in bench_table.format_memory(recs).splitlines()[0].split()
