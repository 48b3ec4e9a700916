"""C1-C5 with model parallelism on a simulated rank (paper_figures/zero_r_mp.py).

- The estimate (zero.common.memory on the slice: model states at N = N_d, checkpoints by
  checkpoint_bytes) equals what rank (0, 0) of a 4 × 4 mesh holds, category by category,
  exactly: the engine's params / grads / master / optimizer, and P_a+cpu's host parts as the
  engine counts them. P_a's all-gathers are counted as zero/mp/partitioned.py says.
- Orderings the model implies (a configuration that keeps less on the device fits at least as
  many blocks) hold for the estimate and for the committed measurement, within the search's
  resolution; the committed record's model states are the estimate's.

Legend: N_d, N_m the DP and MP degrees, L blocks, X = b·s·h one block's checkpoint (elements).
"""

import json
import math
from dataclasses import replace

import pytest

from measure.budget import Setup, configurations
from measure.mp_rank import measure_together
from paper_figures import zero_r_mp
from zero.common.memory import checkpoint_bytes

pytestmark = pytest.mark.timeout(300)

SMALL = Setup(
    world_size=4,
    mp=4,
    hidden=32,
    heads=4,
    seq=16,
    batch=2,
    vocab_size=64,
    contiguous_memory=False,
    deterministic=False,
    budget_bytes=2**30,
)
LAYERS = 2


def test_checkpoint_bytes_and_its_refusals():
    x = 2 * 16 * 32  # b·s·h
    assert checkpoint_bytes(layers=3, tokens=32, hidden=32) == 3 * x * 2
    # P_a: ⌈X/N⌉ per block, padded when N does not divide X (1024 = 3·341 + 1)
    assert checkpoint_bytes(layers=3, tokens=32, hidden=32, mp=3, partitioned=True) == 3 * 342 * 2
    for kwargs, field in (
        (dict(layers=-1, tokens=1, hidden=1), "layers"),
        (dict(layers=1, tokens=0, hidden=1), "tokens"),
        (dict(layers=1, tokens=1, hidden=1, partitioned=True), "partitioned"),
        (dict(layers=1, tokens=1, hidden=1, mp=2, partitioned=1), "partitioned"),
    ):
        with pytest.raises(ValueError, match=f"^{field}="):
            checkpoint_bytes(**kwargs)


@pytest.mark.dist
def test_estimate_equals_the_simulated_rank_by_category():
    got = measure_together(SMALL, zero_r_mp.NAMES, LAYERS, timeout_s=280)
    n, x = SMALL.mp, SMALL.batch * SMALL.seq * SMALL.hidden
    for name in zero_r_mp.NAMES:
        est, rank = zero_r_mp.estimate(SMALL, name, LAYERS), got[name]
        for key in ("params", "grads", "master", "optimizer"):
            assert rank["engine_report"][key] == est[key], (name, key)
        assert rank["padded_params"] == est["padded_params"], name
        assert rank["activation_host_bytes"] == est["checkpoints_host"], name
        # P_a: one all-gather of (N-1)·⌈X/N⌉ per block per micro-step, only where it is on
        conf = next(c for c in configurations(n) if c.name == name)
        want = LAYERS * (n - 1) * math.ceil(x / n) if conf.partition_activations else 0
        assert rank["mp_traffic"].get("p_a", 0) == want, name
    # what P_a adds to MP's traffic is its gathers alone
    for a, b in (("C1", "C2"), ("C3", "C4")):
        rest = {k: v for k, v in got[b]["mp_traffic"].items() if k != "p_a"}
        assert rest == got[a]["mp_traffic"]


def _resident(setup, name, layers):
    e = zero_r_mp.estimate(setup, name, layers)
    return e["model_states"] + e["checkpoints_device"]


@pytest.mark.parametrize("setup", [SMALL, zero_r_mp.FULL, replace(SMALL, mp=2, heads=2)])
def test_the_model_orders_the_configurations(setup):
    """What each configuration keeps resident, from the model: P_a keeps ⌈X/N_m⌉ of X per
    block (C2 < C1, C4 < C3), P_a+cpu none (C5 < C4), P_os+g less than P_os (C3 < C1)."""
    for layers in (1, 8, 64):
        r = {n: _resident(setup, n, layers) for n in zero_r_mp.NAMES}
        assert r["C2"] < r["C1"] and r["C4"] < r["C3"] < r["C1"] and r["C5"] < r["C4"] < r["C2"]
        e = zero_r_mp.estimate(setup, "C2", layers)
        assert e["checkpoints_device"] == checkpoint_bytes(
            layers=layers,
            tokens=setup.batch * setup.seq,
            hidden=setup.hidden,
            mp=setup.mp,
            partitioned=True,
        )


def _record():
    if not zero_r_mp.MEASURED.exists():
        pytest.skip(f"no committed record: {zero_r_mp.COMMAND}")
    return json.loads(zero_r_mp.MEASURED.read_text())


def test_committed_record_follows_the_model():
    """The measured largest models keep the model's order within the search's resolution
    (the search returns lo with the true boundary in [lo, lo·(1 + r)]), the five differ, and the
    engine's model states on models A and B are the estimate's."""
    rec = _record()
    setup = Setup(**rec["setup"])
    largest = {n: rec["largest"][n]["layers"] for n in zero_r_mp.NAMES}
    slack = 1 + zero_r_mp.RESOLUTION
    for small, large in (("C1", "C2"), ("C1", "C3"), ("C3", "C4"), ("C2", "C4"), ("C4", "C5")):
        assert largest[large] * slack >= largest[small], (small, large, largest)
    assert len({rec["largest"][n]["num_params"] for n in zero_r_mp.NAMES}) == 5
    for label, layers in rec["models"].items():
        for n in zero_r_mp.NAMES:
            est = zero_r_mp.estimate(setup, n, layers)
            got = rec["memory"][label][n]
            assert got["model_states"] == est["model_states"], (label, n)
            assert got["activation_host_bytes"] == est["checkpoints_host"], (label, n)
    share = zero_r_mp.p_a_share(rec)
    # fast mode: a block's 5 MP sums (2 forward, 1 recomputed, 2 backward) are ring all-reduces
    # of 2(N-1)·⌈X/N⌉ each, P_a's gather (N-1)·⌈X/N⌉: 1/10 of the blocks' sums, less with the
    # embedding's and head's traffic
    assert share is not None and 0 < share["share"] < 0.1


def test_the_committed_record_renders_with_its_index_rows(tmp_path):
    """The quick profile draws the committed record (nothing re-measured): the figure, the
    table, and INDEX.md's rows (Figure 6 and 7 at MP, P_a's traffic share beside "< 10%")."""
    from paper_figures.common import Outputs

    rec = _record()
    out = Outputs(root=tmp_path)
    path, summary = zero_r_mp.render({**rec, "section": zero_r_mp.NAME}, out)
    assert "C1-C5 at MP 16" in summary
    assert path == out.figure(zero_r_mp.NAME) and path.stat().st_size > 10_000
    text = out.table(zero_r_mp.NAME).read_text()
    assert "## Figure 6" in text and "## Figure 7" in text and "(paper §7: < 10%)" in text
    rows = zero_r_mp.index_rows(rec)
    assert [r[0][:8] for r in rows] == ["Figure 6"] * 4 + ["Figure 7"] * 4 + ["§7, P_a'"]
    assert all(len(r) == 6 for r in rows)


# glibc returns a freed heap top to the system only beyond M_TRIM_THRESHOLD (128 KiB by
# default), and VmHWM counts pages: two processes' peaks can differ by that much with no
# difference in what they hold.
ALLOCATOR_SLACK = 2 * 128 * 1024 + 2 * 4096


@pytest.mark.full
@pytest.mark.dist
def test_p_a_lowers_the_measured_peak_by_at_most_the_checkpoints_it_drops():
    """C3 and C4 differ only by P_a: C4 keeps ⌈X/N_m⌉ of each block's X and gathers one whole
    X back for a recomputation. So, measured in two fresh processes,
    -(2X + slack) <= peak(C3) - peak(C4) <= L·(X - ⌈X/N_m⌉)·2 + slack (bytes, bf16)."""
    from measure.budget import probe

    setup = replace(zero_r_mp.FULL, budget_bytes=2**30)
    layers = 32
    confs = {c.name: c for c in configurations(setup.mp)}
    c3, c4 = (probe(setup, confs[n], layers=layers) for n in ("C3", "C4"))
    x = setup.batch * setup.seq * setup.hidden
    dropped = checkpoint_bytes(
        layers=layers, tokens=setup.batch * setup.seq, hidden=setup.hidden
    ) - checkpoint_bytes(
        layers=layers,
        tokens=setup.batch * setup.seq,
        hidden=setup.hidden,
        mp=setup.mp,
        partitioned=True,
    )
    diff = c3.device_peak - c4.device_peak
    assert -(2 * x * 2 + ALLOCATOR_SLACK) <= diff <= dropped + ALLOCATOR_SLACK, (diff, dropped)


def test_bad_mp_settings_are_refused_by_name():
    from measure.fake_rank import SimulateConfig

    cases = (
        (lambda: SimulateConfig(mp=0), "^mp=0: allowed are integers >= 1"),
        (lambda: SimulateConfig(world_size=2, mp=2, rank=4), r"^rank=4: allowed are 0 \.\. "),
        (lambda: replace(SMALL, mp=3), "^heads=4: must be a multiple of mp=3"),
        (lambda: replace(SMALL, mp=True), "^mp=True: must be a positive integer"),
    )
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build()
