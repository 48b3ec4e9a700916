"""A stopped rank named in seconds, and never a slow one ([Note: a stopped rank named in seconds],
zero/ranks/watchdog.py): the rule that names a silent peer, the clock that measures its silence,
and how a rank's end is described. No processes here; tests/distributed/test_watchdog.py runs the
same with real ranks."""

import signal

import pytest

from zero.ranks import beacon, signals, watchdog
from zero.ranks.beacon import BEAT_S
from zero.ranks.watchdog import SILENT_S, STOPPED_S, judge_silence


def test_the_bounds_are_derived_from_the_heartbeat_period():
    # two missed beats for a process seen stopped; twenty for one that cannot be seen
    assert STOPPED_S == 2 * BEAT_S and SILENT_S == 20 * BEAT_S
    assert watchdog.SLICE_S == BEAT_S / 2


REC = {"state": "running", "beats": 7, "pid": 1, "host": "h", "launched": [0, ""], "call": ""}


@pytest.mark.parametrize(
    "quiet, state, named",
    [
        (STOPPED_S - 0.01, "stopped", False),  # just under two beats: not yet
        (STOPPED_S, "stopped", True),
        (STOPPED_S, "gone", True),
        (STOPPED_S, "", False),  # beating late, or on another host: not at two beats
        (SILENT_S - 0.01, "", False),
        (SILENT_S, "", True),  # twenty beats missed, whatever the state
        (0.0, "stopped", False),  # stopped, but it beat a moment ago: not yet silent
    ],
)
def test_a_peer_is_named_only_past_its_bound(quiet, state, named):
    seen, why = judge_silence({1: (REC, quiet, state), 2: (REC, 0.0, "")})
    assert seen[1] == (REC, not named) and seen[2] == (REC, True)
    assert len(why) == int(named)
    if named:
        assert why[0].startswith("rank 1's heartbeat has not advanced for")
        assert (f"its process is {state}" in why[0]) == bool(state)


def test_a_peer_that_never_published_is_left_to_the_timeout():
    seen, why = judge_silence({3: (None, 1e9, "gone")})
    assert why == [] and seen[3] == (None, True)


class _Board:
    """A transport that returns what the test wrote."""

    def __init__(self):
        self.records = {}

    def put(self, rank, text):
        pass

    def get(self, rank):
        import json

        rec = self.records.get(rank)
        return None if rec is None else json.dumps(rec)


def test_silence_is_measured_on_this_ranks_clock_from_the_first_reading(monkeypatch):
    board, now = _Board(), [100.0]
    monkeypatch.setattr(beacon.time, "monotonic", lambda: now[0])
    b = beacon.Beacon.__new__(beacon.Beacon)  # no heartbeat thread: only the reading side
    b.transport, b._seen = board, {}
    assert b.silence(1) == (None, 0.0)  # nothing published yet
    board.records[1] = {"beats": 4, "pid": 10}
    assert b.silence(1)[1] == 0.0
    now[0] = 101.5
    assert b.silence(1)[1] == 1.5  # the same counter 1.5 s later
    board.records[1] = {"beats": 5, "pid": 10}
    now[0] = 102.0
    assert b.silence(1)[1] == 0.0  # it beat: silence starts over
    now[0] = 103.0
    board.records[1] = {"beats": 5, "pid": 11}  # restarted under another pid, same count
    assert b.silence(1)[1] == 0.0


@pytest.mark.parametrize(
    "code, before, after, words",
    [
        (3, None, None, "exit code 3"),
        (-signal.SIGTERM, 0, 0, "signal 15 (SIGTERM)"),
        (-signal.SIGKILL, 4, 5, "out of memory most likely"),
        (-signal.SIGKILL, 4, 4, "killed from outside (the kernel's out-of-memory killer"),
        (-signal.SIGKILL, None, None, "or by the kernel when out of memory"),
    ],
)
def test_a_ranks_end_says_its_signal_and_out_of_memory_where_likely(
    code, before, after, words, monkeypatch
):
    monkeypatch.setattr(signals, "oom_kills", lambda: after)
    text = signals.how_it_ended(code, before)
    assert words in text
    assert ("out of memory most likely" in text) == (after is not None and after > (before or 0))


def test_the_kernels_oom_counter_is_read_where_linux_has_it():
    import re
    from pathlib import Path

    try:
        found = re.search(r"^oom_kill (\d+)$", Path("/proc/vmstat").read_text(), re.M)
    except OSError:
        found = None
    assert signals.oom_kills() == (int(found.group(1)) if found else None)


def test_verifys_stopped_cell_fails_late_or_unnamed_verdicts():
    from verify.faults.watchdog_cells import CELLS, STOP_SLACK_S, verdict

    cell = next(c for c in CELLS if c.fault == "stopped")
    stopped = {"blamed": None, "message": "stopped, then continued", "stopped": True}
    named = "watchdog blames rank 1: not responding (its process is stopped); ..."
    ok = {"blamed": [1], "message": named, "s": 2.0}
    assert verdict(cell, [ok, stopped]) == ""
    late = {**ok, "s": STOPPED_S + watchdog.SLICE_S + STOP_SLACK_S + 0.1}
    assert "beyond the heartbeat bound" in verdict(cell, [late, stopped])
    assert "not named as stopped" in verdict(
        cell, [{**ok, "message": "watchdog blames rank 1"}, stopped]
    )
    assert "not [1]" in verdict(cell, [{**ok, "blamed": [0, 1]}, stopped])


def test_verifys_killed_cell_fails_without_the_signal_or_the_folder():
    from verify.faults.watchdog_cells import CELLS, verdict

    cell = next(c for c in CELLS if c.fault == "killed")
    line = "watchdog blames rank 1: its process ended without reporting: signal 9 (SIGKILL), ..."
    assert verdict(cell, [{"blamed": [1], "message": line}]) == ""
    assert "did not name the signal" in verdict(cell, [{"blamed": [1], "message": "exit code 1"}])
    folder = "a dead launcher's folder /tmp/x was not removed with a note"
    assert verdict(cell, [{"blamed": [1], "message": folder}]) != ""
