"""One run per output directory: a lock file made exclusively, released at exit.

Legend: OUT the run's output directory; OUT/run.lock the lock, a JSON record of its holder
(pid, host, start time, command line). Two runs writing one OUT would prune and overwrite each
other's checkpoints and logs, so the second is refused before it does any work, naming the
holder. The file is created with O_CREAT | O_EXCL | O_NOFOLLOW (atomic on local and NFSv3+
file systems) and removed by its holder at exit. A holder killed without its cleanup (SIGKILL,
an OOM kill, a lost node) leaves the file behind: a lock whose pid is gone on this host is
reported as stale, with the command that clears it; it is never taken over silently, because
a pid on another host cannot be checked from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK = "run.lock"


def _holder(path: Path) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            record = json.loads(f.read(65536))
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # another user's process, or no pid to check: assume it runs
    return True


def held_by(path: Path) -> str:
    """Why `path` (an existing lock) refuses a second run: who holds it and what to do."""
    h = _holder(path)
    if h is None:
        return (
            f"{path} exists but does not name its holder (a run stopped while creating it?); "
            f"if no run uses {path.parent}, remove {path} and start again"
        )
    who = f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}"
    if h.get("host") == socket.gethostname() and not _alive(h.get("pid")):
        return (
            f"{path} is a stale lock: {who}, is no longer running; if no run uses "
            f"{path.parent}, remove {path} and start again"
        )
    return (
        f"another run holds {path} ({who}); wait for it to end or give another output "
        f"directory (if that run is gone, remove {path})"
    )


def acquire(directory, *, field: str = "out") -> Path:
    """Create DIRECTORY/run.lock for this process or raise ValueError naming `field`, the
    directory and the holder. The directory is created if needed."""
    d = Path(directory)
    path = d / LOCK
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
    }
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise ValueError(f"{field}={str(d)!r} is in use: {held_by(path)}") from None
    except OSError as exc:
        raise ValueError(
            f"{field}={str(d)!r} is not writable: cannot create {path} ({exc.strerror})"
        ) from None
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    return path


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
