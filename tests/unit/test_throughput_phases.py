"""paper_figures.throughput.phase_figure draws the per-phase stacked bars from bench records:
each bar's segments are the record's phases (measure.bench_table.phase_parts), in order."""

import pytest

from measure import bench_table
from paper_figures import throughput


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
    legend = [t.get_text() for t in axes[-1].get_legend().get_texts()]
    assert legend == [label for _, label in bench_table.PHASE_PARTS]
    assert "phase by phase" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="records"):
        throughput.phase_figure([record("ddp", 2, None)])
