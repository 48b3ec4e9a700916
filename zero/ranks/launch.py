"""Starting ranks: the checks and devices every world shares, and joining a torchrun world.

Legend:
    N        world_size, the data-parallel degree N_d
    rank     this process's index in [0, N)
    world    N processes in one default process group (``dist.group.WORLD``)

Three ways in, one per situation (docs/design.md §5):
- ``init_from_env()`` (here): under ``torchrun`` (GPUs, multi-node). torchrun starts the
  processes and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; this joins that
  world. ``leave_world()`` is how a torchrun rank leaves at the end.
- ``spawn(fn, N, *args)`` (zero/ranks/local.py): a throwaway local world: fork N processes, run
  ``fn`` once, return every rank's result. No launcher of our own beyond this convenience.
- ``WorkerPool(N)`` / ``get_pool(N)`` (zero/ranks/local.py): N long-lived forked workers holding
  one process group, reused by many calls, so that tests do not pay for starting a world each.

Each rank has a device, ``rank_device()``: the CPU by default; with ``device="cuda"`` forked rank
r computes on cuda:(r % GPUs), so gloo ranks can share one GPU (NCCL refuses two ranks on one
device); under torchrun, cuda:LOCAL_RANK where the world is on GPUs.

[Note: fork] Forked children start at once where spawned ones re-import torch, which costs
seconds per world (docs/machine_notes.md, starting ranks). Two costs come with it:
- a child of a parent that has run a multithreaded torch op hangs in libgomp as soon as it uses
  more than one thread, so every child calls ``torch.set_num_threads(1)`` before anything else
  (one thread per rank is also what bitwise determinism wants, docs/design.md §2);
- CUDA cannot be used in a child of a parent that has initialised it, so backend="nccl" and
  device="cuda" are refused once the parent has touched CUDA (use torchrun there); the parent
  may count GPUs (``visible_gpus``, through NVML) but must not call the CUDA runtime.

Failure (docs/design.md §3, "not left to hang"): a rank that raises makes the parent raise
``RankError`` with that rank's traceback; a launcher environment that is incomplete or stale is
refused (``LaunchEnvError``) before joining. Under torchrun, a rank that stops (SIGSTOP) writes
nothing, so a peer whose watchdog blames it writes its error file for it ([Note: error file of a
silent rank]).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from . import watchdog

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")


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
            "(e.g. torchrun --standalone --nproc-per-node N -m ...) or use zero.ranks.local.spawn"
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
    _record_blame_at_exit()
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
    if not dist.is_initialized() or watchdog.stranded():  # a peer was named as stopped
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
# torchrun's error files
#
# [Note: error file of a silent rank] torchrun's summary ("Root Cause (first observed failure)")
# names the failed rank whose error file (TORCHELASTIC_ERROR_FILE, written by torch's
# ErrorHandler, which zero.common.cli.run calls for an error the watchdog explained) has the
# earliest timestamp; a rank without one gets the time torchrun reaped it. A dead rank is
# reaped first, and diverging ranks each write their own; but a stopped rank writes nothing
# and is reaped (SIGKILL) only after its peers failed, so the summary named a peer, rank 0,
# although the watchdog blamed the stopped one. So a rank that fails with a CollectiveError
# writes the error file of each blamed rank on its node that has none yet: the watchdog's
# report, timestamped a second before its own (the blamed rank stopped before the peer's
# collective timed out, so it did fail first). torchrun reads that file only if the blamed
# rank ends failed (it kills a stopped one); a blamed rank that writes its own replaces it.


def blamed_error_files(exc: BaseException, env=None, *, now: float | None = None) -> dict:
    """{path: torchrun error-file data} for the ranks a CollectiveError in `exc` (or in its
    causes) blames, other than this rank, that run on this node; {} outside torchrun, without
    a CollectiveError, or when the layout of the error files is not torchrun's
    (<attempt dir>/<local rank>/error.json). Pure: nothing is read or written."""
    env = os.environ if env is None else env
    blame = _collective_error(exc)
    own = env.get("TORCHELASTIC_ERROR_FILE", "")
    if blame is None or not own:
        return {}
    try:
        rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
        local_world = int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return {}
    folder, name = os.path.split(own)
    attempt, me = os.path.split(folder)
    if name != "error.json" or me != str(local):
        return {}
    report = str(blame).strip()
    first = report.splitlines()[0] if report else watchdog.BLAME
    stamp = int(time.time() if now is None else now) - 1
    out = {}
    for r in blame.blamed:
        peer = r - (rank - local)  # torchrun numbers a node's ranks consecutively
        if r == rank or not 0 <= peer < local_world:
            continue
        note = (
            f"rank {r} wrote no error file of its own (a stopped or silent rank); rank {rank}'s "
            "watchdog recorded this for it"
        )
        out[os.path.join(attempt, str(peer), "error.json")] = {
            "message": {
                "message": f"{type(blame).__name__}: {first}",
                "extraInfo": {"py_callstack": f"{note}:\n{report}\n", "timestamp": str(stamp)},
            }
        }
    return out


def record_blamed(exc: BaseException, env=None) -> list[str]:
    """Write blamed_error_files(exc) where no error file exists yet (a blamed rank's own, or
    another peer's, is kept); timestamped before this rank's own error file where that has
    been written. Returns the paths written. Never raises: the error being reported matters
    more than this note about it."""
    env = os.environ if env is None else env
    written = []
    try:
        now = time.time()
        own = env.get("TORCHELASTIC_ERROR_FILE", "")
        if own and os.path.isfile(own):
            with open(own) as f:
                data = json.load(f)
            now = min(now, float(data["message"]["extraInfo"]["timestamp"]))
        files = blamed_error_files(exc, env, now=now)
    except Exception:
        return written
    for path, data in files.items():
        try:
            with open(path, "x") as f:  # exclusive: the first writer wins, none is replaced
                json.dump(data, f)
            written.append(path)
        except OSError:
            continue
    return written


def _collective_error(exc: BaseException | None):
    """The first watchdog.CollectiveError in exc, its causes and contexts (None if none)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, watchdog.CollectiveError) and exc.blamed:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _record_blame_at_exit() -> None:
    """Under torchrun, an error that ends the process (after zero.common.cli.run has written
    this rank's error file) also writes the blamed ranks' (record_blamed); installed once."""
    if getattr(sys.excepthook, "_zero_blame", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        if value is not None:
            record_blamed(value)
        previous(kind, value, tb)

    hook._zero_blame = True
    sys.excepthook = hook
