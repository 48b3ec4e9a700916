"""Clean shutdown of a local world: signals to the launcher, and the launcher's death.

zero.ranks.launch forks the ranks; this module makes sure none outlives the process that forked it
and no rendezvous directory is left in the temporary folder (docs/design.md §5, "Shutdown").

- ``SignalGuard``: in the launcher (main thread only), SIGTERM and SIGINT raise ``Interrupted``
  where the launcher waits for its ranks, so that it ends them and removes the directory before
  it leaves; the previous handlers come back afterwards. The CLIs turn ``Interrupted`` into one
  line and exit status 128 + signal (``zero.common.cli.run``).
- ``guard_child``: in each rank, SIGINT is ignored (a terminal's Ctrl-C reaches the whole process
  group; the launcher alone handles it) and the rank asks the kernel for SIGKILL when the
  launcher dies (PR_SET_PDEATHSIG), which also ends a stopped rank; a thread watching the parent
  stands in where that is not available.
- ``Janitor``: a small forked process that outlives a launcher killed outright (SIGKILL, the OOM
  killer), which can clean nothing itself: when the launcher's end of its pipe closes without a
  word, it kills the ranks and removes the directory.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import threading
import time
import warnings

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WATCH_S = 0.2
"""How often a rank without PR_SET_PDEATHSIG checks that its launcher is alive."""

_RELEASED = b"r"
"""Written to a Janitor's pipe by a launcher that cleaned up itself: leave the ranks alone."""


class Interrupted(KeyboardInterrupt):
    """The launcher was asked to stop (SIGINT or SIGTERM); every rank has been ended and the
    rendezvous directory removed. A KeyboardInterrupt (so a BaseException): code that handles
    a failed world (``except Exception``) must not swallow a request to stop, and pytest and
    notebooks treat it as the interrupt it is."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_status = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        super().__init__(
            f"stopped by {signal.Signals(signum).name}: every rank was ended and the "
            "rendezvous directory removed"
        )


class SignalGuard:
    """While entered (in the main thread), SIGINT and SIGTERM are caught. Before ``arm()`` (while
    forking, say) a signal is only recorded; armed, it raises Interrupted at once; after
    ``disarm()`` (while cleaning up) it is recorded again, and leaving the block raises it.
    The handlers found on entry are put back on exit. Off the main thread it does nothing:
    Python runs handlers there only."""

    def __init__(self):
        self.caught: int | None = None
        self._armed = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.caught is None:
            self.caught = signum
        if self._armed:
            self._armed = False  # once: a second Ctrl-C must not interrupt the cleanup
            raise Interrupted(signum)

    def arm(self) -> None:
        if self.caught is not None:
            raise Interrupted(self.caught)
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def __exit__(self, kind, exc, tb) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self.caught is not None and not isinstance(exc, Interrupted):
            raise Interrupted(self.caught) from exc


# ---------------------------------------------------------------------------------------------
# In each rank

_parent = {"pid": None, "main": True}
"""Who forks the ranks, recorded by ``before_fork`` and read by ``guard_child`` in the child."""


def before_fork() -> None:
    """Called by the launcher just before it forks ranks: the children learn their parent."""
    _parent["pid"] = os.getpid()
    _parent["main"] = threading.current_thread() is threading.main_thread()


def _set_pdeathsig(signum: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_S)
    os.kill(os.getpid(), signal.SIGKILL)


def guard_child() -> None:
    """First thing in a forked rank: ignore SIGINT, take SIGTERM's default (the launcher's
    handler was inherited with the fork), and die with the launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = _parent["pid"]
    # The kernel sends the parent-death signal when the *thread* that forked exits, so it is
    # only safe when that thread is the main one, which lives as long as the process.
    if not (_parent["main"] and _set_pdeathsig(signal.SIGKILL)):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def stopped_by_signal(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP, SIGTSTP; state T in /proc): a rank that does not
    report may be stopped rather than slow. False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # after the command name
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def oom_kills() -> int | None:
    """The kernel's count of processes its out-of-memory killer has killed (oom_kill in
    /proc/vmstat, Linux 4.13 on); None where it cannot be read."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def how_it_ended(exitcode: int | None, oom_before: int | None) -> str:
    """A rank's end as people read it: 'exit code 3', or 'signal 9 (SIGKILL)' with, for SIGKILL,
    whether the kernel's out-of-memory killer is the likely cause: it killed a process since
    `oom_before` (oom_kills() when the ranks started), or nothing can tell."""
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    num = -exitcode
    try:
        name = signal.Signals(num).name
    except ValueError:
        name = "an unnamed signal"
    text = f"signal {num} ({name})"
    if num != signal.SIGKILL:
        return text
    now = oom_kills()
    if now is None or oom_before is None:
        return f"{text}, killed from outside or by the kernel when out of memory"
    if now > oom_before:
        return (
            f"{text}, out of memory most likely (the kernel's out-of-memory killer has killed "
            f"{now - oom_before} process(es) since the ranks started)"
        )
    return f"{text}, killed from outside (the kernel's out-of-memory killer killed none)"


# ---------------------------------------------------------------------------------------------
# In the launcher

_JANITOR_FDS: set[int] = set()
"""Write ends of live janitors' pipes: a process forked later must close them (``close_fds``),
or a janitor would not see its launcher die while that process lives."""


def close_fds() -> None:
    for fd in list(_JANITOR_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _JANITOR_FDS.clear()


# [Note: rendezvous folders of a job killed whole] The janitor cleans up after a launcher that
# dies alone; a job killed whole (SIGKILL to its process group, an OOM kill of the job, a lost
# machine) takes the janitor with it and leaves the launcher's folder in the temporary folder.
# So each launcher writes its owner's record there (zero/common/owner.py) as soon as it makes
# the folder, and each launch first removes the launchers' folders whose owner is dead on this
# host, one `note:` line each. A live owner's, another host's or a record-less one is left.
OWNER = "launcher.json"
PREFIXES = ("zero-spawn-", "zero-pool-")


def own_folder(directory: str) -> None:
    """Write this launcher's record into its new rendezvous folder (see the Note above)."""
    from ..common import owner

    with open(os.path.join(directory, OWNER), "w") as f:
        json.dump(owner.identity(), f)


def clear_dead_launchers(say=None) -> list[str]:
    """Remove the rendezvous folders in the temporary folder whose launcher is dead on this host
    (the Note above); returns them, each named in one line to say() (stderr by default)."""
    import tempfile

    from ..common import owner

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    root, removed = tempfile.gettempdir(), []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if not name.startswith(PREFIXES) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # no record: being made now, or not ours to judge
        if not isinstance(record, dict) or not owner.is_dead_here(record):
            continue
        taken = f"{path}.removing-{os.getpid()}"
        try:
            os.rename(path, taken)  # one remover wins; the others find it gone
        except OSError:
            continue
        shutil.rmtree(taken, ignore_errors=True)
        removed.append(path)
        say(f"note: removed {path}, the rendezvous folder of launcher pid {record.get('pid')}, "
            "which was killed with its ranks")  # fmt: skip
    return removed


class Janitor:
    """A forked helper that, if the launcher dies without ``release()``, kills ``pids`` and
    removes ``directory``. ``release()`` (the launcher cleaned up itself) ends it quietly."""

    def __init__(self, directory: str, pids: list[int]):
        read, self._write = os.pipe()
        with warnings.catch_warnings():
            # Python >= 3.12 warns when forking a multithreaded process; the janitor only
            # reads a pipe and removes files (no lock another thread may hold).
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:  # the janitor
            self._serve(read, directory, pids)
        os.close(read)
        _JANITOR_FDS.add(self._write)

    @staticmethod
    def _serve(read: int, directory: str, pids: list[int]) -> None:
        code = 0
        try:
            for s in SIGNALS:  # a signal to the launcher's group is the launcher's to handle
                signal.signal(s, signal.SIG_IGN)
            os.closerange(0, read)  # every other descriptor, pipes to ranks included
            os.closerange(read + 1, 1 << 16)
            if os.read(read, 1) != _RELEASED:  # EOF: the launcher died
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                shutil.rmtree(directory, ignore_errors=True)
        except BaseException:
            code = 1
        os._exit(code)

    def release(self) -> None:
        """The launcher has reaped the ranks and removes the directory itself."""
        if self._write in _JANITOR_FDS:
            _JANITOR_FDS.discard(self._write)
            try:
                os.write(self._write, _RELEASED)
            finally:
                os.close(self._write)
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass  # reaped already
