"""measure.budget: the search for the largest model within a budget, and the C1-C5 probes.

The search is checked against a known threshold (hypothesis); one real probe per configuration
checks the accounting that the comparison rests on: checkpoints kept in host memory are exactly
L·b·s·h bf16 elements, and only they are subtracted from the measured peak.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from measure.budget import (
    CONFIGURATIONS,
    Probe,
    Setup,
    largest_fitting,
    largest_of,
    linear_guess,
    probe,
    step_time,
)


@settings(max_examples=300, deadline=None)
@given(
    threshold=st.integers(min_value=0, max_value=5000),
    guess=st.integers(min_value=1, max_value=6000),
    resolution=st.sampled_from([0.0, 0.01, 0.05]),
)
def test_largest_fitting_brackets_the_threshold(threshold, guess, resolution):
    calls = []

    def fits(x: int) -> bool:
        calls.append(x)
        return x <= threshold

    got = largest_fitting(fits, guess=guess, resolution=resolution)
    assert got <= threshold  # what it returns fits
    if threshold == 0:
        assert got == 0
    else:
        # The final bracket [lo, hi) is at most max(1, resolution·lo) wide, hi does not fit.
        assert threshold - got < max(1, int(resolution * got))
        if resolution == 0.0:
            assert got == threshold
    assert all(x >= 1 for x in calls)


def test_largest_fitting_costs_few_probes_from_a_good_guess():
    calls = []
    got = largest_fitting(lambda x: calls.append(x) or x <= 1000, guess=990)
    # 990 fits, 1030 (990 + 4%) does not; bisecting: 1010 does not, 1000 fits, and the bracket
    # [1000, 1010) is within 1% of 1000: 4 calls.
    assert got == 1000
    assert calls == [990, 1030, 1010, 1000]


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.integers(1, 200), min_size=1, max_size=12, unique=True).map(sorted),
    threshold=st.integers(0, 210),
)
def test_largest_of_finds_the_largest_fitting_value(values, threshold):
    """Against a plain scan of the list; at most floor(log2(len)) + 1 probes."""
    calls = []
    got = largest_of(values, lambda v: calls.append(v) or v <= threshold)
    fitting = [v for v in values if v <= threshold]
    assert got == (fitting[-1] if fitting else None)
    assert len(calls) <= len(values).bit_length()


def test_largest_of_rejects_an_unsorted_list():
    with pytest.raises(ValueError, match="values="):
        largest_of([4, 2], lambda v: True)


def test_step_time_is_the_median_after_the_first_step():
    assert step_time({"step_seconds": [9.0, 2.0, 4.0, 3.0]}) == 3.0  # the first step is not used
    assert step_time({"step_seconds": [9.0, 2.0, 4.0]}) == 3.0
    with pytest.raises(ValueError, match="step_seconds="):
        step_time({"step_seconds": [1.0]})


def test_largest_fitting_rejects_a_bad_guess():
    with pytest.raises(ValueError, match="guess=0"):
        largest_fitting(lambda x: True, guess=0)


def test_linear_guess_is_where_the_line_meets_the_budget():
    small = Probe(name="C1", layers=8, batch=16, num_params=0, device_peak=40, rss_peak=40,
                  activation_host_bytes=0, model_states=0)  # fmt: skip
    large = Probe(name="C1", layers=32, batch=16, num_params=0, device_peak=64, rss_peak=64,
                  activation_host_bytes=0, model_states=0)  # fmt: skip
    assert linear_guess(small, large, 128) == 8 + 88  # 1 byte per block from 40 at 8 blocks


@pytest.mark.parametrize(
    "field,value", [("hidden", 0), ("batch", 1.5), ("budget_bytes", True), ("heads", 3)]
)
def test_setup_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field if field != "heads" else "hidden"):
        Setup(**{field: value})


def test_configurations_follow_the_papers_table_3():
    by = {c.name: c for c in CONFIGURATIONS}
    assert [c.name for c in CONFIGURATIONS] == ["C1", "C2", "C3", "C4", "C5"]
    assert (by["C1"].stage, by["C3"].stage, by["C5"].stage) == (1, 2, 2)  # P_os, P_os+g
    assert by["C2"].same_as == "C1" and by["C4"].same_as == "C3"  # P_a needs MP
    assert by["C5"].offload_activations and not by["C3"].offload_activations
    opts = by["C5"].options(Setup(contiguous_memory=False))
    assert opts["activation_checkpointing"] and opts["bucket_elements"] == 1 << 16


@pytest.mark.parametrize("name", ["C1", "C3", "C5"])
def test_probe_subtracts_exactly_the_host_checkpoints(name):
    setup = Setup(world_size=8, hidden=32, heads=1, seq=32, batch=4, contiguous_memory=False)
    conf = next(c for c in CONFIGURATIONS if c.name == name)
    layers = 3
    got = probe(setup, conf, layers=layers)
    assert len(got.step_seconds) == 2  # the peak covers the steady state: [Note: the second step]
    # One checkpoint per block: its input, b·s·h elements in the bf16 working dtype.
    checkpoints = layers * setup.batch * setup.seq * setup.hidden * 2
    if conf.offload_activations:
        assert got.activation_host_bytes == checkpoints
        assert got.device_peak == got.rss_peak - checkpoints
    else:
        assert got.activation_host_bytes == 0
        assert got.device_peak == got.rss_peak
    # The peak holds at least the model states and (on the device) the checkpoints.
    device_checkpoints = 0 if conf.offload_activations else checkpoints
    assert got.device_peak >= got.model_states + device_checkpoints
