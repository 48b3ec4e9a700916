"""Checkpoints and runs that never lose work (zero/checkpoint/, zero/workloads/train.py): --resume
refuses instead of restarting, one run per output directory, a failed save cleans up after itself,
pruning touches only this run's checkpoints, a killed save or prune leaves nothing that outlives
the next start, temp files are made safely, only regular files inside the root are read (bounded
by the manifest), and an edited manifest is refused by field.

A full disk is simulated: zero/checkpoint/format.py's _write_all is replaced by one that writes half
a chunk and raises ENOSPC (a small real file system needs root to mount). Tests with a file that
could block a reader today (a FIFO) carry a short timeout, so that a regression fails instead of
hanging."""

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from verify.checkpoints.resume import (
    ResumeCase,
    build,
    compare_states,
    microbatches,
    run_rank,
    state_of,
)
from zero import checkpoint
from zero.checkpoint import CheckpointError, lock
from zero.checkpoint import format as fmt
from zero.loop import train_steps
from zero.ranks.launch import RankError
from zero.ranks.local import get_pool, spawn
from zero.workloads.train import RunFault, main
from zero.workloads.train_config import TrainConfig, claim

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
CASE = ResumeCase(n1=2, s1=2, n2=2, s2=2, precision="bf16", optimizer="adamw")
FAST = ["--model", "tiny", "--eval-every", "0", "--log-every", "100", "--eval-batches", "1"]


def tree(root: Path) -> dict:
    """Every path under root with its size and mtime: what 'nothing changed' compares."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(b"\n".join(p.read_bytes() for p in sorted((REPO / "zero").glob("*.py"))))
    return path


def train(out: Path, text: Path, *args: str) -> dict:
    return main([*FAST, "--data", str(text), "--nproc", "1", "--out", str(out), *args])


# -- --resume never restarts silently, never deletes ---------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text) -> Path:
    """A finished two-step run with a checkpoint after each step (OUT/ckpt: 2 step dirs)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(out, text, "--steps", "2", "--ckpt-every", "1")
    return out


@pytest.mark.dist
@pytest.mark.parametrize("damage", ["latest missing", "latest a directory", "latest outside"])
def test_resume_without_a_valid_checkpoint_refuses_and_removes_nothing(
    trained, text, tmp_path, damage
):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpt = out / "ckpt"
    (ckpt / "latest").unlink()
    if damage == "latest a directory":
        (ckpt / "latest").mkdir()
    elif damage == "latest outside":  # a complete checkpoint, but outside the root
        shutil.copytree(ckpt / "step-00000002", tmp_path / "elsewhere" / "step-00000002")
        (ckpt / "latest").write_text("../../elsewhere/step-00000002\n")
    before = tree(out)
    why = {
        "latest missing": r"no latest",
        "latest a directory": r"latest: a directory, not a regular file",
        "latest outside": r"latest names '\.\./\.\./elsewhere/step-00000002', which is not a step",
    }[damage]
    for flag in ("--resume", "--resume-if-present"):
        with pytest.raises(ValueError, match=rf"^resume\w*=True: no valid checkpoint .*{why}"):
            train(out, text, "--steps", "4", flag)
        assert tree(out) == before  # nothing trained, written or removed
    if damage == "latest a directory":  # a fresh run could never commit there: refused too
        with pytest.raises(ValueError, match=r"latest is not a regular file, so no checkpoint"):
            train(out, text, "--steps", "4")
        assert tree(out) == before
    if damage != "latest missing":
        return
    # the CLI: exit status 2, one line naming the directory
    done = subprocess.run(
        [sys.executable, "-m", "zero.workloads.train", *FAST, "--out", str(out), "--resume"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert str(ckpt) in done.stderr and tree(out) == before


@pytest.mark.dist
def test_resume_if_present_starts_afresh_only_on_an_empty_directory(tmp_path, text, capsys):
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    log = train(out, text, "--steps", "1", "--resume-if-present")
    assert [h["step"] for h in log["result"]["history"]["train"]] == [1]
    with pytest.raises(SystemExit) as exc:
        train(out, text, "--resume", "--resume-if-present")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "resume_if_present=True is not allowed" in err, err


# -- a fault is one line; a resume that changes the run is refused by name ------------------


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.dist
def test_a_diverged_run_is_one_line_and_leaves_nothing(tmp_path, text, capsys):
    """--lr 1e300: the loss diverges at step 2, before any checkpoint: exit 1, one line naming
    the step and the cause (the traceback with --debug), and no history claiming a run, no OUT."""
    from zero.common import cli
    from zero.workloads.train import cli_main

    out = tmp_path / "run"
    args = [*FAST, "--data", str(text), "--nproc", "1", "--out", str(out), "--steps", "3",
            "--lr", "1e300", "--ckpt-every", "0"]  # fmt: skip
    for debug in (False, True):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            cli.run(cli_main, "python -m zero.workloads.train", args + ["--debug"] * debug)
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert exc.value.code == 1 and last.startswith("python -m zero.workloads.train: error: ")
        assert "step 2 of 3: non-finite gradient" in last and "no checkpoint was made" in last
        assert ("Traceback" in err) == debug, err
        assert not out.exists()


@pytest.mark.dist
def test_a_resume_that_changes_the_run_is_refused_by_name_unless_allowed(trained, text, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    before = tree(out)
    with pytest.raises(ValueError, match=r"^resume=True: .*: --seed: saved 0, now 1; --lr: saved "
                       r"0.002, now 0.001; .*--allow-changed-run"):  # fmt: skip
        train(out, text, "--steps", "3", "--resume", "--seed", "1", "--lr", "1e-3")
    assert tree(out) == before  # refused before any work
    log = train(out, text, "--steps", "3", "--resume", "--seed", "1", "--allow-changed-run")
    want = [{"step": 2, "field": "seed", "saved": 0, "now": 1}]
    assert log["config"]["run_changes"] == want
    assert (
        checkpoint.read_manifest(checkpoint.resolve(out / "ckpt"))["extra"]["run_changes"] == want
    )
    log = train(out, text, "--steps", "4", "--resume", "--seed", "1")  # the run is seed 1 now
    assert log["config"]["run_changes"] == want and log["result"]["data_step"] == 4


@pytest.mark.dist
def test_a_resume_on_renamed_or_edited_data_names_the_cause(trained, text, tmp_path):
    """The same text under another name is other data (the split is by name), refused naming
    the names; the same name with another text, naming the content."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    before = tree(out)
    renamed = tmp_path / "renamed.txt"
    shutil.copy(text, renamed)
    (tmp_path / "edited").mkdir()
    edited = tmp_path / "edited" / text.name
    edited.write_bytes(text.read_bytes() + b"# one more line\n")
    names = (
        r": --data: the file names differ: saved \['corpus\.txt'\], now \['renamed\.txt'\], "
        r"and the content is the same \(the validation split is drawn by name\); "
    )
    content = (r": --data: the content differs: saved \d+ bytes, sha256 \w{16}, now \d+ bytes, "
               r"sha256 \w{16}, and the file names are the same; ")  # fmt: skip
    with pytest.raises(ValueError, match=names):
        train(out, text, "--steps", "3", "--resume", "--data", str(renamed))
    with pytest.raises(ValueError, match=content):
        train(out, text, "--steps", "3", "--resume", "--data", str(edited))
    assert tree(out) == before  # refused before any work


@pytest.mark.dist
def test_a_damaged_rng_file_is_named_by_resume_verify_and_consolidate(trained, text, tmp_path):
    """r0000.bin (rank 0's RNG state and the buffers) was never read by consolidate: now every
    reader checks every file; --resume refuses in one line (exit 2), nothing run or removed."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    root = out / "ckpt"
    flip(checkpoint.resolve(root) / "r0000.bin")
    before = tree(out)
    pattern = r"checksum mismatch in .*step-00000002/r0000\.bin"
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.verify(root)
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.consolidate(root)
    assert checkpoint.main(["consolidate", str(root), str(tmp_path / "m.pt")]) == 1
    with pytest.raises(ValueError, match=rf"^resume from .*: .*{pattern}.*nothing was run"):
        train(out, text, "--steps", "3", "--resume")
    assert tree(out) == before and not (tmp_path / "m.pt").exists()


@pytest.mark.dist
def test_consolidate_refuses_a_bad_out_before_the_work(trained, tmp_path, capsys):
    """OUT a directory, in a missing folder: exit 2, one line naming OUT, found before reading
    the checkpoint (whose shard is damaged here: reading it would be exit 1), and no temp file
    in OUT's parent or anywhere."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    root = out / "ckpt"
    flip(sorted(checkpoint.resolve(root).glob("u*-r*.bin"))[0])
    target = tmp_path / "target"
    target.mkdir()
    for bad in (target, tmp_path / "nope" / "m.pt"):
        capsys.readouterr()
        assert checkpoint.main(["consolidate", str(root), str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"error: out={str(bad)!r}" in err, err
    assert list(target.iterdir()) == [] and not list(tmp_path.glob(".*"))
    assert checkpoint.main(["consolidate", str(root), str(tmp_path / "m.pt")]) == 1  # the shard


# -- one run per output directory ----------------------------------------------------------------


@pytest.mark.dist
def test_a_second_run_on_the_same_out_is_refused_before_any_work(tmp_path, text):
    """A run holds OUT/run.lock while it runs: a second job on the same OUT exits 2 at once,
    naming the holder; the first, interrupted later (Ctrl-C), releases the lock and leaves a
    checkpoint that verifies."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [sys.executable, "-m", "zero.workloads.train", *FAST, "--data", str(text), "--nproc", "1",
         "--steps", "100000", "--ckpt-every", "1", "--out", str(out)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "ckpt" / "latest").exists():  # running, and checkpointing
            assert first.poll() is None, "the first run ended early"
            assert time.monotonic() < deadline, "the first run did not start checkpointing"
            time.sleep(0.2)
        holder = json.loads((out / "run.lock").read_text())
        assert holder["pid"] == first.pid
        second = subprocess.run(
            [sys.executable, "-m", "zero.workloads.train", *FAST, "--data", str(text), "--nproc",
            "1",
             "--steps", "30", "--ckpt-every", "1", "--out", str(out)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"out={str(out)!r} is in use: another run holds {out / 'run.lock'}" in second.stderr
        assert f"pid {first.pid}" in second.stderr and len(second.stderr.splitlines()) == 1
        assert first.poll() is None  # still training, untouched by the second job
        first.send_signal(signal.SIGINT)
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not (out / "run.lock").exists()  # released at exit
    checkpoint.verify(out / "ckpt")


@pytest.mark.dist
def test_a_held_lock_refuses_a_stale_one_is_cleared_and_a_finished_run_releases_it(
    tmp_path, text, capsys
):
    """A live holder refuses, naming its pid; the lock of a holder killed without its cleanup
    (a pid that runs no more on this host) is reported in one line, cleared, and the run goes
    on; the run releases its own lock at exit."""
    out = tmp_path / "run"
    held = lock.acquire(out)  # this process: alive
    record = json.loads(held.read_text())
    assert {"pid", "host", "started", "proc_start", "boot_id"} <= set(record), record
    with pytest.raises(ValueError, match=rf"pid {os.getpid()} on .*; wait for it to end"):
        train(out, text, "--steps", "1")
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # no work was done
    lock.release(held)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    capsys.readouterr()
    train(out, text, "--steps", "1")
    err = [x for x in capsys.readouterr().err.splitlines() if "stale lock" in x]
    assert len(err) == 1 and f"pid {dead.pid} on {socket.gethostname()}" in err[0], err
    assert not (out / "run.lock").exists()
    (tmp_path / "a-file").write_text("x")
    # refused before any work, naming the field (zero.common.cli's writability check runs first)
    with pytest.raises(ValueError, match=r"^out='.*' is not a folder; allowed is a writable"):
        train(tmp_path / "a-file" / "run", text)


# -- a failed save removes its own partial files ----------------------------------------------


def full_disk(rank_to_fail, when):
    """A _write_all that, on rank `rank_to_fail` once when() is true, writes half a chunk and
    then raises ENOSPC, as a full disk does."""

    def write(f, chunk):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == rank_to_fail and when(chunk):
            f.write(memoryview(chunk)[: len(memoryview(chunk)) // 2])
            f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(chunk)

    return write


def is_manifest(chunk) -> bool:
    return isinstance(chunk, bytes) and chunk.startswith(b'{\n "format"')


def save_on_a_full_disk(rank, n, root, victim, what):
    """A good checkpoint after step 1; the save after step 2 meets a full disk on `victim`
    (at its shard files, or at the manifest); the error every rank raised is returned."""
    torch.set_num_threads(1)
    model, eng = build(CASE, CASE.s1)
    data = microbatches(CASE, model)
    train_steps(eng, data, 1)
    eng.save(root, keep_last=2)
    train_steps(eng, data, 1, start_step=1)
    when = is_manifest if what == "manifest" else (lambda chunk: not isinstance(chunk, bytes))
    original = fmt._write_all
    fmt._write_all = full_disk(victim, when)
    try:
        eng.save(root, keep_last=2)
    except Exception as exc:  # every rank must raise
        return f"{type(exc).__name__}: {exc}"
    finally:
        fmt._write_all = original
    return None


def load_and_save(rank, n, root):
    torch.set_num_threads(1)
    _, eng = build(CASE, CASE.s2, seed=1)
    eng.load(root)
    state = state_of(eng)
    eng.save(root, keep_last=2)
    return state


@pytest.mark.dist
@pytest.mark.parametrize("victim, what", [(1, "shards"), (0, "shards"), (0, "manifest")])
def test_a_save_on_a_full_disk_removes_its_partial_files(tmp_path, victim, what):
    """Every rank raises, naming the full disk; the failed save's directory and temp files are
    gone on every rank; `latest` names the previous checkpoint, which verifies and loads
    bitwise, and the next save in place succeeds."""
    root = tmp_path / "ck"
    errors = get_pool(2).run(save_on_a_full_disk, str(root), victim, what)
    assert all(e is not None and "No space left on device" in e for e in errors), errors
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]
    assert not [p for p in root.rglob(".*")], "temp files left behind"
    checkpoint.verify(root)
    want = get_pool(2).run(run_rank, CASE, CASE.s1, 1)[0]["state"]
    got = get_pool(2).run(load_and_save, str(root))[0]
    assert compare_states(want, got) == ""
    assert checkpoint.resolve(root).name == "step-00000001-1"


@pytest.mark.dist
def test_zero_train_on_a_full_disk_then_resume_in_place(tmp_path, text, monkeypatch):
    """zero.workloads.train meets a full disk at its second checkpoint: the run fails naming it,
    only the first checkpoint is left, and `--resume` in the same OUT finishes the run with the bits
    of an uninterrupted one."""
    out = tmp_path / "run"
    first_done = out / "ckpt" / "step-00000001" / "manifest.json"
    monkeypatch.setattr(
        fmt, "_write_all", full_disk(1, lambda c: first_done.exists() and not is_manifest(c))
    )
    args = ["--nproc", "2", "--steps", "3", "--ckpt-every", "1"]
    with pytest.raises(RunFault, match=r"^step 2 of 3: .*No space left on device: '.*step-0+2"):
        main([*FAST, "--data", str(text), "--out", str(out), *args])
    monkeypatch.undo()
    left = sorted(p.name for p in (out / "ckpt").iterdir())  # history: zero/workloads/history.py
    assert left == ["history.jsonl", "latest", "step-00000001"]
    # the history is cut back to what the checkpoint left records: its mark
    mark = checkpoint.read_manifest(out / "ckpt" / "step-00000001")["extra"]["history_log"]
    assert (out / "ckpt" / "history.jsonl").stat().st_size == mark["bytes"]
    assert not (out / "run.lock").exists()
    resumed = main([*FAST, "--data", str(text), "--out", str(out), *args, "--resume"])
    whole = main([*FAST, "--data", str(text), "--out", str(tmp_path / "whole"), *args])
    assert resumed["result"]["final_master_sha256"] == whole["result"]["final_master_sha256"]


# -- pruning touches only this run's complete checkpoints --------------------------------------


def two_runs(rank, n, root):
    """Run A saves twice; run B (a fresh engine: another run) saves three times, keep_last=2;
    then run C resumes A's latest and saves with keep_last=1. Returns the names after each."""
    torch.set_num_threads(1)
    seen = []
    for label, saves, keep in (("A", 2, None), ("B", 3, 2)):
        model, eng = build(CASE, 1)
        data = microbatches(CASE, model)
        for step in range(saves):
            train_steps(eng, data, 1, start_step=step)
            eng.save(root, keep_last=keep)
        seen.append(sorted(p.name for p in Path(root).iterdir()))
        if label == "A":
            a_latest = checkpoint.resolve(root)
    _, eng = build(CASE, 1)
    eng.load(a_latest)  # continues run A
    eng.save(root, keep_last=1)
    seen.append(sorted(p.name for p in Path(root).iterdir()))
    return seen


@pytest.mark.dist
def test_pruning_removes_only_this_runs_checkpoints(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    other = root / "step-00000099"  # another job's save in progress: no manifest yet
    other.mkdir()
    (other / "owner.json").write_text(json.dumps({"run_id": "another"}))
    (other / "u0000-r0000.bin").write_bytes(b"partial")
    (root / "notes.txt").write_text("mine")
    after_a, after_b, after_c = get_pool(2).run(two_runs, str(root))[0]
    foreign = ["notes.txt", "step-00000099"]
    assert after_a == ["latest", *foreign[:1], "step-00000001", "step-00000002", foreign[1]]
    # B kept its own last two and left A's two, the other job's save and the note alone
    assert after_b == [
        "latest", "notes.txt", "step-00000001", "step-00000002", "step-00000002-1",
        "step-00000003", "step-00000099",
    ]  # fmt: skip
    # C (run A resumed) keeps its new one only, of run A's; B's two remain
    assert after_c == [
        "latest", "notes.txt", "step-00000002-1", "step-00000002-2", "step-00000003",
        "step-00000099",
    ]  # fmt: skip
    assert (other / "u0000-r0000.bin").read_bytes() == b"partial"


# -- what a killed save or prune leaves: gone at the next start, never read -------------------


def digests(root: Path) -> dict:
    """sha256 of every file under root, by relative path: what 'untouched bitwise' compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.dist
@pytest.mark.parametrize("start", ["--resume", "afresh"])
def test_what_a_killed_save_or_prune_left_goes_at_the_next_start(
    trained, text, tmp_path, capsys, start
):
    """[Note: crash leftovers]: an empty step directory newer than `latest` (a save killed at
    its first file), one with shard files and no manifest (a prune killed midway) and a trash
    folder are never read, and go when the next run starts (a resume or a fresh run), each
    named in a note; the complete checkpoints stay, bitwise."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpt = out / "ckpt"
    complete = {d.name: digests(d) for d in ckpt.glob("step-*")}
    latest = (ckpt / "latest").read_bytes()
    empty, half = ckpt / "step-00000007", ckpt / "step-00000003"
    trash = ckpt / ".trash-step-00000001.0123456789ab.89abcdef"
    for d in (empty, half, trash):
        d.mkdir()
    for f in sorted((ckpt / "step-00000002").glob("*.bin"))[:3]:
        shutil.copy(f, half / f.name)
        shutil.copy(f, trash / f.name)
    assert checkpoint.resolve(ckpt) == ckpt / "step-00000002"
    capsys.readouterr()
    if start == "--resume":  # at its last step already: loads, trains and saves nothing
        log = train(out, text, "--steps", "2", "--resume")
        assert log["result"]["data_step"] == 2 and (ckpt / "latest").read_bytes() == latest
    else:
        train(out, text, "--steps", "1")
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note: removed")]
    assert len(notes) == 1, notes
    for d in (empty, half, trash):
        assert not os.path.lexists(d) and f"ckpt/{d.name} (" in notes[0], (d, notes)
    for name, files in complete.items():
        assert digests(ckpt / name) == files, name
    checkpoint.verify(ckpt)


class Stopped(BaseException):
    """A signal's exception in the middle of a removal (as a SIGTERM handler raises)."""


def prune_stopped_midway(rank, n, root):
    """Two saves with keep_last=1; the second one's prune is stopped in shutil.rmtree after one
    file of the old checkpoint went. Returns the names in root after."""
    torch.set_num_threads(1)
    model, eng = build(CASE, 1)
    data = microbatches(CASE, model)
    train_steps(eng, data, 1)
    eng.save(root, keep_last=1)
    train_steps(eng, data, 1, start_step=1)
    real = shutil.rmtree

    def stopped(path, *args, **kwargs):
        min(Path(path).glob("*.bin")).unlink()
        raise Stopped

    shutil.rmtree = stopped
    try:
        eng.save(root, keep_last=1)
    except Stopped:
        pass
    finally:
        shutil.rmtree = real
    return sorted(p.name for p in Path(root).iterdir())


@pytest.mark.dist
def test_an_interrupted_prune_leaves_trash_that_the_next_start_removes(tmp_path, capsys):
    """A prune stopped midway leaves a trash folder, never a step directory with a part of its
    files; `latest` names the new checkpoint, which verifies. The next start (holding run.lock)
    removes the trash, naming it; so does this run's next save, which may not remove others'."""
    out = tmp_path / "run"
    root = out / "ckpt"
    names = get_pool(1).run(prune_stopped_midway, str(root))[0]
    [trash] = [n for n in names if n.startswith(".trash-")]
    assert names == [trash, "latest", "step-00000002"], names
    assert trash.startswith(".trash-step-00000001.") and not fmt.STEP_DIR.fullmatch(trash)
    assert checkpoint.resolve(root).name == "step-00000002"
    checkpoint.verify(root)
    again = tmp_path / "again"
    shutil.copytree(root, again)
    kept = digests(root / "step-00000002")
    capsys.readouterr()
    lock.release(claim(TrainConfig(out=str(out), resume=True))[0])
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note: removed")]
    assert len(notes) == 1 and f"ckpt/{trash} (a removal cut short)" in notes[0], notes
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]
    assert digests(root / "step-00000002") == kept
    get_pool(2).run(load_and_save, str(again))  # the run resumed (keep_last=2): no trash left
    assert sorted(p.name for p in again.iterdir()) == ["latest", "step-00000002", "step-00000002-1"]


# -- temp files and the pointer ------------------------------------------------------------------


def save_past_planted_links(rank, n, root, victim):
    """A link planted at the name the old writer used for the pointer's temp file
    (.latest.tmp-PID), and `latest` itself a link: a save must write through neither."""
    torch.set_num_threads(1)
    _, eng = build(CASE, 1)
    eng.save(root)
    (Path(root) / f".latest.tmp-{os.getpid()}").symlink_to(victim)
    os.unlink(Path(root) / "latest")
    (Path(root) / "latest").symlink_to(victim)
    eng.save(root)
    return checkpoint.resolve(root).name


@pytest.mark.dist
def test_temp_files_are_made_safely_and_links_are_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    root = tmp_path / "ck"
    name = get_pool(1).run(save_past_planted_links, str(root), str(victim))[0]
    assert victim.read_text() == "precious"
    assert name == "step-00000000-1" and not (root / "latest").is_symlink()
    checkpoint.verify(root)


# -- only regular files inside the root, bounded by the manifest ---------------------------------


def small_save(rank, n, root):
    torch.set_num_threads(1)
    model, eng = build(CASE, 1)
    train_steps(eng, microbatches(CASE, model), 1)
    eng.save(root)


def load_into(rank, n, root, stage=1):
    torch.set_num_threads(1)
    _, eng = build(CASE, stage, seed=1)
    return eng.load(root).data_step


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved") / "ck"
    get_pool(2).run(small_save, str(root))
    return root


def copy_of(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ck"
    shutil.copytree(saved, root, symlinks=True)
    return root, checkpoint.resolve(root)


def assert_refused_everywhere(root: Path, pattern: str) -> None:
    """verify, consolidate, the CLI and a load at N = 2 all refuse, matching `pattern`."""
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.verify(root)
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.consolidate(root)
    assert checkpoint.main(["verify", str(root)]) == 1
    with pytest.raises(RankError, match=pattern):
        spawn(load_into, 2, str(root), timeout_s=60)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_fifo_shard_is_refused_without_blocking(saved, tmp_path):
    root, step_dir = copy_of(saved, tmp_path)
    (step_dir / "u0001-r0001.bin").unlink()
    os.mkfifo(step_dir / "u0001-r0001.bin")
    assert_refused_everywhere(root, r"u0001-r0001\.bin: a FIFO, not a regular file")


@pytest.mark.dist
def test_links_and_wrong_sizes_are_refused_before_reading(saved, tmp_path):
    root, step_dir = copy_of(saved, tmp_path)
    shard = step_dir / "u0001-r0001.bin"
    outside = tmp_path / "copy.bin"
    shutil.copy(shard, outside)  # the very same bytes, but outside the checkpoint
    shard.unlink()
    shard.symlink_to(outside)
    assert_refused_everywhere(root, r"u0001-r0001\.bin: a symbolic link; only regular files")
    shard.unlink()
    shard.symlink_to("/dev/zero")  # read until memory ran out, before
    with pytest.raises(CheckpointError, match=r"u0001-r0001\.bin: a symbolic link"):
        checkpoint.verify(root)
    shard.unlink()
    data = outside.read_bytes()
    shard.write_bytes(data + b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"{len(data) + 8} bytes on disk, the manifest "):
        checkpoint.verify(root)
    shard.write_bytes(data)
    checkpoint.verify(root)  # the files themselves were fine
    latest = root / "latest"
    latest.unlink()
    latest.symlink_to(root / "latest-target")
    (root / "latest-target").write_text(f"{step_dir.name}\n")
    with pytest.raises(CheckpointError, match=r"latest: a symbolic link"):
        checkpoint.resolve(root)


@pytest.mark.dist
def test_an_incomplete_step_directory_is_ignored_by_resume(saved, tmp_path):
    """A newer step directory without a manifest (a save that never finished) is not read:
    `latest` is, and the next save of another run leaves that directory alone."""
    root, step_dir = copy_of(saved, tmp_path)
    partial = root / "step-00000005"
    partial.mkdir()
    (partial / "u0000-r0000.bin").write_bytes(b"\0" * 16)
    assert checkpoint.resolve(root) == step_dir
    assert get_pool(2).run(load_into, str(root)) == [1, 1]
    assert (partial / "u0000-r0000.bin").exists()


# -- edited manifests: validated against themselves and against the model --------------------


def edit(step_dir: Path, change) -> None:
    """Edit the manifest and re-checksum it, as a hostile or careless hand would."""
    path = step_dir / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    body = {k: v for k, v in m.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    m["checksum"] = hashlib.sha256(canonical).hexdigest()
    path.write_text(json.dumps(m, indent=1))


def set_in(keys, value):
    def change(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return change


def entry(m, name, key):
    return m["files"][name]["entries"][key]


EDITS = {
    "shape (1, 1)": (
        lambda m: m["params"][0].update(shape=[1, 1]),
        r"params\[1\] \('layers\.0\.bias'\): offset 768, but the unit's parameters' shapes lay",
    ),
    "sgd for adamw": (
        set_in(["config", "optimizer"], "sgd"),
        r"units\[0\]\.states: \['master', 'exp_avg', 'exp_avg_sq'\], but optimizer 'sgd' keeps",
    ),
    "adam moments dropped": (
        lambda m: m["units"][1].update(states=["master"]),
        r"units\[1\]\.states: \['master'\], but optimizer 'adamw' keeps",
    ),
    "offset out of range": (
        lambda m: entry(m, "u0001-r0001.bin", "exp_avg").__setitem__(0, 10**9),
        r"files\['u0001-r0001\.bin'\]\.entries\['exp_avg'\]: bytes \[1000000000, ",
    ),
    "unknown dtype": (
        lambda m: entry(m, "r0000.bin", "rng:torch_cpu").__setitem__(2, "float128"),
        r"files\['r0000\.bin'\]\.entries\['rng:torch_cpu'\]: unknown dtype 'float128'",
    ),
    "shape against numel": (
        lambda m: entry(m, "r0001.bin", "rng:torch_cpu").__setitem__(3, [7]),
        r"files\['r0001\.bin'\]\.entries\['rng:torch_cpu'\]: shape \[7\] has 7 elements",
    ),
    "a path for a file name": (
        lambda m: m["files"].__setitem__("../../victim.bin", m["files"]["r0001.bin"]),
        r"files\['\.\./\.\./victim\.bin'\]: not a plain file name",
    ),
    "unit files": (
        lambda m: m["units"][0]["files"].__setitem__(1, "r0001.bin"),
        r"files\['r0001\.bin'\]\.entries\['master'\]: None, expected \d+ float32 elements",
    ),
    "world size": (
        set_in(["world_size"], 3),
        r"units\[0\]\.shard_numel: 256, but its parameters' layout at N = 3 gives 128",
    ),
    "group": (
        lambda m: m["params"][0].update(group=5),
        r"params\[0\]\.group: 5, expected 0\.\.1",
    ),
    "overlapping entries": (
        lambda m: entry(m, "u0001-r0001.bin", "exp_avg").__setitem__(0, 0),
        r"files\['u0001-r0001\.bin'\]\.entries\['master'\]: starts at byte 0, expected \d+",
    ),
    "state_dict key": (
        lambda m: m["state_dict_keys"][0].__setitem__(0, "renamed"),
        r"state_dict_keys\[0\]: key 'renamed' is not a name of",
    ),
    "state_dict source": (
        lambda m: m["state_dict_keys"][0].__setitem__(1, "nothing"),
        r"state_dict_keys\[0\]: source 'nothing' is neither a parameter",
    ),
}


@pytest.mark.dist
@pytest.mark.parametrize("what", list(EDITS))
def test_an_edited_manifest_is_refused_naming_the_file_and_the_field(saved, tmp_path, what):
    """Each edit, re-checksummed, is refused by verify, consolidate, the CLI and load, with
    the manifest's path and the field in the message."""
    root, step_dir = copy_of(saved, tmp_path)
    change, field = EDITS[what]
    edit(step_dir, change)
    assert_refused_everywhere(root, rf"{step_dir / 'manifest.json'}: {field}")


@pytest.mark.dist
def test_a_shape_edited_within_its_alignment_is_refused(saved, tmp_path):
    """A 48-element bias recorded as 1 element still fills its 128-element aligned slot, so
    the layout holds; the saved values outside the recorded parameter are not zero (as the
    optimizers keep every gap), which verify and consolidate check; load names the parameter."""
    root, step_dir = copy_of(saved, tmp_path)
    p = json.loads((step_dir / "manifest.json").read_text())["params"][1]
    name, start = p["name"], p["offset"] + 1  # just after the one element now recorded
    assert p["shape"] == [48]
    edit(step_dir, lambda m: m["params"][1].update(shape=[1]))
    pattern = rf"manifest\.json: units\[{p['unit']}\]: state 'master' is not zero in \[{start}, "
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.verify(root)
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.consolidate(root)
    with pytest.raises(RankError, match=rf"parameter '{name}': checkpoint shape \(1,\), model"):
        spawn(load_into, 2, str(root), timeout_s=60)


def test_no_edit_of_a_manifest_escapes_as_another_error(saved, tmp_path):
    """Any one field of the manifest set to any of a few hostile values (re-checksummed):
    consolidate either refuses with a CheckpointError or succeeds; no other exception."""
    root, step_dir = copy_of(saved, tmp_path)
    orig = json.loads((step_dir / "manifest.json").read_text())

    def paths(o, pre=()):
        if pre and pre[0] not in ("checksum", "format", "format_version", "byteorder"):
            yield pre
        items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
        for k, v in items:
            yield from paths(v, (*pre, k))

    every = list(paths(orig))
    values = [None, -1, 1, 10**12, 2.5, "x", "../x", [], {}, [0, 1, "float32", [1]], True]
    rng = random.Random(0)
    refused = 0
    for _ in range(300):
        where, value = rng.choice(every), rng.choice(values)

        def change(m, where=where, value=value):
            d = m
            for k in where[:-1]:
                d = d[k]
            d[where[-1]] = value

        shutil.copy(saved / step_dir.name / "manifest.json", step_dir / "manifest.json")
        edit(step_dir, change)
        try:
            checkpoint.consolidate(root)
        except CheckpointError:
            refused += 1
    assert refused > 200, refused  # most such edits break something the checks see


@pytest.mark.dist
def test_a_self_consistent_edit_is_refused_against_the_model(saved, tmp_path):
    """Swapping a weight's shape (same numel, so the layout still holds) passes the manifest's
    own checks; loading it into the model is refused, naming the parameter and both shapes."""
    root, step_dir = copy_of(saved, tmp_path)
    edit(step_dir, lambda m: m["params"][0].update(shape=m["params"][0]["shape"][::-1]))
    checkpoint.verify(root)
    with pytest.raises(RankError, match=r"'layers\.0\.weight': checkpoint shape \(16, 48\), mod"):
        spawn(load_into, 2, str(root), timeout_s=60)


# -- format compatibility ------------------------------------------------------------------------


@pytest.mark.dist
def test_a_version_1_checkpoint_loads_and_is_never_pruned(saved, tmp_path):
    """Format 1 (no run_id, no owner.json) verifies, consolidates and loads as before; a run
    that resumes from it keeps it when pruning (it cannot be proved to be this run's)."""
    root, step_dir = copy_of(saved, tmp_path)
    (step_dir / "owner.json").unlink()

    def to_v1(m):
        del m["run_id"]
        m["format_version"] = 1

    edit(step_dir, to_v1)
    checkpoint.verify(root)
    assert checkpoint.consolidate(root)["meta"]["format_version"] == 1
    assert get_pool(2).run(load_and_save, str(root))[0]["data_step"] == 1
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000001-1"]
