"""One run per output directory: a lock file made exclusively, released at exit.

Legend: OUT the run's output directory; OUT/run.lock the lock, a JSON record of its holder: pid,
host, start time (`started`, wall clock; `proc_start`, the process's start in clock ticks after
boot, and `boot_id`, which tell a reused pid or a rebooted machine from the holder: the record
of zero/common/owner.py) and command line. Two runs writing one OUT would prune and overwrite
each other's checkpoints and logs, so the second is refused before it does any work, naming the
holder. The file appears whole and atomically (a hard link to a written temp file, atomic on
local and NFS file systems; else O_CREAT | O_EXCL | O_NOFOLLOW) and is removed by its holder at
exit.

[Note: stale locks] A holder killed without its cleanup (SIGKILL, an OOM kill of the whole job)
leaves the file behind. A lock whose holder is gone from this host (its pid runs no more, or runs
another process: a different start time or boot; owner.is_dead_here) is stale: it is cleared, with
one line saying whose it was, and the run goes on. A lock whose holder runs, or one made on another
host (whose pids cannot be checked from here), still refuses, naming pid, host and start time.
Clearing holds flock on OUT itself while it reads the record again and unlinks that very file (same
inode), so two runs clearing one stale lock at once cannot remove the lock the first of them has
just made; where the file system offers no flock, the stale lock is named and left to the user.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..common import owner

LOCK = "run.lock"
CLEAR_WAIT_S = 5.0
"""How long a run waits for another that is clearing the same stale lock (microseconds' work)."""


def _read(path: Path) -> tuple[dict | None, tuple | None]:
    """(the holder's record or None, (device, inode) of the file read or None if absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None, None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        try:
            record = json.loads(f.read(65536))
        except (OSError, ValueError):
            record = None
    return (record if isinstance(record, dict) else None), (st.st_dev, st.st_ino)


def _holder(path: Path) -> dict | None:
    return _read(path)[0]


_gone = owner.is_dead_here  # [Note: stale locks]: its holder made it here and runs no more
_proc_start = owner.proc_start  # the record's start time, read by the tests under this name


def _who(h: dict) -> str:
    return f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}"


def held_by(path: Path) -> str:
    """Why `path` (an existing lock) refuses a second run: who holds it and what to do."""
    h = _holder(path)
    if h is None:
        return (
            f"{path} exists but does not name its holder (a run stopped while creating it?); "
            f"if no run uses {path.parent}, remove {path} and start again"
        )
    if _gone(h):
        return (
            f"{path} is a stale lock: {_who(h)}, is no longer running, and it could not be "
            f"cleared here (no flock on this file system); if no run uses {path.parent}, "
            f"remove {path} and start again"
        )
    if h.get("host") != socket.gethostname():
        return (
            f"a run on another host holds {path} ({_who(h)}; its pid cannot be checked from "
            f"{socket.gethostname()}); wait for it to end or give another output directory (if "
            f"that run is gone, remove {path})"
        )
    return (
        f"another run holds {path} ({_who(h)}); wait for it to end or give another output "
        f"directory (if that run is gone, remove {path})"
    )


def _clear_stale(path: Path, seen: tuple) -> bool:
    """Unlink the stale lock `path` if it is still the file `seen` ((device, inode)) and still
    stale, holding flock on its directory meanwhile. False if another run got there first or
    the directory cannot be flocked."""
    try:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        end = time.monotonic() + CLEAR_WAIT_S
        while True:
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    return False
                time.sleep(0.01)
            except OSError:
                return False  # no flock here (some network file systems)
        h, now = _read(path)
        if now != seen or h is None or not _gone(h):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(dfd)  # releases the flock


def _record() -> dict:
    return {**owner.identity(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def acquire(directory, *, field: str = "out", say=_say) -> Path:
    """Create DIRECTORY/run.lock for this process or raise ValueError naming `field`, the
    directory and the holder. The directory is created if needed. A stale lock ([Note: stale
    locks]) is cleared and reported through say(one line)."""
    d = Path(directory)
    path = d / LOCK
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"{field}={str(d)!r} is not writable: cannot create {path} ({exc.strerror})"
        ) from None
    for _ in range(3):  # a stale lock cleared, then another run may win the race: refused
        try:
            if _create(path):
                break
            h, seen = _read(path)
            if h is None or not _gone(h) or not _clear_stale(path, seen):
                _, again = _read(path)
                if again is not None and again == seen:  # unchanged: it refuses
                    raise ValueError(f"{field}={str(d)!r} is in use: {held_by(path)}") from None
                continue  # it changed meanwhile: look again
            say(
                f"note: {field}={str(d)!r}: cleared the stale lock {path} ({_who(h)}, is no "
                "longer running)"
            )
        except OSError as exc:
            raise ValueError(
                f"{field}={str(d)!r} is not writable: cannot create {path} ({exc.strerror})"
            ) from None
    else:
        raise ValueError(f"{field}={str(d)!r} is in use: {held_by(path)}")
    for f in d.glob(f".{LOCK}.*.tmp"):  # _create's temp files of killed runs on this host
        host, _, pid = f.name[len(LOCK) + 2 : -4].rpartition(".")
        if host == socket.gethostname() and pid.isdigit() and not owner.alive(pid):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
    return path


def _create(path: Path) -> bool:
    """Make `path` holding this process's record, or return False if it exists. The record is
    written to a temp file first and hard-linked as `path` (atomic, also on NFS), so a lock is
    never seen empty or half-written; where hard links are not supported, `path` is created
    exclusively (O_CREAT | O_EXCL | O_NOFOLLOW) and then written."""
    data = json.dumps(_record()).encode()
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
    try:
        _write(os.open(tmp, flags | os.O_TRUNC, 0o644), data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
        try:
            _write(os.open(path, flags | os.O_EXCL, 0o644), data)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _write(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def release(path: Path) -> None:
    """Remove the lock if this process holds it (never another's)."""
    h = _holder(path)
    if h is not None and h.get("pid") == os.getpid() and h.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def locked(directory, *, field: str = "out"):
    """acquire(directory) for the duration of a with-block."""
    path = acquire(directory, field=field)
    try:
        yield path
    finally:
        release(path)
