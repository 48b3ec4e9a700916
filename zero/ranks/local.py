"""Local worlds: fork N ranks on this machine, once (spawn) or as long-lived workers (WorkerPool).

In ``spawn`` and ``WorkerPool`` the function runs as ``fn(rank, world_size, *args)`` in a world
whose default group is the whole world: pass ``group=None`` (or ``dist.group.WORLD``) to the APIs
that take the data-parallel group. The checks, errors and device choice they share with a
torchrun world are zero/ranks/launch.py's, and so is [Note: fork].

Rendezvous goes through a ``FileStore`` in a fresh temporary directory: no port is chosen, so
none can collide or leak; gloo's own sockets use ephemeral ports and close with the process.
A rank that raises makes the parent raise ``RankError`` with that rank's traceback, after
killing the other ranks; ranks that do not report within ``timeout_s`` are killed and named in
a ``TimeoutError``; every child is reaped. SIGINT or SIGTERM to the parent, or its death, ends
every rank and removes the rendezvous directory (zero/ranks/signals.py).
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from . import beacon, watchdog
from .launch import (
    RankError,
    _check,
    _use_cuda,
    check_timeout,
    resolve_device,
)
from .signals import Interrupted as Interrupted  # re-exported: what spawn may raise
from .signals import (
    Janitor,
    SignalGuard,
    before_fork,
    clear_dead_launchers,
    close_fds,
    guard_child,
    how_it_ended,
    oom_kills,
    own_folder,
    stopped_by_signal,
)

_STOP = b"stop"
"""Sent to a worker instead of a pickled task: leave the loop (a pickle never equals it)."""

_GRACE_S = 5.0
"""How long a finished child may take to leave (destroy its group, flush) before it is killed."""


class PoolBrokenError(RuntimeError):
    """A WorkerPool was used after an error, a timeout or ``close()``."""


# ---------------------------------------------------------------------------------------------
# Forked children


def _child_setup(rank, world_size: int, store_dir: str, backend: str, device: str, timeout_s):
    global _RANK_DEVICE
    torch.set_num_threads(1)  # first: see [Note: fork]
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # refused once inter-op work has started (possibly in the parent); harmless
    _RANK_DEVICE = _use_cuda(rank, f"rank {rank}") if device == "cuda" else torch.device("cpu")
    os.environ[beacon.DIR_VAR] = store_dir  # heartbeats (zero/ranks/beacon.py) go beside the store
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _leave() -> None:
    # fn may have destroyed the group itself, or broken it; leaving must not raise either way.
    try:
        if dist.is_initialized() and not watchdog.stranded():
            dist.destroy_process_group()
    except Exception:
        pass


def _send(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)  # pickles first, so a failure here has written nothing
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))  # e.g. an unpicklable result
        except OSError:
            pass  # the parent is gone


def _run_one(fn, rank: int, world_size: int, args: tuple) -> tuple:
    try:
        return ("ok", fn(rank, world_size, *args))
    except BaseException:
        return ("error", traceback.format_exc())


def _run_task(data: bytes, rank: int, world_size: int) -> tuple:
    try:
        fn, args = pickle.loads(data)  # inside the try: a function may not import here
    except BaseException:
        return ("error", traceback.format_exc())
    return _run_one(fn, rank, world_size, args)


def _close_inherited(keep: Connection, conns: list[Connection]) -> None:
    # A child holding another process's pipe ends would keep that pipe open after its owner
    # dies, so a worker would never see its parent vanish (EOF); close every end but our own.
    for c in conns:
        if c is not keep:
            c.close()
    for pool in list(_LIVE_POOLS):
        pool._forget_in_child()
    close_fds()  # other worlds' janitors' pipes, likewise


def _spawn_child(fn, rank, world_size, args, store_dir, where, timeout_s, conn, all_conns):
    guard_child()
    _close_inherited(conn, all_conns)
    try:
        _child_setup(rank, world_size, store_dir, *where, timeout_s)
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        return
    message = _run_one(fn, rank, world_size, args)
    _send(conn, message)
    conn.close()
    if message[0] == "ok" and not watchdog.stranded():  # stranded: the group is broken
        try:
            # Nobody leaves while a peer may still be reading its last collective's data; and a
            # rank that returns while others still train is named by them (zero/ranks/watchdog.py).
            watchdog.leave("its rank function returned")
        except Exception:
            pass
    _leave()


def _worker_loop(rank, world_size, store_dir, where, timeout_s, conn, all_conns):
    guard_child()
    _close_inherited(conn, all_conns)
    try:
        _child_setup(rank, world_size, store_dir, *where, timeout_s)
        _send(conn, ("ok", None))
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        if data == _STOP:
            break
        _send(conn, _run_task(data, rank, world_size))
    _leave()


def _start(ctx, target, world_size: int, make_args) -> tuple[list, list[Connection]]:
    pipes = [ctx.Pipe(duplex=True) for _ in range(world_size)]
    all_conns = [c for pair in pipes for c in pair]
    procs = []
    with warnings.catch_warnings():
        # Python >= 3.12 warns when forking a multithreaded process (torch's thread pools);
        # [Note: fork] is how the children cope with it.
        warnings.simplefilter("ignore", DeprecationWarning)
        before_fork()
        for rank, (_, child_end) in enumerate(pipes):
            # Not daemonic: a daemonic rank could not start processes of its own (a DataLoader's
            # workers, say); every exit path here reaps the ranks instead.
            p = ctx.Process(target=target, args=make_args(rank, child_end, all_conns))
            p.start()
            procs.append(p)
    for _, child_end in pipes:
        child_end.close()
    return procs, [parent_end for parent_end, _ in pipes]


def _silent_exit(proc, rank: int, oom_before: int | None = None) -> str:
    how = how_it_ended(proc.exitcode, oom_before)
    return watchdog.blame_line([rank], f"its process ended without reporting: {how}")


def _collect(procs, conns, ranks, timeout_s: float | None, *, what: str, oom=None) -> list:
    """Wait for one message from each of ``ranks``; return the payloads in rank order.

    Raises RankError on the first error (or on a rank that died without a word: how it ended,
    with the kernel's out-of-memory kills since `oom`, oom_kills() at the start) and TimeoutError
    naming the silent ranks once ``timeout_s`` has passed. The caller cleans up either way.
    """
    results: dict[int, object] = {}
    pending = set(ranks)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    by_conn = {conns[r]: r for r in ranks}
    by_sentinel = {procs[r].sentinel: r for r in ranks}
    while pending:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            stopped = [r for r in sorted(pending) if stopped_by_signal(procs[r].pid)]
            why = f" (stopped by a signal: ranks {stopped})" if stopped else ""
            raise TimeoutError(
                f"{what}: ranks {sorted(pending)} of {len(procs)} did not report within "
                f"{timeout_s:g} s{why}; all ranks were killed"
            )
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = wait(waitables, timeout=remaining)
        errors: dict[int, str] = {}
        for obj in ready:
            rank = by_conn.get(obj) if isinstance(obj, Connection) else by_sentinel.get(obj)
            if rank is None or rank not in pending:
                continue
            conn, proc = conns[rank], procs[rank]
            if conn.poll():  # a message, or EOF
                try:
                    status, payload = conn.recv()
                except EOFError:
                    proc.join(1.0)  # closed its end: it is exiting; learn the code
                    status, payload = "error", _silent_exit(proc, rank, oom)
                except Exception:  # a result that does not unpickle here
                    status, payload = "error", traceback.format_exc()
            elif not proc.is_alive():
                status, payload = "error", _silent_exit(proc, rank, oom)
            else:
                continue
            pending.discard(rank)
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
        if errors:
            first = min(errors)
            raise RankError(first, errors[first], also=tuple(sorted(set(errors) - {first})))
    return [results[r] for r in ranks]


def _stop(procs, *, grace_s: float) -> None:
    """Reap every process: wait up to ``grace_s`` in total, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join()


def spawn(
    fn,
    world_size: int,
    *args,
    timeout_s: float = 120,
    backend: str = "gloo",
    device: str | None = None,
    deadline_s: float | str | None = "timeout_s",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; return the results.

    Each rank joins one process group (gloo by default; each collective times out after
    ``timeout_s``, and the watchdog then names the rank to blame: zero/ranks/watchdog.py) on its
    device (``device``: "cpu", or "cuda" for cuda:(rank % GPUs); None: "cuda" with NCCL, else
    "cpu"; ``rank_device()`` in ``fn``; a rank without CUDA raises RankError), runs ``fn``
    once, sends its return value (which must pickle) to the parent, and leaves. ``fn`` itself
    is not pickled: a lambda or closure is fine. Results come back in rank order. Raises
    RankError if a rank raises, TimeoutError if some rank has not finished within
    ``deadline_s`` of the start (by default ``timeout_s``; None: no deadline, for a training
    run whose length the collective timeout must not bound); the other ranks are killed in both
    cases.
    SIGINT or SIGTERM (main thread) raises Interrupted once every rank is ended and the
    directory removed.
    """
    where = (backend, _check(world_size, timeout_s, backend, device))
    if deadline_s == "timeout_s":
        deadline_s = timeout_s
    elif deadline_s is not None:
        check_timeout(deadline_s, "deadline_s")
    ctx, oom = mp.get_context("fork"), oom_kills()
    # Signals wait (recorded, not raised) until every process is started and the janitor
    # knows them, and again during the cleanup: see zero/ranks/signals.py.
    clear_dead_launchers()  # [Note: rendezvous folders of a job killed whole]
    with SignalGuard() as guard, tempfile.TemporaryDirectory(prefix="zero-spawn-") as store_dir:
        own_folder(store_dir)
        procs, conns = _start(
            ctx,
            _spawn_child,
            world_size,
            lambda r, c, cs: (fn, r, world_size, args, store_dir, where, timeout_s, c, cs),
        )
        janitor = Janitor(store_dir, [p.pid for p in procs])
        ok = False
        try:
            guard.arm()
            results = _collect(procs, conns, range(world_size), deadline_s, what="spawn", oom=oom)
            ok = True
        finally:
            guard.disarm()
            _stop(procs, grace_s=_GRACE_S if ok else 0.0)
            for c in conns:
                c.close()
            janitor.release()
    return results


# ---------------------------------------------------------------------------------------------
# Long-lived workers


class WorkerPool:
    """``world_size`` forked workers that hold one process group for their whole life.

    ``pool.run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every worker and returns the
    results in rank order. ``fn`` and ``args`` are pickled, so ``fn`` must be a module-level
    function (one in a test module pickles by reference and is found in the forked worker).
    Module-level state in the workers persists between runs, as does the process group; the
    default group is the world (pass ``group=None`` or ``dist.group.WORLD``).

    After a RankError or TimeoutError the group may be stuck mid-collective, so the pool kills its
    workers and is *broken*: later runs raise PoolBrokenError. ``close()`` (or leaving a ``with``
    block) always cleans up, and may be called any number of times.

    ``backend`` and ``device`` as for ``spawn``: with device="cuda" the workers share the GPUs
    (cuda:(rank % GPUs)); a worker without CUDA fails the start with RankError.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout_s: float = 120,
        backend: str = "gloo",
        device: str | None = None,
    ):
        device = _check(world_size, timeout_s, backend, device)
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        self.device = device
        self._owner = os.getpid()
        self._broken: str | None = None
        # mkdtemp, not TemporaryDirectory: the latter's finalizer may run at exit before
        # _close_pools and pull the store from under live workers.
        clear_dead_launchers()  # [Note: rendezvous folders of a job killed whole]
        self._store_dir = store = tempfile.mkdtemp(prefix="zero-pool-")
        own_folder(store)
        ctx = mp.get_context("fork")
        self._procs, self._conns = _start(
            ctx,
            _worker_loop,
            world_size,
            lambda r, c, cs: (r, world_size, store, (backend, device), timeout_s, c, cs),
        )
        self._janitor = Janitor(store, [p.pid for p in self._procs])
        _LIVE_POOLS.add(self)
        try:
            _collect(self._procs, self._conns, range(world_size), timeout_s, what=repr(self))
        except BaseException as exc:
            self._break(f"starting failed: {exc}")
            raise

    def __repr__(self) -> str:
        return (
            f"WorkerPool(world_size={self.world_size}, backend={self.backend!r}, "
            f"device={self.device!r})"
        )

    @property
    def broken(self) -> bool:
        """True once an error, a timeout or close() has ended the workers."""
        return self._broken is not None

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """``fn(rank, world_size, *args)`` on every worker; the results in rank order.

        ``timeout_s`` defaults to the pool's. Errors and timeouts as for ``spawn``; either one
        breaks the pool.
        """
        if self._broken is not None:
            raise PoolBrokenError(f"{self!r} is broken ({self._broken}); make a new pool")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        check_timeout(timeout_s)  # the rest was checked when the workers were forked
        # Pickled once, here: an unpicklable fn (a lambda, a closure) fails in the caller and
        # leaves the pool intact.
        task = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        with SignalGuard() as guard:  # SIGINT/SIGTERM: break the pool, then raise Interrupted
            try:
                guard.arm()
                for conn in self._conns:
                    conn.send_bytes(task)
                ranks = range(self.world_size)
                return _collect(
                    self._procs, self._conns, ranks, timeout_s, what=repr(self), oom=oom_kills()
                )
            except BaseException as exc:
                guard.disarm()
                self._break(f"{type(exc).__name__} in {getattr(fn, '__name__', fn)!s}")
                raise
            finally:
                guard.disarm()

    def close(self) -> None:
        """Stop the workers (politely, then by force) and remove the rendezvous directory."""
        if os.getpid() != self._owner:
            return
        if self._broken is None:
            for conn in self._conns:
                try:
                    conn.send_bytes(_STOP)
                except OSError:
                    pass
            self._broken = "closed"
        self._shutdown(grace_s=_GRACE_S)

    def _break(self, reason: str) -> None:
        self._broken = reason
        self._shutdown(grace_s=0.0)

    def _shutdown(self, *, grace_s: float) -> None:
        if self not in _LIVE_POOLS:
            return  # already shut down (a broken pool, closed later)
        _stop(self._procs, grace_s=grace_s)
        for conn in self._conns:
            conn.close()
        self._janitor.release()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        _LIVE_POOLS.discard(self)

    def _forget_in_child(self) -> None:
        # In a forked child, this pool's pipes and processes belong to the parent.
        for conn in self._conns:
            conn.close()
        self._owner = -1

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_LIVE_POOLS: set[WorkerPool] = set()
_POOLS: dict[tuple[int, str, str], WorkerPool] = {}


def get_pool(
    world_size: int, *, backend: str = "gloo", device: str | None = None, timeout_s: float = 120
) -> WorkerPool:
    """A cached pool per (world_size, backend, device), for tests and verify; closed at exit.

    A broken or closed pool is replaced by a fresh one, so one failed test does not fail the
    next. ``timeout_s`` applies when a pool is created; ``run`` takes its own.
    """
    key = (world_size, backend, resolve_device(backend, device))
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        pool = _POOLS[key] = WorkerPool(
            world_size, timeout_s=timeout_s, backend=backend, device=key[2]
        )
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()
