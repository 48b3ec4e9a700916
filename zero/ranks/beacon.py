"""Heartbeats: where each rank is, published for its peers, so that a failed collective can say
which rank stopped, left, or never came.

Legend: a rank's *beacon* is one small JSON record: its state ("running", "failed", "left"), a
beat counter its heartbeat thread advances every BEAT_S seconds, the last collective it launched
and the one it is waiting in (sequence number and description, zero/ranks/watchdog.py), its last
engine call, its pid and host. One Beacon per process (module-level, started by the first engine
that has peers); engines update its fields in memory (a few attribute writes per collective) and the
thread writes the record out.

Where the records go (a transport): a directory of one file per rank when zero.ranks.launch started
the ranks (ZERO_WATCHDOG_DIR, inside the launch's own temporary directory, removed with it; each
write is a fresh exclusive temporary file renamed over the old one, never following a link);
otherwise the default process group's store under the prefix "zero-watchdog/" (torchrun's TCP store,
which its agent keeps serving when ranks die). With neither, there are no beacons and a failed
collective is reported without them.

[Note: reading a silent rank] A peer is *not responding* when its beat counter does not advance over
2.5 beats of our own clock: no clocks are compared across machines. On one host the pid tells a
stopped process (state T) from a gone one."""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time

import torch.distributed as dist

BEAT_S = 0.5
"""Seconds between heartbeats."""

DIR_VAR = "ZERO_WATCHDOG_DIR"
"""Environment variable naming the directory of beacon files (set by zero.ranks.launch's
children)."""


def describe(rec) -> str:
    """A collective as people read it: '#57 (step 3: reduce_scatter grad, unit 2, 1024 el)'."""
    unit = "" if rec.unit is None else f", unit {rec.unit}"
    seq = getattr(rec, "seq", None)
    return f"#{seq} (step {rec.step}: {rec.op} {rec.phase}{unit}, {rec.elements} el)"


def _seq_and_text(rec) -> tuple[int, str] | None:
    return None if rec is None else (getattr(rec, "seq", None) or 0, describe(rec))


class DirTransport:
    def __init__(self, path: str):
        self.path = path

    def put(self, rank: int, text: str) -> None:
        final = os.path.join(self.path, f"beacon-{rank}")
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        # O_EXCL|O_NOFOLLOW: never write through a planted name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, final)

    def get(self, rank: int) -> str | None:
        try:
            fd = os.open(os.path.join(self.path, f"beacon-{rank}"), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            return os.read(fd, 1 << 16).decode(errors="replace")
        finally:
            os.close(fd)


class StoreTransport:
    def __init__(self, store):
        self.store = dist.PrefixStore("zero-watchdog/", store)

    def put(self, rank: int, text: str) -> None:
        self.store.set(str(rank), text)

    def get(self, rank: int) -> str | None:
        key = str(rank)
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None


def _transport():
    if os.environ.get(DIR_VAR):
        return DirTransport(os.environ[DIR_VAR])
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return StoreTransport(get_store()) if get_store is not None else None
    except Exception:  # a group without a store (e.g. a fake one): no beacons
        return None


class Beacon:
    """This process's heartbeat (see the module docstring). Fields are set by the main thread;
    the heartbeat thread publishes them."""

    def __init__(self, rank: int, transport):
        self.rank, self.transport = rank, transport
        self.state, self.beats = "running", 0
        self.launched = None  # the record (zero.collectives.CommRecord) of the last launch
        self.waiting = None  # the record of the collective being waited in
        self.call = ""  # the last engine call (zero/ranks/watchdog.py's boundaries)
        self.note = ""  # why, for state "failed" or "left"
        self._seen: dict[int, tuple] = {}  # peer -> ((pid, beats) last read, when first read)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="zero-heartbeat", daemon=True)
        self.publish()
        self._thread.start()

    def record(self) -> dict:
        return {
            "state": self.state,
            "beats": self.beats,
            "launched": _seq_and_text(self.launched) or (0, ""),
            "waiting": _seq_and_text(self.waiting),
            "call": self.call,
            "note": self.note,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def publish(self) -> None:
        with self._lock:  # the main thread publishes at state changes, the thread every beat
            try:
                self.transport.put(self.rank, json.dumps(self.record()))
            except Exception:
                pass  # a beacon is advice; a store or directory gone at teardown is not an error

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.beats += 1
            self.publish()

    def set_state(self, state: str, note: str = "") -> None:
        self.state, self.note = state, note
        self.publish()

    def read(self, rank: int) -> dict | None:
        try:
            text = self.transport.get(rank)
            return None if text is None else json.loads(text)
        except Exception:
            return None

    def silence(self, rank: int) -> tuple[dict | None, float]:
        """(rank's record, seconds on this rank's clock since its beat counter last changed);
        (None, 0.0) while it has published nothing. Called by the main thread only: a counter
        seen equal at two readings did not advance in between (it only grows), so the time
        since its first reading is a lower bound of its silence, and a rank restarted under
        another pid counts as changed."""
        record, now = self.read(rank), time.monotonic()
        if record is None:
            return None, 0.0
        key = (record.get("pid"), record.get("beats"))
        first = self._seen.get(rank)
        if first is None or first[0] != key:
            self._seen[rank] = (key, now)
            return record, 0.0
        return record, now - first[1]

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * BEAT_S)


_BEACON: Beacon | None = None


def beacon() -> Beacon | None:
    """This process's beacon, started on first use (None without a transport)."""
    global _BEACON
    if _BEACON is None and dist.is_initialized():
        transport = _transport()
        if transport is not None:
            _BEACON = Beacon(dist.get_rank(), transport)
    return _BEACON


def current() -> Beacon | None:
    """The beacon if one was started (never starts one)."""
    return _BEACON


def leaving(note: str) -> None:
    """Mark this rank as having left the run (its peers then name it if they wait for it)."""
    if _BEACON is not None:
        _BEACON.set_state("left", note)


def _at_exit() -> None:
    global _BEACON
    if _BEACON is not None:
        if _BEACON.state == "running":
            _BEACON.set_state("left", "its process exited")
        _BEACON.stop()  # joined before the interpreter tears down
        _BEACON = None


atexit.register(_at_exit)


def process_state(record: dict) -> str:
    """'stopped', 'gone' or '' for a peer's pid on this host ([Note: reading a silent rank])."""
    if record.get("host") != socket.gethostname():
        return ""
    try:
        with open(f"/proc/{int(record['pid'])}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError, KeyError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "")


def survey(peers, *, wait_s: float = 2.5 * BEAT_S) -> dict[int, tuple[dict | None, bool]]:
    """{peer: (its record, whether its heartbeat advanced over wait_s)}."""
    b = current()
    if b is None:
        return {}
    first = {p: b.read(p) for p in peers}
    time.sleep(wait_s)
    out = {}
    for p in peers:
        now = b.read(p)
        before = first[p]
        moved = now is not None and (before is None or now.get("beats") != before.get("beats"))
        out[p] = (now, moved)
    return out


def _forget_in_child() -> None:
    global _BEACON
    _BEACON = None  # a forked child has no heartbeat thread: it starts its own beacon


os.register_at_fork(after_in_child=_forget_in_child)
