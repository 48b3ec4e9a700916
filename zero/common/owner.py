"""Who made a file on this machine and whether that process still runs; folders a process
removes on every way out it can run itself.

Legend: a record is identity()'s dict: pid, host, proc_start (the process's start in clock ticks
after boot, /proc/PID/stat field 22) and boot_id (/proc/sys/kernel/random/boot_id). Together they
tell the owner from a process that got its pid later, or from one of an earlier boot.

    is_dead_here(record)   the owner ran on this host and runs no more: what it left may go
    remove_at_exit(path)   path (a folder this process made) goes when the process ends
    remove_now(path)       path goes now, if this process registered it

Used by zero/checkpoint/lock.py (stale run locks) and zero/zero_r/disk.py (the disk tier's
folders); [Note: a folder's last exit] says which exits remove_at_exit covers and which it
cannot.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing.util
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

# -- who owns it ---------------------------------------------------------------------------------


def proc_start(pid) -> int | None:
    """Start time of process `pid` in clock ticks after boot (/proc/PID/stat field 22)."""
    try:
        raw = Path(f"/proc/{int(pid)}/stat").read_text()
        return int(raw[raw.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, TypeError, IndexError):
        return None


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def alive(pid) -> bool:
    """Whether a process `pid` exists here (another user's counts; a pid unreadable: assumed)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # another user's process, or no pid to check: assume it runs
    return True


def identity() -> dict:
    """This process's record: pid, host, proc_start, boot_id."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "proc_start": proc_start(pid),
            "boot_id": boot_id()}  # fmt: skip


def is_dead_here(record: dict) -> bool:
    """The record's process ran on this host and is no longer running: its pid runs no more, or
    runs another process (another start time), or the host rebooted since (another boot id).
    Another host's record is never dead here: its pids cannot be checked from this one."""
    if record.get("host") != socket.gethostname():
        return False
    now = boot_id()
    if record.get("boot_id") and now and record["boot_id"] != now:
        return True  # this host rebooted since: every process of then is gone
    if not alive(record.get("pid")):
        return True
    then, start = record.get("proc_start"), proc_start(record.get("pid"))
    return then is not None and start is not None and start != then


# -- folders removed on the way out ---------------------------------------------------------------

# [Note: a folder's last exit] A folder registered by remove_at_exit is removed on every exit the
# process runs itself: an exception that ends it and a normal end (atexit); the end of a forked
# multiprocessing child, which skips atexit (multiprocessing's own exit finalizers, which it does
# run); and SIGTERM, SIGHUP or SIGINT where their action was the default one, to end the process
# (an ignored signal or another handler is left alone: the exits above then cover it). For those
# signals a handler removes the folders and ends the process by the same signal, as before, so
# the parent sees the same status. Python runs handlers only in the main thread between
# bytecodes, and a rank waiting in a collective may not get there for minutes; so a thread woken
# through the signal wakeup fd does the same at once. A child forked later inherits neither the
# registry's folders (each is removed only by the pid that made it) nor the handlers, which the
# fork resets to the default. What no process can clean after itself, SIGKILL (an OOM kill, a
# killed job), is for the next run to find (zero/zero_r/disk.py, [Note: stale state folders]).

_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_OWNED: dict[str, int] = {}  # folder -> the pid that made it
_STATE: dict = {"hooked": None, "wakeup": None, "at_fork": False}


def remove_at_exit(path) -> None:
    """Register `path`, a folder this process just made, for removal on every exit the process
    runs itself ([Note: a folder's last exit])."""
    _hook()
    _OWNED[str(path)] = os.getpid()


def remove_now(path) -> None:
    """Remove `path` if this process registered it (a forked child never removes its parent's),
    and forget it. A folder removed meanwhile by someone else is no error."""
    key = str(path)
    if _OWNED.get(key) != os.getpid():
        return
    _rmtree(key)
    _OWNED.pop(key, None)


def _rmtree(path: str) -> None:
    for _ in range(3):  # a file made during the walk (construction in another thread) stays
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return


def _remove_owned() -> None:
    pid = os.getpid()
    for path, maker in list(_OWNED.items()):
        if maker == pid:
            _rmtree(path)
            _OWNED.pop(path, None)


def _hook() -> None:
    """Once per process: the exit hooks and the signal handlers."""
    if _STATE["hooked"] == os.getpid():
        return
    _STATE["hooked"] = os.getpid()
    atexit.register(_remove_owned)
    multiprocessing.util.Finalize(None, _remove_owned, exitpriority=10)  # a forked child's exit
    if not _STATE["at_fork"]:
        os.register_at_fork(after_in_child=_after_fork)
        _STATE["at_fork"] = True
    if threading.current_thread() is not threading.main_thread():
        return  # handlers are set from the main thread only; the exits above still hold
    mine = [s for s in _SIGNALS if signal.getsignal(s) == signal.SIG_DFL]
    if not mine:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    theirs = signal.set_wakeup_fd(write)
    if theirs != -1:  # someone else's (asyncio's) stays; the handler alone acts
        signal.set_wakeup_fd(theirs)
        os.close(read)
        os.close(write)
    else:
        _STATE["wakeup"] = (read, write)
        threading.Thread(target=_watch, args=(read,), name="zero-owner", daemon=True).start()
    for s in mine:
        signal.signal(s, _on_signal)


def _on_signal(signum, frame) -> None:
    _end(signum)


def _watch(read: int) -> None:
    """The thread that acts on a signal while the main thread cannot (a C call, a collective)."""
    with contextlib.suppress(OSError):  # the pipe closed under it: nothing left to watch
        while data := os.read(read, 64):
            for signum in data:
                if signal.getsignal(signum) is _on_signal:
                    _end(signum)


def _end(signum: int) -> None:
    """Remove the folders, then end the process by `signum` with its default action."""
    _remove_owned()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # only the main thread may set a handler in Python; the C library may, from any
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            libc.signal.restype = ctypes.c_void_p
            libc.signal(signum, None)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # the signal ends the process meanwhile; where it could not:
    os._exit(128 + signum)


def _after_fork() -> None:
    """In a forked child: the parent's handlers and wakeup pipe are not the child's."""
    _STATE["hooked"] = None
    wakeup, _STATE["wakeup"] = _STATE["wakeup"], None
    if wakeup is not None:
        read, write = wakeup
        os.close(read)
        null = os.open(os.devnull, os.O_WRONLY)  # the number no longer reaches the parent's pipe
        os.dup2(null, write, inheritable=False)
        os.close(null)
        with contextlib.suppress(ValueError):  # (set only from the main thread: the forking one)
            now = signal.set_wakeup_fd(-1)
            if now != write:
                signal.set_wakeup_fd(now)  # not ours: theirs, set since, stays
            os.close(write)
    for s in _SIGNALS:
        with contextlib.suppress(ValueError):
            if signal.getsignal(s) is _on_signal:
                signal.signal(s, signal.SIG_DFL)
