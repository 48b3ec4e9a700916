"""Starting ranks: join a torchrun world, or fork a local one.

Legend:
    N        world_size, the data-parallel degree N_d
    rank     this process's index in [0, N)
    world    N processes in one default process group (``dist.group.WORLD``)

Three ways in, one per situation (docs/design.md §5):
- ``init_from_env()``: under ``torchrun`` (GPUs, multi-node). torchrun starts the processes and
  sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; this joins that world.
- ``spawn(fn, N, *args)``: a throwaway local world: fork N processes, run ``fn`` once, return
  every rank's result. No launcher of our own beyond this convenience.
- ``WorkerPool(N)`` / ``get_pool(N)``: N long-lived forked workers holding one process group,
  reused by many calls, so that tests do not pay for starting a world each (docs/design.md §4).

Each rank has a device, ``rank_device()``: the CPU by default; with ``device="cuda"`` forked rank
r computes on cuda:(r % GPUs), so gloo ranks can share one GPU (NCCL refuses two ranks on one
device); under torchrun, cuda:LOCAL_RANK where the world is on GPUs.

In ``spawn`` and ``WorkerPool`` the function runs as ``fn(rank, world_size, *args)`` in a world
whose default group is the whole world: pass ``group=None`` (or ``dist.group.WORLD``) to the APIs
that take the data-parallel group.

[Note: fork] Forked children start at once where spawned ones re-import torch, which costs
seconds per world (docs/machine_notes.md, starting ranks). Two costs come with it:
- a child of a parent that has run a multithreaded torch op hangs in libgomp as soon as it uses
  more than one thread, so every child calls ``torch.set_num_threads(1)`` before anything else
  (one thread per rank is also what bitwise determinism wants, docs/design.md §2);
- CUDA cannot be used in a child of a parent that has initialised it, so backend="nccl" and
  device="cuda" are refused once the parent has touched CUDA (use torchrun there); the parent
  may count GPUs (``visible_gpus``, through NVML) but must not call the CUDA runtime.

Rendezvous goes through a ``FileStore`` in a fresh temporary directory: no port is chosen, so
none can collide or leak; gloo's own sockets use ephemeral ports and close with the process.

Failure (docs/design.md §3, "not left to hang"): a rank that raises makes the parent raise
``RankError`` with that rank's traceback, after killing the other ranks, which may be blocked in
a collective that will never complete. Ranks that do not report within ``timeout_s`` are killed
and named in a ``TimeoutError``. Every child is reaped, so none is left a zombie. SIGINT or
SIGTERM to the parent, or its death, ends every rank and removes the rendezvous directory
(zero/launch_signals.py); ``leave_world()`` is how a torchrun rank leaves at the end.
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
from .launch_signals import Interrupted as Interrupted  # re-exported: what spawn may raise
from .launch_signals import (
    Janitor,
    SignalGuard,
    before_fork,
    close_fds,
    guard_child,
    stopped_by_signal,
)

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")

_STOP = b"stop"
"""Sent to a worker instead of a pickled task: leave the loop (a pickle never equals it)."""

_GRACE_S = 5.0
"""How long a finished child may take to leave (destroy its group, flush) before it is killed."""


class RankError(RuntimeError):
    """A rank raised, or died without reporting. ``rank`` is the first rank that reported an
    error, ``child_traceback`` its formatted traceback (the message includes it too)."""

    def __init__(self, rank: int, child_traceback: str, *, also: tuple[int, ...] = ()):
        self.rank = rank
        self.child_traceback = child_traceback
        others = f" (ranks {list(also)} failed too)" if also else ""
        super().__init__(f"rank {rank} failed{others}:\n{child_traceback}")


class LaunchEnvError(ValueError, RuntimeError):
    """The launcher's environment variables are missing, malformed or stale (a ValueError:
    bad input, reported in one line by the CLIs; a RuntimeError for older callers)."""


class PoolBrokenError(RuntimeError):
    """A WorkerPool was used after an error, a timeout or ``close()``."""


def _fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: expected {allowed}")


MAX_TIMEOUT_S = 10**7
"""The longest timeout accepted, about 116 days: a bound on what a timedelta and the backends'
millisecond counters hold (inf would overflow them), far above any run."""


def check_timeout(timeout_s: object, name: str = "timeout_s") -> None:
    """A timeout must be a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s <= MAX_TIMEOUT_S  # False for nan and inf
    ):
        raise _fail(name, timeout_s, f"a finite number of seconds in (0, {MAX_TIMEOUT_S:g}]")


def resolve_device(backend: object, device: object) -> str:
    """The device of a world: ``device`` as given, checked; None means "cuda" with NCCL (it
    carries GPU tensors only) and "cpu" with gloo."""
    if backend not in BACKENDS:
        raise _fail("backend", backend, f"one of {BACKENDS}")
    if device is None:
        return "cuda" if backend == "nccl" else "cpu"
    if device not in DEVICES:
        raise _fail("device", device, f"one of {DEVICES}")
    if backend == "nccl" and device == "cpu":
        raise _fail("device", device, "'cuda' with backend='nccl' (it carries GPU tensors only)")
    return device


def choose_where(backend=None, device=None, *, torchrun: bool) -> tuple[str, str]:
    """(backend, device) with the defaults filled in, checked (resolve_device): a torchrun
    world runs NCCL on the GPUs where there are some, else gloo on the CPU; local worlds run
    gloo, on the CPU unless device="cuda" (ranks sharing the GPUs). A backend alone brings its
    own device (NCCL: cuda; gloo: cpu)."""
    if backend is None:
        gpus = device == "cuda" or (device is None and visible_gpus() > 0)
        backend = "nccl" if torchrun and gpus else "gloo"
    return backend, resolve_device(backend, device)


def _check(world_size: object, timeout_s: object, backend: object, device: object = None) -> str:
    """Check a local world's arguments; return its device (resolve_device)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise _fail("world_size", world_size, "an integer >= 1")
    check_timeout(timeout_s)
    device = resolve_device(backend, device)
    if device == "cuda" and torch.cuda.is_initialized():  # [Note: fork]
        raise RuntimeError(
            f"backend={backend!r} on device='cuda' with forked ranks needs a parent that has "
            "not initialised CUDA; launch with torchrun and init_from_env() instead"
        )
    return device


def visible_gpus() -> int:
    """How many CUDA devices this process sees, counted without initialising CUDA here (a
    forked child of a parent that has cannot use CUDA, [Note: fork]): 0 for a torch built
    without CUDA; else torch's count through NVML, which honours CUDA_VISIBLE_DEVICES."""
    # torch.cuda.is_available() asks the CUDA runtime unless told to ask NVML; device_count()
    # asks NVML first either way. Set for the children too, whose checks then agree.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count()


_RANK_DEVICE: torch.device | None = None
"""This process's rank device once a forked rank's setup or init_from_env has chosen it."""


def rank_device() -> torch.device:
    """The device this rank computes on: set in a forked rank (``device=`` of spawn and
    WorkerPool) and by init_from_env; in an NCCL world started by other code, the current CUDA
    device; else (nothing set it: the launcher itself, a plain process) the CPU."""
    if _RANK_DEVICE is None and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if _RANK_DEVICE is None else _RANK_DEVICE


def _use_cuda(index: int, who: str) -> torch.device:
    """cuda:(index % GPUs) made current, or a ValueError naming device='cuda' where this
    process has no CUDA."""
    if not torch.cuda.is_available():
        raise _fail("device", "cuda", f"'cpu' here: {who} has no CUDA device")
    torch.cuda.set_device(index % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------
# torchrun


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK and
    WORLD_SIZE)."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launch_env(env) -> None:
    """Refuse (LaunchEnvError, one line naming the variables) a launcher environment that is
    incomplete or malformed, or stale: WORLD_SIZE > 1 with neither TORCHELASTIC_RUN_ID nor
    LOCAL_RANK, which torchrun always sets, is what variables left in a shell look like, and
    joining would wait for peers that never come until the timeout."""
    missing = [k for k in LAUNCH_VARS if k not in env]
    if missing:
        raise LaunchEnvError(
            f"init_from_env: {', '.join(missing)} not set; launch with torchrun "
            "(e.g. torchrun --standalone --nproc-per-node N -m ...) or use zero.launch.spawn"
        )
    numbers = {}
    for key, low in (("WORLD_SIZE", 1), ("RANK", 0), ("MASTER_PORT", 1), ("LOCAL_RANK", 0)):
        text = env.get(key, "0" if key == "LOCAL_RANK" else None)
        try:
            numbers[key] = int(text)
        except ValueError:
            numbers[key] = -1
        if numbers[key] < low or (key == "MASTER_PORT" and numbers[key] > 65535):
            port = " and <= 65535" if key == "MASTER_PORT" else ""
            raise LaunchEnvError(f"{key}={text!r}: must be an integer >= {low}{port}")
    if numbers["RANK"] >= numbers["WORLD_SIZE"]:
        raise LaunchEnvError(
            f"RANK={env['RANK']!r}: must be below WORLD_SIZE={env['WORLD_SIZE']!r}"
        )
    if numbers["WORLD_SIZE"] > 1 and not ({"TORCHELASTIC_RUN_ID", "LOCAL_RANK"} & set(env)):
        shown = ", ".join(f"{k}={env[k]}" for k in LAUNCH_VARS)
        raise LaunchEnvError(
            f"{shown} are set but TORCHELASTIC_RUN_ID and LOCAL_RANK are not: stale launcher "
            "variables (left in the shell?) would make this rank wait for peers that never "
            "come; unset them, launch with torchrun, or set LOCAL_RANK if another launcher "
            "started this process"
        )


def init_from_env(
    *, timeout_s: float = 300, backend: str | None = None, device: str | None = None
) -> tuple[int, int, torch.device]:
    """Join the world torchrun set up; return (rank, world_size, device).

    By default backend "nccl" with device cuda:LOCAL_RANK (made current) when CUDA is
    available, else "gloo" on CPU. ``backend`` and ``device`` override that: "gloo" on "cuda"
    puts each rank on cuda:(LOCAL_RANK % GPUs), so several ranks may share a GPU; "nccl" on
    "cpu" is refused. The device is also ``rank_device()`` from then on. Collectives that do
    not complete within ``timeout_s`` raise instead of hanging. If a default group already
    exists it is reused.
    """
    global _RANK_DEVICE
    check_timeout(timeout_s)
    backend, where = choose_where(backend, device, torchrun=True)
    if not dist.is_initialized():
        check_launch_env(os.environ)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # NCCL: one GPU per rank (it refuses two ranks on one GPU); gloo ranks may share one
    who = f"LOCAL_RANK={local_rank}"
    _RANK_DEVICE = _use_cuda(local_rank, who) if where == "cuda" else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return dist.get_rank(), dist.get_world_size(), _RANK_DEVICE


LEAVE_TIMEOUT_S = 60.0
"""How long ``leave_world`` waits for the other ranks to reach the end before giving up."""


def leave_world(*, timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Leave the default process group at the end of a run: a barrier bounded by ``timeout_s``,
    then ``destroy_process_group``. Returns whether every rank reached the barrier (False when
    there was no group, or a peer did not come; then the group is left as it is, since taking
    it down could wait on that peer's pending collective).

    Why: a process that exits with the group alive has the backend's worker threads, and work
    objects holding tensors, torn down during interpreter finalization, which can abort the
    process (SIGABRT) after its work is done; torchrun then reports a failed run. The barrier
    lets no rank close its connections while a peer still reads from them.
    """
    check_timeout(timeout_s)
    if not dist.is_initialized():
        return False
    try:  # the barrier is the watchdog's last exchange: a rank leaving early is named
        watchdog.leave("its entry point returned", timeout_s=timeout_s)
    except watchdog.CollectiveError:
        raise  # ranks disagree: this one left while others still train, or the reverse
    except Exception:
        return False
    dist.destroy_process_group()
    return True


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
    os.environ[beacon.DIR_VAR] = store_dir  # heartbeats (zero/beacon.py) go beside the store
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
        if dist.is_initialized():
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
    if message[0] == "ok":
        try:
            # Nobody leaves while a peer may still be reading its last collective's data; and a
            # rank that returns while others still train is named by them (zero/watchdog.py).
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


def _silent_exit(proc, rank: int) -> str:
    how = f"code {proc.exitcode}"
    if proc.exitcode is not None and proc.exitcode < 0:
        how = f"signal {-proc.exitcode}"
    return watchdog.blame_line([rank], f"its process exited ({how}) without reporting")


def _collect(procs, conns, ranks, timeout_s: float | None, *, what: str) -> list:
    """Wait for one message from each of ``ranks``; return the payloads in rank order.

    Raises RankError on the first error (or on a rank that died without a word) and TimeoutError
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
                    status, payload = "error", _silent_exit(proc, rank)
                except Exception:  # a result that does not unpickle here
                    status, payload = "error", traceback.format_exc()
            elif not proc.is_alive():
                status, payload = "error", _silent_exit(proc, rank)
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
    ``timeout_s``, and the watchdog then names the rank to blame: zero/watchdog.py) on its
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
    ctx = mp.get_context("fork")
    # Signals wait (recorded, not raised) until every process is started and the janitor
    # knows them, and again during the cleanup: see zero/launch_signals.py.
    with SignalGuard() as guard, tempfile.TemporaryDirectory(prefix="zero-spawn-") as store_dir:
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
            results = _collect(procs, conns, range(world_size), deadline_s, what="spawn")
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
        self._store_dir = store = tempfile.mkdtemp(prefix="zero-pool-")
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
                return _collect(self._procs, self._conns, ranks, timeout_s, what=repr(self))
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
