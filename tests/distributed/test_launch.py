"""zero.ranks.launch: forked local worlds (spawn), long-lived pools, and joining a torchrun world.

Functions the ranks run are module-level, so that WorkerPool can pickle them by reference. Times
are never asserted, except that nothing outlives its timeout (pytest-timeout enforces that);
forked ranks start in well under a second even at N=8 on 2 cores.
"""

import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from zero.ranks.launch import RankError, init_from_env, rank_device, under_torchrun
from zero.ranks.local import PoolBrokenError, WorkerPool, get_pool, spawn

# --- functions the ranks run ------------------------------------------------------------------


def sum_of_ranks(rank, world_size, scale=1.0):
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)  # group=None: the world
    return rank, world_size, t.item(), torch.get_num_threads(), os.getpid()


def raise_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # the healthy ranks block here until the parent kills them
    return rank


def sleep_on(rank, world_size, slow_rank, seconds):
    if rank == slow_rank:
        time.sleep(seconds)
    return rank


def exit_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        os._exit(3)  # dies without a word, as a rank killed by the OOM killer would
    dist.barrier()


def unpicklable_result(rank, world_size):
    return lambda: rank


def device_of(rank, world_size):
    return str(rank_device())


_COUNTER = 0  # lives on in each pool worker between runs


def bump_counter(rank, world_size):
    global _COUNTER
    _COUNTER += 1
    return _COUNTER, os.getpid()


def gather_counters(rank, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, (rank, _COUNTER))
    return out


def children() -> set[int]:
    """Live children of this process (pools that other tests keep open included)."""
    return {p.pid for p in mp.active_children()}


def reaped(pid: int) -> bool:
    """True once ``pid`` is gone and reaped; a zombie still answers signal 0."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --- spawn ------------------------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_spawn_returns_every_ranks_result_in_rank_order(world_size):
    torch.ones(1 << 20).sum()  # a parent that has run torch ops (see [Note: fork])
    before = children()
    results = spawn(sum_of_ranks, world_size, 2.0, timeout_s=30)
    expected = float(sum(range(world_size)) * 2)  # small integers: exact in float32
    assert [r[:3] for r in results] == [(r, world_size, expected) for r in range(world_size)]
    assert all(r[3] == 1 for r in results)  # one thread per rank
    assert all(reaped(r[4]) for r in results)
    assert children() == before


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_spawn_accepts_a_closure():
    offset = 10
    assert spawn(lambda rank, n: rank + offset, 2, timeout_s=30) == [10, 11]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_spawn_raises_rank_error_naming_the_rank():
    before = children()
    with pytest.raises(RankError, match="rank 2 failed") as info:
        spawn(raise_on, 3, 2, timeout_s=30)
    assert info.value.rank == 2
    assert "deliberate failure on rank 2" in info.value.child_traceback
    assert "Traceback" in str(info.value)
    assert children() == before


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_spawn_reports_a_rank_that_dies_silently():
    with pytest.raises(RankError, match=r"rank 1 failed:\n.*ended without reporting: exit code 3"):
        spawn(exit_on, 2, 1, timeout_s=30)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_spawn_reports_an_unpicklable_result_as_an_error():
    with pytest.raises(RankError, match="rank 0"):
        spawn(unpicklable_result, 1, timeout_s=30)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_spawn_times_out_naming_the_silent_rank():
    before = children()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not report"):
        spawn(sleep_on, 2, 1, 60.0, timeout_s=2)
    assert children() == before


def test_spawn_validates_arguments():
    with pytest.raises(ValueError, match="world_size=0"):
        spawn(sum_of_ranks, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        spawn(sum_of_ranks, 1, timeout_s=0)
    with pytest.raises(ValueError, match="backend='mpi'"):
        spawn(sum_of_ranks, 1, backend="mpi")
    with pytest.raises(ValueError, match=r"^device='tpu' is not allowed: expected one of"):
        spawn(sum_of_ranks, 1, device="tpu")
    with pytest.raises(ValueError, match=r"^device='cpu' is not allowed: expected 'cuda' with"):
        WorkerPool(1, backend="nccl", device="cpu")


# --- WorkerPool -------------------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_pool_reuses_its_workers_and_group():
    with WorkerPool(4, timeout_s=30) as pool:
        first = pool.run(bump_counter)
        second = pool.run(bump_counter)
        assert [c for c, _ in first] == [1] * 4 and [c for c, _ in second] == [2] * 4
        assert [pid for _, pid in first] == [pid for _, pid in second]  # the same processes
        # A different function, on the same group, sees the state the first one left.
        assert pool.run(gather_counters) == [[(r, 2) for r in range(4)]] * 4
        sums = pool.run(sum_of_ranks, 1.0)
        assert [s[2] for s in sums] == [6.0] * 4
    assert pool.broken
    assert all(reaped(pid) for _, pid in first)
    assert _COUNTER == 0  # the parent's copy was never touched


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_pool_after_an_error_is_broken():
    pool = WorkerPool(2, timeout_s=30)
    pids = [r[4] for r in pool.run(sum_of_ranks)]
    with pytest.raises(RankError, match="rank 1 failed") as info:
        pool.run(raise_on, 1)
    assert "deliberate failure on rank 1" in info.value.child_traceback
    assert pool.broken and all(reaped(pid) for pid in pids)
    with pytest.raises(PoolBrokenError, match="broken"):
        pool.run(sum_of_ranks)
    pool.close()
    pool.close()  # idempotent


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_pool_timeout_names_the_rank_and_breaks_the_pool():
    with WorkerPool(2, timeout_s=30) as pool:
        with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2"):
            pool.run(sleep_on, 0, 60.0, timeout_s=1.5)
        assert pool.broken


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_pool_refuses_an_unpicklable_function_and_stays_usable():
    pool = get_pool(2)
    with pytest.raises(Exception, match="pickle|lambda"):
        pool.run(lambda rank, n: rank)
    assert not pool.broken
    assert [r[2] for r in pool.run(sum_of_ranks)] == [1.0, 1.0]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_get_pool_caches_per_world_size_and_replaces_broken_pools():
    pool = get_pool(2)
    assert get_pool(2) is pool
    with pytest.raises(RankError):
        pool.run(raise_on, 0)
    fresh = get_pool(2)
    assert fresh is not pool and not fresh.broken
    assert [r[2] for r in fresh.run(sum_of_ranks)] == [1.0, 1.0]


# --- the rank's device -------------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_rank_device_is_the_cpu_on_every_rank_of_a_cpu_world():
    assert get_pool(2, device="cpu") is get_pool(2)  # one cache entry: (2, "gloo", "cpu")
    assert get_pool(2).run(device_of) == ["cpu", "cpu"]
    assert spawn(device_of, 3, device="cpu", timeout_s=30) == ["cpu"] * 3
    assert str(rank_device()) == "cpu"  # the launcher itself: nothing set it


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_a_cuda_world_without_cuda_fails_its_start_naming_the_device(monkeypatch):
    """device="cuda" where a rank sees no GPU: every rank refuses in its setup, before joining
    the group, and the parent raises RankError with that line at once (no hang, no child
    left); the pool is broken, and get_pool keys on the device, so gloo on the CPU is intact."""
    if torch.cuda.is_initialized():
        pytest.skip("this process has initialised CUDA: forked CUDA ranks are refused first")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for the ranks, on any machine
    before, started = children(), time.monotonic()
    line = r"device='cuda' is not allowed: expected 'cpu' here: rank \d has no CUDA device"
    with pytest.raises(RankError, match=line):
        WorkerPool(2, device="cuda", timeout_s=30)
    with pytest.raises(RankError, match=line):
        get_pool(2, device="cuda")
    with pytest.raises(RankError, match=line):
        spawn(device_of, 2, device="cuda", timeout_s=30)
    assert time.monotonic() - started < 10
    assert children() == before
    assert get_pool(2).run(device_of) == ["cpu", "cpu"]


# --- torchrun ---------------------------------------------------------------------------------


def test_under_torchrun(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert not under_torchrun()
    monkeypatch.setenv("RANK", "0")
    assert not under_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert under_torchrun()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert under_torchrun()


def test_init_from_env_names_missing_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        init_from_env()


def _as_torchrun_rank(conn, port):
    # What torchrun would have set for a one-process world.
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    try:
        rank, world_size, device = init_from_env(timeout_s=30)
        assert rank_device() == device
        t = torch.ones(3)
        dist.all_reduce(t)
        conn.send((rank, world_size, str(device), dist.get_backend(), t.tolist()))
        dist.destroy_process_group()
    except BaseException as exc:
        conn.send(repr(exc))


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a forked child cannot use CUDA once a parent may have"
)
def test_init_from_env_joins_a_torchrun_style_world():
    with socket.socket() as s:  # a free port for the store; a race here only fails the test
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_as_torchrun_rank, args=(child, port))
    proc.start()
    try:
        assert parent.poll(30)
        got = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert got == (0, 1, "cpu", "gloo", [1.0, 1.0, 1.0])
