"""zero.ranks.watchdog: a rank that diverges, stalls, dies or leaves is named by every rank.

Each test starts a fresh local world with a short collective timeout and plants one fault on one
rank: the error that comes back must name that rank (`zero.ranks.watchdog.blamed`), never a victim,
and arrive within the timeout plus the heartbeat survey. On the code before the watchdog each of
these either hung until the timeout naming no rank, or ended with the victim's SIGABRT.
"""

import os
import signal
import time

import pytest
import torch

from tests.helpers.engine_tools import mlp_engine, one_step
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.launch import RankError
from zero.ranks.local import spawn
from zero.ranks.watchdog import blamed
from zero.workloads.models import MLP, MLPConfig, mlp_microbatches

TIMEOUT_S = 6.0  # the process group's per-collective timeout in these worlds


def _batches(model, n, step):
    return mlp_microbatches(model.cfg, seed=0, data_step=step, count=2 * n, batch_size=4)


def diverge(rank, n, fault, bad, stage):
    """Two clean steps, then rank `bad` does `fault` in step 2 while the others train on."""
    model, eng = mlp_engine(stage, n, 2)
    for step in range(2):
        one_step(eng, model, rank, n, 2, step)
    batches = _batches(model, n, 2)
    mine = [batches[i * n + rank] for i in range(2)]
    if rank == bad and fault == "early_exit":
        return "left"
    if rank == bad and fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == bad and fault == "die":
        os._exit(9)
    if rank == bad and fault == "save_alone":
        eng.save(os.environ["WD_OUT"])
    extra = rank == bad and fault == "extra_backward"
    for x in [*mine, mine[0]] if extra else mine:
        _, loss = eng(*x)
        eng.backward(loss)
    if not (rank == bad and fault == "skip_step"):
        eng.step()
    for x in _batches(model, n, 3)[rank::n]:
        _, loss = eng(*x)
        eng.backward(loss)
    eng.step()
    return "done"


def run_fault(fault, n, bad, stage, tmp_path):
    os.environ["WD_OUT"] = str(tmp_path / "ckpt")
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(diverge, n, fault, bad, stage, timeout_s=TIMEOUT_S, deadline_s=60)
    return str(info.value), time.monotonic() - t0


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("fault", ["extra_backward", "skip_step"])
def test_a_call_the_step_does_not_allow_is_named_at_once(fault, stage, tmp_path):
    text, took = run_fault(fault, 2, 1, stage, tmp_path)
    assert blamed(text) == {1}, text
    assert "Timed out" not in text and "after collective #" in text  # at the boundary


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_that_leaves_early_is_named(stage, tmp_path):
    text, took = run_fault("early_exit", 2, 1, stage, tmp_path)
    assert blamed(text) == {1}, text
    assert "left" in text


@pytest.mark.dist
@pytest.mark.parametrize("n, want", [(3, {1}), (2, {0, 1})])
def test_a_save_by_one_rank_alone(n, want, tmp_path):
    """With a majority the odd rank is blamed; at N = 2 neither side is the majority, so both
    are named, each with the call it made."""
    text, took = run_fault("save_alone", n, 1, 2, tmp_path)
    assert blamed(text) == want, text
    assert "save()" in text and "forward()" in text
    assert "Timed out" not in text  # at the boundary, not after a timeout


@pytest.mark.dist
@pytest.mark.parametrize("fault, word", [("stop", "stopped"), ("die", "")])
def test_a_stopped_or_dead_rank_is_named(fault, word, tmp_path):
    text, took = run_fault(fault, 2, 1, 3, tmp_path)
    assert blamed(text) == {1}, text
    assert word in text
    assert took < TIMEOUT_S + 20  # not a hang: the timeout, the heartbeat survey, start-up


def reorder(rank, n, bad, mode, d_in):
    """Same calls, but rank `bad` launches two units' reductions in the other order. With
    d_in = 48 the two units have equal sizes: the collectives pair up without a hang and sum the
    wrong units (silently wrong before the watchdog); with d_in = 16 their sizes differ and gloo
    aborts the rank receiving the larger message unless every collective is checked first."""
    model = MLP(MLPConfig(d_in=d_in, d_hidden=48, d_out=4, n_layer=3))
    cfg = ZeroConfig(
        stage=2, micro_batches=n, units=tuple(model.unit_names()), chunk=128, watchdog=mode
    )
    eng = ZeroEngine(model, cfg)
    if rank == bad:
        i, j = (next(k for k, u in enumerate(eng.units) if u.name == n) for n in model.unit_names())
        eng.units[i], eng.units[j] = eng.units[j], eng.units[i]
    for step in range(2):
        batches = mlp_microbatches(model.cfg, seed=0, data_step=step, count=n, batch_size=4)
        _, loss = eng(*batches[rank])
        eng.backward(loss)
        eng.step()
    return "done"


@pytest.mark.dist
@pytest.mark.parametrize("mode, d_in", [("calls", 48), ("collectives", 48), ("collectives", 16)])
def test_collectives_out_of_step_are_traced_to_the_first_one(mode, d_in):
    with pytest.raises(RankError) as info:
        spawn(reorder, 3, 1, mode, d_in, timeout_s=TIMEOUT_S, deadline_s=60)
    text = str(info.value)
    assert blamed(text) == {1}, text
    assert "different collectives" in text and "reduce_scatter" in text


def healthy(rank, n):
    model, eng = mlp_engine(3, n, 2)
    out = [one_step(eng, model, rank, n, 2, s).loss for s in range(3)]
    calls = eng.counter.counts(2, kind="watchdog")
    return out, calls, eng.watch.hash


@pytest.mark.dist
def test_a_healthy_run_passes_every_boundary():
    """Three steps, every rank: one boundary all-gather per micro-step (at its forward; the
    backward after it is not checked again) and one for the step (k = 2: 3 per step), and the
    same hash of every collective on every rank."""
    per_rank = spawn(healthy, 2, timeout_s=TIMEOUT_S)
    assert per_rank[0][0] == per_rank[1][0]
    assert per_rank[0][1] == per_rank[1][1] == {"all_gather": 3}
    assert per_rank[0][2] == per_rank[1][2] != 0
    assert torch.tensor(per_rank[0][0]).isfinite().all()


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes below `launcher_pid` that torchrun started."""
    out = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if b"TORCHELASTIC_RUN_ID" in env and b"RANK" in env and ppid == launcher_pid:
            out[int(env[b"RANK"])] = pid
    return out


@pytest.mark.full  # about a minute; the fault suite's torchrun_sigstop_rank1 case as well
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_under_torchrun_the_stopped_rank_is_blamed(tmp_path):
    """SIGSTOP rank 1 of a torchrun world mid-training, at the default collective timeout: the
    error torchrun relays names rank 1, in seconds (before the watchdog, rank 0 was blamed, after
    the timeout; before heartbeats were read during a wait, rank 1 was named at the timeout)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from zero.ranks.watchdog import SLICE_S, STOPPED_S

    repo = Path(__file__).resolve().parents[2]
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"\n".join(p.read_bytes() for p in sorted((repo / "zero").glob("*.py"))))
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    args = ["--model", "tiny", "--eval-every", "0", "--ckpt-every", "0", "--log-every", "1"]
    args += ["--steps", "100000", "--data", str(corpus)]  # the default timeout, 600 s
    args += ["--out", str(tmp_path / "run")]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [
                launcher,
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "zero.workloads.train",
                *args,
            ],
            cwd=repo,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        while "GPT tiny" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)  # rank 0 prints the header once the world is up
        time.sleep(3.0)  # a few steps in
        ranks = _rank_pids(proc.pid)
        assert set(ranks) == {0, 1}, (ranks, log.read_text())
        t0 = time.monotonic()
        os.kill(ranks[1], signal.SIGSTOP)
        while "watchdog blames" not in log.read_text() and time.monotonic() < t0 + 60:
            time.sleep(0.2)
        took = time.monotonic() - t0  # torchrun then takes its own grace to kill a stopped rank
        proc.wait(90)
    finally:
        for pid in _rank_pids(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    rest = log.read_text()
    assert proc.returncode != 0
    assert blamed(rest) == {1}, rest[-3000:]
    assert "stopped" in rest
    assert took < STOPPED_S + SLICE_S + 10, took  # the bound, and a loaded machine's slack


@pytest.mark.dist
def test_verify_watchdog_section_passes_and_has_teeth(quick_report):
    """verify's watchdog cells (verify/faults/watchdog_cells.py; the session's --quick run,
    tests/distributed/conftest.py) pass; with the majority rule broken (every rank blamed
    whenever the calls differ) the majority cell fails."""
    from verify.faults import watchdog_cells

    rows = quick_report["data"]["watchdog"]
    assert [r["passed"] for r in rows] == [True] * len(watchdog_cells.CELLS)
    cell = next(c for c in watchdog_cells.CELLS if c.fault == "extra_eval")
    planted = watchdog_cells.get_pool(cell.world_size).run(_planted_majority, cell, timeout_s=120)
    assert not all(r["blamed"] == [1] for r in planted)


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_a_tie_names_every_rank_and_a_planted_weak_majority_fails_it(n):
    """A tie (1-1 at N = 2, 2-2 at N = 4): every rank names every rank and says there was no
    strict majority. With the majority rule planted as 'at least half' (>= for >), one side of
    the tie is blamed instead, and the cell's verdict reports it."""
    from verify.faults import watchdog_cells

    cell = next(c for c in watchdog_cells.CELLS if watchdog_cells.is_tie(c) and c.world_size == n)
    pool = watchdog_cells.get_pool(n)
    clean = pool.run(watchdog_cells.diverge, cell, timeout_s=120)
    assert [r["blamed"] for r in clean] == [list(range(n))] * n
    assert all("no strict majority" in r["message"] for r in clean)
    assert watchdog_cells.verdict(cell, clean) == ""
    planted = pool.run(_planted_weak_majority, cell, timeout_s=120)
    assert all(r["blamed"] != list(range(n)) for r in planted), planted
    assert "not " + str(list(range(n))) in watchdog_cells.verdict(cell, planted)


def _planted_weak_majority(rank, n, cell):
    from verify.faults import watchdog_cells
    from zero.ranks import watchdog

    real = watchdog._odd_ones

    def weak(keys, *, leavers):
        for k in sorted(set(keys)):
            if keys.count(k) * 2 >= len(keys):
                return [r for r, x in enumerate(keys) if x != k]
        return real(keys, leavers=leavers)

    watchdog._odd_ones = weak
    try:
        return watchdog_cells.diverge(rank, n, cell)
    finally:
        watchdog._odd_ones = real


def _planted_majority(rank, n, cell):
    from verify.faults import watchdog_cells
    from zero.ranks import watchdog

    real = watchdog._odd_ones
    watchdog._odd_ones = lambda keys, leavers: list(range(len(keys)))
    try:
        return watchdog_cells.diverge(rank, n, cell)
    finally:
        watchdog._odd_ones = real


# --- a stopped rank named in seconds, a slow one never ([Note: a stopped rank named in seconds]) --


def stop_after_two_steps(rank, n, mark):
    """Two clean steps; then rank 1 notes the time and stops itself, the others step on."""
    model, eng = mlp_engine(2, n, 2)
    for step in range(2):
        one_step(eng, model, rank, n, 2, step)
    if rank == 1:
        with open(mark, "w") as f:
            f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for the whole host
        os.kill(os.getpid(), signal.SIGSTOP)
    one_step(eng, model, rank, n, 2, 2)
    return "done"


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_stopped_rank_is_named_in_seconds_at_the_default_timeout(tmp_path):
    """At the default collective timeout (600 s), a rank stopped by SIGSTOP is named once its
    heartbeat has been silent for STOPPED_S and a wait slice has ended: seconds, not minutes.
    Before, the error came at the timeout."""
    from zero.ranks.watchdog import SLICE_S, STOPPED_S

    mark = tmp_path / "stopped_at"
    with pytest.raises(RankError) as info:
        spawn(stop_after_two_steps, 2, str(mark), timeout_s=600, deadline_s=None)
    took = time.monotonic() - float(mark.read_text())
    text = str(info.value)
    assert blamed(text) == {1}, text
    assert "its process is stopped" in text and "heartbeat has not advanced" in text
    # the bound: STOPPED_S of silence, one slice, one step's collective; 10 s for a loaded
    # machine's scheduling, still 50x below the timeout that named it before
    assert took < STOPPED_S + SLICE_S + 10, took


def slow_rank(rank, n, seconds):
    """Rank 1 computes for `seconds` (half in torch, half in Python bytecode, which holds the
    interpreter between switches) while the others wait for it in the step's collectives."""
    model, eng = mlp_engine(2, n, 2)
    one_step(eng, model, rank, n, 2, 0)
    if rank == 1:
        end, x = time.monotonic() + seconds / 2, torch.randn(256, 256)
        while time.monotonic() < end:
            x = torch.tanh(x @ x)
        end, k = time.monotonic() + seconds / 2, 0
        while time.monotonic() < end:
            k += 1
    one_step(eng, model, rank, n, 2, 1)
    return "done"


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_slow_rank_is_never_named():
    """A rank that computes for longer than SILENT_S, the longest bound, is not blamed: its
    heartbeat thread beats on while it works, so its peers wait as long as it takes."""
    from zero.ranks.watchdog import SILENT_S

    assert spawn(slow_rank, 2, SILENT_S + 2, timeout_s=600, deadline_s=None) == ["done"] * 2


def late_into_backward(rank, n, late_s):
    """Stage 3 (its parameter all-gathers on gloo are point-to-point sends: [Note: all-gather
    on gloo]); in the second step rank 1 starts backward late_s after its forward, so the
    others wait that long in the backward gather, several watchdog slices. The losses."""
    model, eng = mlp_engine(3, n, 1)
    losses = []
    for step in range(3):
        x, y = mlp_microbatches(model.cfg, seed=0, data_step=step, count=n, batch_size=4)[rank]
        _, loss = eng(x, y)
        if rank == 1 and step == 1:
            time.sleep(late_s)
        eng.backward(loss)
        losses.append(eng.step().loss)
    return losses


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_rank_late_inside_a_point_to_point_gather_ends_nothing():
    """[Note: no timed point-to-point waits] (zero/collectives.py): a peer late by four slices
    inside stage 3's point-to-point all-gather is waited for, and the run gives the bits of one
    where nobody is late. (A timed wait on gloo's receive closed every pair at the first slice:
    "Application timeout caused pair closure".)"""
    from zero.ranks.watchdog import SLICE_S

    on_time = spawn(late_into_backward, 2, 0.0, timeout_s=120)
    late = spawn(late_into_backward, 2, 4 * SLICE_S, timeout_s=120)
    assert late == on_time
