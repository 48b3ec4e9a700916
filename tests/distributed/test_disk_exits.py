"""The disk tier leaves nothing behind (zero/zero_r/disk.py): every way a process holding one
can end, in real processes (tests/helpers/disk_child.py) and in a launcher's ranks. What a
process runs itself ([Note: a folder's last exit], zero/common/owner.py): an exception, a normal
end with the engine still referenced, SIGTERM, SIGINT and SIGHUP, also while the main thread
waits in a collective, and a state file removed under it; each such process still ends by its
own signal or status. What it cannot (SIGKILL) the next start over the same offload_dir removes,
in one `note:` line ([Note: stale state folders]). A file size limit at allocation is one line,
exit status 2, and no folder. Each test asserts the offload_dir empty afterwards."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers.disk_child import KEEP, engine, train
from tests.helpers.torchrun import REPO
from zero.ranks.launch import RankError
from zero.ranks.local import spawn

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
READY_S = 120.0
"""How long a child may take to import torch, build its engine and train a step (2 busy cores)."""
END_S = 10.0
"""How long a child may take to end after its signal: the watcher thread acts within ms."""


STARTED: list[subprocess.Popen] = []
"""Every child a test started: those still running when it ends, passed or failed, are killed."""


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Child:
    """tests/helpers/disk_child.py in a subprocess, its output in files under `tmp`."""

    def __init__(self, tmp: Path, directory: Path, action: str, *, rank=0, world=1, store=None):
        tmp.mkdir(parents=True, exist_ok=True)
        directory.mkdir(parents=True, exist_ok=True)
        self.out, self.err = tmp / f"out{rank}.txt", tmp / f"err{rank}.txt"
        store = store or tmp / "store"
        command = [sys.executable, "-m", "tests.helpers.disk_child", str(directory), str(store),
                   str(rank), str(world), action]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)
        STARTED.append(self.proc)

    def ready(self) -> Path:
        """The engine's folder, once built and trained a step."""
        deadline = time.monotonic() + READY_S
        while not self.out.read_text().startswith("ready "):
            assert self.proc.poll() is None, f"ended early ({self.proc.returncode}):\n{self.text}"
            assert time.monotonic() < deadline, f"not ready in {READY_S} s:\n{self.text}"
            time.sleep(0.05)
        return Path(self.out.read_text().split()[1])

    def end(self, timeout: float = 120.0) -> int:
        return self.proc.wait(timeout)

    @property
    def text(self) -> str:
        return self.err.read_text()


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}


def test_every_exit_a_process_runs_removes_its_folder(tmp_path):
    """Six processes at once, each over an offload_dir of its own: three signals while it trains
    (sleeps, here), an exception, a normal end with the engine still referenced, and a state
    file removed under it. Each folder is gone when its process has ended, and each process ends
    as it would without the disk tier (by the signal, or with its status)."""
    ways = [*SIGNALS, "raise", "exit", "tamper"]
    kids = {
        w: Child(tmp_path / w, tmp_path / w / "offload", "wait" if w in SIGNALS else w)
        for w in ways
    }
    roots = {w: kid.ready() for w, kid in kids.items() if w in SIGNALS}
    for w, root in roots.items():
        assert root.is_dir() and (root / "owner.json").is_file(), w
        kids[w].proc.send_signal(SIGNALS[w])
    ended = {w: kid.end() for w, kid in kids.items()}
    for w, kid in kids.items():
        # SIGINT is Python's KeyboardInterrupt, which the command line ends with 128 + 2
        want = {"raise": 1, "exit": 0, "tamper": 1, "SIGINT": 130}.get(w, -SIGNALS.get(w, 0))
        assert ended[w] == want, f"{w}: status {ended[w]}:\n{kid.text}"
        assert list((tmp_path / w / "offload").iterdir()) == [], f"{w}:\n{kid.text}"
    assert "u0000-exp_avg.f32 was removed" in kids["tamper"].text


def test_a_rank_waiting_in_a_collective_removes_its_folder_on_sigterm(tmp_path):
    """Rank 0 waits in a barrier rank 1 never joins: its main thread is in a C call, where
    Python runs no signal handler; SIGTERM still removes its folder and ends it at once, by
    SIGTERM (the thread woken through the signal wakeup fd). Then rank 1, sleeping."""
    directory = tmp_path / "offload"
    kids = [
        Child(tmp_path, directory, a, rank=r, world=2) for r, a in enumerate(["barrier", "wait"])
    ]
    roots = [kid.ready() for kid in kids]
    time.sleep(0.5)  # rank 0 is in the barrier by now
    assert kids[0].proc.poll() is None, kids[0].text
    kids[0].proc.send_signal(signal.SIGTERM)
    assert kids[0].end(END_S) == -signal.SIGTERM, kids[0].text  # within END_S, or it raises
    assert not roots[0].exists() and roots[1].is_dir()
    kids[1].proc.send_signal(signal.SIGTERM)
    assert kids[1].end(END_S) == -signal.SIGTERM, kids[1].text
    assert list(directory.iterdir()) == []


def test_a_killed_processs_folder_goes_at_the_next_start(tmp_path):
    """SIGKILL: nothing runs, the folder stays. The next engine over the same offload_dir
    removes it, saying so in one line that names the folder, the owner's pid and the bytes."""
    directory = tmp_path / "offload"
    killed = Child(tmp_path / "killed", directory, "wait")
    root = killed.ready()
    size = sum(f.stat().st_blocks * 512 for f in root.iterdir())
    started = json.loads((root / "owner.json").read_text())["started"]
    killed.proc.kill()
    assert killed.end() == -signal.SIGKILL
    assert root.is_dir()  # what no process can remove itself
    nxt = Child(tmp_path / "next", directory, "exit")
    assert nxt.end() == 0, nxt.text
    notes = [x for x in nxt.text.splitlines() if x.startswith("note: ")]
    assert notes == [
        f"note: offload_dir={str(directory)!r}: removed {root}, the state files of pid "
        f"{killed.proc.pid} (started {started}), which runs no more: {size:,} bytes freed"
    ], nxt.text
    assert list(directory.iterdir()) == []


def test_a_file_size_limit_is_one_line_and_leaves_no_folder(tmp_path):
    """RLIMIT_FSIZE: the free-space check passes, the allocation fails (EFBIG), as a quota or a
    disk filled meanwhile would. One line through the command line's refusal (exit status 2)
    naming offload_dir and the bytes needed, no traceback, and no folder."""
    directory = tmp_path / "offload"
    kid = Child(tmp_path, directory, "fsize")
    assert kid.end() == 2, kid.text
    errors = [x for x in kid.text.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and "Traceback" not in kid.text, kid.text
    assert errors[0].startswith(f"disk_child: error: offload_dir={str(directory)!r}: no room for ")
    assert "bytes in all; File too large allocating u0" in errors[0]
    assert list(directory.iterdir()) == []


def _one_fails(rank, n, directory):
    eng = engine(1, directory)
    train(eng, 1)
    KEEP.append(eng)  # referenced until the process ends
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    dist.barrier()  # rank 0 waits here until the launcher ends it


def _returns(rank, n, directory):
    eng = engine(1, directory)
    train(eng, 1)
    KEEP.append(eng)
    return str(eng.placement.offload.root)


def test_a_launchers_ranks_leave_no_folder(tmp_path):
    """zero.ranks.local.spawn: a rank that fails ends through multiprocessing's exit (no atexit
    there), and the launcher ends its peer, waiting in a collective, by SIGTERM; a rank that
    returns with its engine still referenced ends the same way. No folder is left."""
    failed = tmp_path / "failed"
    failed.mkdir()
    with pytest.raises(RankError, match="rank 1 fails"):
        spawn(_one_fails, 2, str(failed), timeout_s=120)
    assert list(failed.iterdir()) == []
    returned = tmp_path / "returned"
    returned.mkdir()
    (root,) = spawn(_returns, 1, str(returned), timeout_s=120)
    assert root.startswith(str(returned)) and list(returned.iterdir()) == []
