"""Host work per step flat in the model's size ([Note: host work flat in Ψ], measure/hostwork.py):
at a fixed number of units, one step's Python calls, aten operators, device→host reads and
tensors made from host data are the same counts at two widths, at every stage and in both
modes; the only read is the control exchange's; and the count can fail: the norm's tree summed
by the reference's recursion grows with the number of chunk partials."""

import pytest

from measure import hostwork
from zero import control
from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(600)

WIDTHS = (64, 128)  # Ψ = 3.3M and 6.7M with the GPT-2 vocabulary: 811 and 1,622 chunk partials
LAYERS = 2
CASES = [(s, det) for s in range(4) for det in (False, True)]


def counts_at_two_widths(rank, n, cases):
    out = {}
    for stage, det in cases:
        for width in WIDTHS:
            psi, counts = hostwork.measure(width, LAYERS, stage, det)
            out[(stage, det, width)] = (psi, counts)
    return out


def recursive_tree_counts(rank, n):
    """The same step with the norm's final sum in the reference's recursive Python."""
    import numpy as np

    from reference.tree import tree_sum

    saved = control.tree_total
    control.tree_total = lambda x: tree_sum(list(x)) if len(x) else np.float64(0.0)
    try:
        return {w: hostwork.measure(w, LAYERS, 0, False)[1]["step"].calls for w in WIDTHS}
    finally:
        control.tree_total = saved


NODE_OPTIONS = {  # at N = 4: two simulated nodes of two ranks
    "ZeRO++": {"ranks_per_node": 2, "hpz": True, "qwz_bits": 8, "qgz_bits": 4},
    "HSDP": {"ranks_per_node": 2, "shard_group_size": 2},
}


def node_counts(rank, n, options):
    return {w: hostwork.measure(w, LAYERS, 3, True, options=options) for w in WIDTHS}


@pytest.fixture(scope="module")
def measured():
    (out,) = get_pool(1).run(counts_at_two_widths, CASES)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("stage, det", CASES)
def test_one_steps_host_work_does_not_grow_with_the_model(measured, stage, det):
    (psi_a, a), (psi_b, b) = (measured[(stage, det, w)] for w in WIDTHS)
    assert psi_b > 1.9 * psi_a  # the two models really differ in size
    for phase in hostwork.PHASES:
        got = [(c.calls, c.ops, c.reads, c.makes) for c in (a[phase], b[phase])]
        assert got[0] == got[1], (phase, got)


@pytest.mark.dist
@pytest.mark.parametrize("stage, det", CASES)
def test_the_step_reads_the_device_once_in_the_control_exchange(measured, stage, det):
    """Forward and backward read nothing back (the loss stays on the device until the step);
    the step reads once: the exchange's .cpu() (and .numpy() of that host copy). No tensor is
    made from host data with a device (a blocking copy on CUDA)."""
    _, counts = measured[(stage, det, WIDTHS[1])]
    assert counts["forward"].reads == counts["backward"].reads == 0
    assert dict(counts["step"].read_sites) == {
        ("cpu", "zero/control.py:exchange"): 1,
        ("numpy", "zero/control.py:exchange"): 1,
    }
    assert sum(counts[p].makes for p in hostwork.PHASES) == 0


@pytest.mark.dist
def test_the_count_catches_a_tree_summed_in_python():
    """The check can fail: with the reference's recursive tree_sum in place of the vectorised
    one, the step's Python calls grow with the number of partials (about 2 calls per partial)."""
    (calls,) = get_pool(1).run(recursive_tree_counts)
    small, large = (calls[w] for w in WIDTHS)
    assert large - small > 2 * 800  # 811 more partials at the larger width


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(NODE_OPTIONS))
def test_node_aware_options_keep_host_work_flat(name):
    """Stage 3 at N = 4 on two simulated nodes, deterministic, with ZeRO++ (hpZ, qwZ int8, qgZ
    int4: quantizing, packing and two hops per unit) or HSDP (groups of 2): every rank's counts
    are the same at both widths; backward reads nothing back, forward only the watchdog's
    fingerprints, the step only the control exchange."""
    per_rank = get_pool(4).run(node_counts, NODE_OPTIONS[name])
    for measured_here in per_rank:
        (psi_a, a), (psi_b, b) = (measured_here[w] for w in WIDTHS)
        assert psi_b > 1.9 * psi_a
        for phase in hostwork.PHASES:
            got = [(c.calls, c.ops, c.reads, c.makes) for c in (a[phase], b[phase])]
            assert got[0] == got[1], (name, phase, got)
        assert b["backward"].reads == 0
        # at N > 1 the watchdog checks its all-gathered fingerprints at each micro-step's
        # forward and before the step ([Note: collective fingerprints], zero/ranks/watchdog.py)
        watchdog = ("tolist", "zero/ranks/watchdog.py:_check")
        assert dict(b["forward"].read_sites) == {watchdog: 1}
        assert dict(b["step"].read_sites) == {
            watchdog: 1,
            ("cpu", "zero/control.py:exchange"): 1,
            ("numpy", "zero/control.py:exchange"): 1,
        }
