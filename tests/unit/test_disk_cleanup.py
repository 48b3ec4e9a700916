"""What the disk tier (zero/zero_r/disk.py) does with folders in offload_dir, in one process and
without a process group: an owner's record and whether it runs (zero/common/owner.py); stale
folders found at start, removed in one `note:` line each, and every other folder left alone
([Note: stale state folders]); ranks clearing one offload_dir at once; a disk too small refused
before any file; a forked child never removing its parent's folder ([Note: a folder's last
exit]). The exits of real processes are tests/distributed/test_disk_exits.py's."""

import gc
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zero.common import owner
from zero.common.traffic import CommCounter
from zero.zero_r import disk
from zero.zero_r.disk import OWNER, PREFIX, DiskOffload

HOST = socket.gethostname()
REPO = Path(__file__).resolve().parents[2]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def offload(directory: Path, needed: int = 0) -> DiskOffload:
    return DiskOffload(
        directory=directory, needed=needed, device=torch.device("cpu"), counter=CommCounter(),
        grad_dtype=torch.float32, compute_dtype=torch.float32,
    )  # fmt: skip


def plant(directory: Path, name: str, record, nbytes: int = 8192) -> Path:
    """A folder as a disk tier leaves it: a state file, and the record (a dict, or text)."""
    d = directory / f"{PREFIX}{name}"
    d.mkdir()
    (d / "u0000-master.f32").write_bytes(b"\1" * nbytes)
    if record is not None:
        (d / OWNER).write_text(record if isinstance(record, str) else json.dumps(record))
    return d


def allocated(d: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in d.iterdir())


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(0.2)
    yield p
    p.kill()
    p.wait()


def test_an_owner_record_tells_a_dead_owner_from_a_live_one(sleeper):
    me = owner.identity()
    assert (me["pid"], me["host"]) == (os.getpid(), HOST) and me["boot_id"]
    assert me["proc_start"] == owner.proc_start(os.getpid()) > 0
    assert not owner.is_dead_here(me)
    assert not owner.is_dead_here({**me, "pid": sleeper.pid, "proc_start": None})
    assert owner.is_dead_here({**me, "pid": dead_pid()})
    assert owner.is_dead_here({**me, "proc_start": me["proc_start"] + 1})  # the pid reused
    assert owner.is_dead_here({**me, "boot_id": "another boot"})
    assert not owner.is_dead_here({**me, "pid": dead_pid(), "host": "elsewhere.invalid"})


def test_dead_owners_folders_go_at_start_and_no_other(tmp_path, capsys, sleeper):
    """Removed: a dead owner's folder, and one whose pid now runs another process. Kept: a live
    owner's (this process, a sleeping child), another host's, a folder without a record (young:
    not even named; old: named), and a folder a live process is removing."""
    me = owner.identity()
    dead, reused = dead_pid(), {**me, "proc_start": me["proc_start"] + 1}
    gone = {
        plant(tmp_path, "dead", {"pid": dead, "host": HOST, "started": "then"}): dead,
        plant(tmp_path, "reused", {**reused, "started": "then"}): os.getpid(),
    }
    sizes = {d: allocated(d) for d in gone}
    kept = [
        plant(tmp_path, "mine", me),
        plant(tmp_path, "child", {**me, "pid": sleeper.pid, "proc_start": None}),
        plant(tmp_path, "foreign", {"pid": dead_pid(), "host": "elsewhere.invalid"}),
        plant(tmp_path, "young", None),
        plant(tmp_path, "old", None),
        plant(tmp_path, "torn", '{"pid": 1'),
        plant(tmp_path, f"removing-{sleeper.pid}-x", {"pid": dead_pid(), "host": HOST}),
    ]
    long_ago = time.time() - 2 * disk.UNKNOWN_AFTER_S
    for name in ("old", "torn"):
        os.utime(tmp_path / f"{PREFIX}{name}", (long_ago, long_ago))
    o = offload(tmp_path)
    notes = capsys.readouterr().err.splitlines()
    where = f"offload_dir={str(tmp_path)!r}"
    assert sorted(notes) == sorted(
        [
            f"note: {where}: removed {d}, the state files of pid {pid} (started then), which "
            f"runs no more: {sizes[d]:,} bytes freed"
            for d, pid in gone.items()
        ]
        + [
            f"note: {where}: {tmp_path / (PREFIX + name)} has no readable {OWNER} (a run killed "
            "while making it, or another program's); left alone: remove it if no run uses it"
            for name in ("old", "torn")
        ]
    )
    assert all(d.is_dir() for d in kept) and not any(d.exists() for d in gone)
    assert sorted(tmp_path.iterdir()) == sorted([*kept, o.root])
    record = json.loads((o.root / OWNER).read_text())  # written before any state file
    assert {k: record[k] for k in me} == me and os.listdir(o.root) == [OWNER]
    o.remove()
    assert not o.root.exists()


def _clear(directory: str, go, q) -> None:
    go.wait()
    notes = []
    try:
        disk.clear_stale(Path(directory), say=notes.append)
        q.put(notes)
    except BaseException as exc:
        q.put(repr(exc))


def test_ranks_starting_together_remove_each_dead_folder_once(tmp_path):
    """Four processes clear one offload_dir holding twelve dead owners' folders at once: every
    folder is gone, each named in exactly one note, and nothing failed."""
    dead = [plant(tmp_path, f"{i}", {"pid": dead_pid(), "host": HOST}) for i in range(12)]
    ctx = mp.get_context("fork")
    go, q = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_clear, args=(str(tmp_path), go, q)) for _ in range(4)]
    for p in procs:
        p.start()
    go.set()
    try:
        got = [q.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
    assert all(isinstance(g, list) for g in got), got
    named = sorted(n.split(": removed ")[1].split(",")[0] for g in got for n in g)
    assert named == sorted(str(d) for d in dead)
    assert list(tmp_path.iterdir()) == []


def test_a_disk_too_small_is_refused_before_any_file(tmp_path, monkeypatch):
    """statvfs says fewer free bytes than the rank's state files need: ValueError in one line
    naming offload_dir, the bytes needed and the bytes free, and nothing made. As many bytes as
    needed are enough."""
    free = 7 * 4096

    def statvfs(path):
        assert Path(path) == tmp_path
        return os.statvfs_result((4096, 4096, 100, 7, 7, 100, 50, 50, 0, 255))

    monkeypatch.setattr(os, "statvfs", statvfs)
    with pytest.raises(ValueError) as exc:
        offload(tmp_path, needed=free + 1)
    assert str(exc.value) == (
        f"offload_dir={str(tmp_path)!r}: this rank's master and optimizer states need "
        f"{free + 1:,} bytes there and {free:,} bytes are free; give a folder on a disk with room "
        "for them, or free space (nothing was written)"
    )
    assert list(tmp_path.iterdir()) == []
    offload(tmp_path, needed=free).remove()
    assert list(tmp_path.iterdir()) == []


HELD = []


def _forget_and_collect() -> None:
    HELD.clear()  # the parent's DiskOffload, inherited: its last reference here
    gc.collect()


def test_a_forked_child_never_removes_its_parents_folder(tmp_path):
    """A child forked while this process holds a disk tier collects its copy and ends: the
    folder is the parent's, and stays."""
    HELD.append(offload(tmp_path))
    root = HELD[0].root
    p = mp.get_context("fork").Process(target=_forget_and_collect)
    p.start()
    p.join(60)
    assert p.exitcode == 0 and root.is_dir() and (root / OWNER).is_file()
    HELD.pop().remove()
    assert not root.exists()


CHILD_SIGNAL = """
import os, signal, sys, time
import torch
sys.path.insert(0, {repo!r})
from tests.unit.test_disk_cleanup import offload
from pathlib import Path

o = offload(Path({directory!r}))
pid = os.fork()
if pid == 0:  # a handler of its own: Python writes the signal to the wakeup fd, if one is set
    signal.signal(signal.SIGTERM, lambda *a: os._exit(3))
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
time.sleep(1.0)  # time for the parent's watcher thread to act, were the signal passed on
print("alive", os.waitstatus_to_exitcode(status), o.root.is_dir(), flush=True)
"""


def test_a_forked_childs_signals_never_reach_its_parent(tmp_path):
    """The parent's signal wakeup pipe is not the child's: a child forked from a process that
    holds a disk tier, ended by SIGTERM through a handler of its own, does not end the parent
    (which would also remove its folder). Run in a process of its own, which it could end."""
    script = CHILD_SIGNAL.format(repo=str(REPO), directory=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["alive", "3", "True"], (
        proc.returncode,
        proc.stdout,
        proc.stderr,
    )
    assert list(tmp_path.iterdir()) == []  # and it went at the parent's exit


HOOKS = """
import os, signal, sys, tempfile, threading
sys.path.insert(0, {repo!r})
from zero.common import owner

case, folder = sys.argv[1], tempfile.mkdtemp(dir={directory!r})
# what the process was started with (a parent under nohup ignores SIGHUP, for one)
print(*(signal.getsignal(s) == signal.SIG_DFL for s in owner._SIGNALS), flush=True)
if case == "thread":  # made off the main thread: no handler can be set from there
    t = threading.Thread(target=owner.remove_at_exit, args=(folder,))
    t.start()
    t.join()
elif case == "taken":  # SIGTERM ignored, SIGHUP handled by another, SIGINT Python's own
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, lambda *a: None)
    owner.remove_at_exit(folder)
elif case == "wakeup":  # another's wakeup fd (as asyncio sets one): it stays theirs
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    owner.remove_at_exit(folder)
    assert signal.set_wakeup_fd(w) == w
print(*(signal.getsignal(s) is owner._on_signal for s in owner._SIGNALS), flush=True)
if case == "wakeup":
    os.kill(os.getpid(), signal.SIGTERM)  # the handler alone, in the main thread
    signal.pause()
"""


@pytest.mark.parametrize(
    "case, handled, status",
    [("thread", "False False False", 0), ("taken", "False False False", 0),
     ("wakeup", "True True False", -signal.SIGTERM)],
)  # fmt: skip
def test_signal_handlers_are_set_only_over_the_default_action(tmp_path, case, handled, status):
    """[Note: a folder's last exit] in a process without torch: no handler is set off the main
    thread, over an ignored signal or over another's handler (SIGINT's KeyboardInterrupt
    included), and another's signal wakeup fd stays theirs; the folder goes at exit all the
    same, and with the handler alone SIGTERM still removes it and ends the process by SIGTERM."""
    script = HOOKS.format(repo=str(REPO), directory=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", script, case], capture_output=True, text=True, timeout=60
    )
    started, got = proc.stdout.strip().splitlines()
    if case == "wakeup":  # a handler exactly over the signals left at their default action
        handled = " ".join(
            str(want == "True" and default == "True")
            for want, default in zip(handled.split(), started.split(), strict=True)
        )
    assert (proc.returncode, got) == (status, handled), (started, proc.stderr)
    assert list(tmp_path.iterdir()) == []
