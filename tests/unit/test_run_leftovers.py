"""What a killed or failed run leaves, and what the next one does with it: a stale
run.lock is cleared and a live or foreign one refuses (zero/checkpoint/lock.py, [Note: stale
locks]); dead writers' temp files go, nobody else's ([Note: leftover temp files] in
zero/checkpoint/commit.py), and so do trash folders and uncommitted step directories, never a
checkpoint ([Note: crash leftovers]); the loss history agrees with the checkpoint left
(zero/workloads/history.py after_failure); the run's identity is compared by field, the data's
naming whether its file names or its content differ (zero/workloads/train_config.py);
consolidate's OUT is checked before the work; a dropped loss curve is freed at once ([Note:
memory of a plot]). No process group, no training: seconds."""

import gc
import hashlib
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from zero import checkpoint
from zero.checkpoint import lock
from zero.checkpoint.commit import remove_temps
from zero.checkpoint.consolidate import check_out
from zero.checkpoint.leftovers import remove_leftovers
from zero.workloads.data import load_corpus
from zero.workloads.history import after_failure, plot_losses
from zero.workloads.train_config import RUN_IDENTITY, TrainConfig, claim, describe, run_changes
from zero.workloads.train_config import run_identity as identity_of

HOST = socket.gethostname()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def plant(out: Path, **record) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / lock.LOCK).write_text(json.dumps(record))


# -- run.lock ------------------------------------------------------------------------------------


def test_the_lock_records_its_holder_and_a_live_one_refuses(tmp_path):
    path = lock.acquire(tmp_path / "out")
    h = json.loads(path.read_text())
    assert (h["pid"], h["host"]) == (os.getpid(), HOST)
    assert h["proc_start"] == lock._proc_start(os.getpid()) and h["started"] and h["boot_id"]
    with pytest.raises(ValueError, match=rf"another run holds .*pid {os.getpid()} on {HOST}"):
        lock.acquire(tmp_path / "out")
    lock.release(path)
    assert not path.exists()


def test_a_stale_lock_is_reported_in_one_line_and_cleared(tmp_path):
    out, said = tmp_path / "out", []
    pid = dead_pid()
    plant(out, pid=pid, host=HOST, started="then")
    path = lock.acquire(out, say=said.append)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert len(said) == 1 and "\n" not in said[0], said
    assert (
        f"cleared the stale lock {out / 'run.lock'} (pid {pid} on {HOST}, started then" in said[0]
    )


def test_a_reused_pid_or_a_reboot_makes_a_lock_stale(tmp_path):
    """The pid runs, but another process (another start time) or since another boot."""
    for fields in ({"proc_start": lock._proc_start(os.getpid()) + 1}, {"boot_id": "x"}):
        out, said = tmp_path / str(len(fields) + len(str(fields))), []
        plant(out, pid=os.getpid(), host=HOST, started="then", **fields)
        lock.release(lock.acquire(out, say=said.append))
        assert len(said) == 1, fields


def test_a_lock_of_another_host_or_without_a_record_still_refuses(tmp_path):
    plant(tmp_path / "a", pid=dead_pid(), host="elsewhere.invalid", started="then")
    with pytest.raises(ValueError, match=r"a run on another host holds .*elsewhere\.invalid"):
        lock.acquire(tmp_path / "a", say=pytest.fail)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / lock.LOCK).write_text("")  # a holder killed between create and write
    with pytest.raises(ValueError, match=r"does not name its holder"):
        lock.acquire(tmp_path / "b", say=pytest.fail)


def _race(out: str, go, done, q) -> None:
    go.wait()
    try:
        lock.acquire(out, say=lambda line: None)
        q.put("held")
        done.wait(60)  # alive until every other has tried; then gone without release
    except ValueError as exc:
        q.put(str(exc))


def test_runs_clearing_one_stale_lock_at_once_leave_one_holder(tmp_path):
    """Four processes find one stale lock at once: exactly one holds the lock after, the others
    are refused naming it; none removed a lock another had just made ([Note: stale locks])."""
    out = tmp_path / "out"
    plant(out, pid=dead_pid(), host=HOST, started="then")
    ctx = mp.get_context("fork")
    go, done, q = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(out), go, done, q)) for _ in range(4)]
    for p in procs:
        p.start()
    go.set()
    try:
        got = [q.get(timeout=60) for _ in procs]
        holder = json.loads((out / lock.LOCK).read_text())
    finally:
        done.set()
        for p in procs:
            p.join(60)
    assert got.count("held") == 1, got
    assert holder["pid"] in [p.pid for p in procs]
    assert all(f"pid {holder['pid']} on {HOST}" in g for g in got if g != "held"), got


# -- temp files ----------------------------------------------------------------------------------


def test_dead_writers_temp_files_go_and_nothing_else(tmp_path):
    root = tmp_path / "ckpt"
    step = root / "step-00000003"
    step.mkdir(parents=True)
    ours = [root / ".latest.a1b2c3d4.tmp", step / ".manifest.json.zz_9yy8x.tmp",
            step / ".u0001-r0000.bin.abcdefgh.tmp", step / ".owner.json.12345678.tmp"]  # fmt: skip
    others = [root / ".notes.tmp", root / ".latest.tmp", step / ".latest.a1b2c3d4.tmp",
              root / ".manifest.json.a1b2c3d4.tmp", step / "manifest.json", root / "latest",
              tmp_path / ".latest.a1b2c3d4.tmp"]  # fmt: skip
    for f in ours + others:
        f.write_bytes(b"")
    (root / ".latest.q1w2e3r4.tmp").mkdir()  # not a file: left alone
    assert sorted(remove_temps(root)) == sorted(ours)
    assert [f for f in ours if f.exists()] == [] and all(f.exists() for f in others)
    assert remove_temps(tmp_path / "absent") == []


def digests(root: Path) -> dict:
    """sha256 of every file under root, by relative path: what 'untouched bitwise' compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def step(root: Path, name: str, *files: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(f"{name}/{f}".encode())
    return d


def test_trash_and_uncommitted_step_directories_go_and_no_checkpoint(tmp_path, capsys):
    """[Note: crash leftovers]: a trash folder, an empty step directory (a save killed at its
    first file) and one with shard files but no manifest (a prune killed midway) go at the next
    start, each named in one note line; committed ones (a manifest, even one that does not
    validate), the one `latest` names, links and other files are kept, bitwise."""
    out = tmp_path / "out"
    root = out / "ckpt"
    kept = [step(root, "step-00000001", "manifest.json", "u0000-r0000.bin"),
            step(root, "step-00000002", "manifest.json", "owner.json", "u0000-r0000.bin"),
            step(root, "step-00000004", "manifest.json"),  # committed, damaged: resume names it
            step(root, "step-x", "u0000-r0000.bin"),  # not a step directory's name
            step(root, ".trash-step-00000001", "u0000-r0000.bin")]  # not a trash name  # fmt: skip
    (root / "latest").write_text("step-00000002\n")
    (root / "history.jsonl").write_text("{}\n")
    (tmp_path / "elsewhere").mkdir()
    (root / "step-00000006").symlink_to(tmp_path / "elsewhere")  # never followed
    trash = ".trash-step-00000001.0123456789ab.89abcdef"  # a prune's: name, run tag, random
    gone = [step(root, "step-00000009"),  # newer than latest, empty
            step(root, "step-00000003", "u0000-r0000.bin", "u0001-r0000.bin", "r0000.bin"),
            step(root, "step-00000005", ".manifest.json.k9x8w7v6.tmp", "owner.json"),
            step(root, trash, "u0001-r0000.bin")]  # fmt: skip
    temp = root / ".latest.a1b2c3d4.tmp"
    temp.write_bytes(b"")
    before = digests(root)
    assert checkpoint.resolve(root).name == "step-00000002"  # no leftover is ever read
    lock.release(claim(TrainConfig(out=str(out)))[0])
    notes = [line for line in capsys.readouterr().err.splitlines() if "stopped run" in line]
    assert len(notes) == 1 and notes[0].startswith(
        f"note: removed what a stopped run left in {out}"
    )
    for d in [*gone, temp]:
        assert not os.path.lexists(d) and f"ckpt/{d.name} (" in notes[0], d
    for d in kept:
        assert d.is_dir() and f"/{d.name} (" not in notes[0], d
    assert "ckpt/step-00000003 (a save that never committed: no manifest.json)" in notes[0]
    assert ".89abcdef (a removal cut short)" in notes[0]
    names = {d.name for d in [*gone, temp]}
    assert digests(root) == {k: v for k, v in before.items() if k.split("/")[0] not in names}
    assert (root / "step-00000006").is_symlink() and (root / "latest").read_text() == (
        "step-00000002\n"
    )
    assert remove_leftovers(root) == []  # nothing left to remove
    (root / "latest").write_text("step-00000007\n")  # `latest` names an uncommitted one
    step(root, "step-00000007", "u0000-r0000.bin")
    assert remove_leftovers(root) == [] and (root / "step-00000007").is_dir()
    assert remove_leftovers(tmp_path / "absent") == []


# -- the history a failed run leaves -------------------------------------------------------------


def history_file(tmp_path: Path, lines: int) -> tuple[Path, dict]:
    path = tmp_path / "history.jsonl"
    body = b"".join(b'{"split": "train", "step": %d}\n' % i for i in range(lines))
    path.write_bytes(body)
    mark = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return path, {"history_log": mark}


def test_a_failed_run_leaves_the_history_its_checkpoint_marks(tmp_path):
    path, extra = history_file(tmp_path, 3)
    with open(path, "ab") as f:
        f.write(b'{"split": "train", "step": 3}\n{"split": "tr')  # steps lost, half a line
    assert after_failure(path, extra, fresh=False).startswith("cut")
    assert path.stat().st_size == extra["history_log"]["bytes"]
    assert after_failure(path, extra, fresh=False) == ""  # already so
    extra["history_log"]["sha256"] = "0" * 64  # not the marked history: left for resume to name
    path.write_bytes(path.read_bytes() + b"x\n")
    assert after_failure(path, extra, fresh=False) == "" and path.read_bytes().endswith(b"x\n")
    assert after_failure(path, None, fresh=True).startswith("removed") and not path.exists()


# -- the run's identity --------------------------------------------------------------------------


FP = {"files": 3, "bytes": 1000, "file_list_sha256": "12" * 32, "text_sha256": "34" * 32,
      "content_sha256": "ab" * 32}  # fmt: skip


def test_a_changed_run_is_named_by_field_with_both_values():
    cfg = TrainConfig()
    saved = identity_of(cfg, 4, FP)  # N = 4: M = 4
    assert set(saved) == set(RUN_IDENTITY) and json.loads(json.dumps(saved)) == saved
    same = replace(cfg, nproc=2, micro_batches=4, zero=replace(cfg.zero, stage=3))
    assert run_changes(saved, identity_of(same, 2, FP)) == []  # N and the stage: same bits
    assert run_changes(None, saved) == []  # an older checkpoint: nothing to compare
    edited = {**FP, "text_sha256": "56" * 32, "content_sha256": "cd" * 32}
    now = identity_of(replace(cfg, seed=1, model="tiny"), 4, edited)
    changes = run_changes(saved, now)
    assert [c["field"] for c in changes] == ["seed", "data", "model"]
    text = describe(changes)
    assert text.startswith(
        "--seed: saved 0, now 1; --data: the content differs: saved 1000 bytes, sha256 "
        "3434343434343434, now 1000 bytes, sha256 5656565656565656, and the file names are the "
        "same; --model"
    )
    assert text.endswith("--model: saved 'small', now 'tiny'")
    # M follows N unless given: another N without --micro-batches reads other data per step
    assert run_changes(saved, identity_of(cfg, 2, FP))[0]["field"] == "micro_batches"


def corpus_file(folder: Path, name: str, text: str, size: int = 140_000) -> Path:
    """A text file of about `size` bytes (the default: more than 2 pieces of PIECE_BYTES)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text * (size // len(text)))
    return folder / name


def test_the_data_identity_says_whether_the_names_or_the_content_differ(tmp_path):
    """The same text under another file name reads other data (the split is by name): refused,
    naming the names; the same name with other text: naming the content; both; many files by
    their names' hash. A checkpoint with the old string form compares in that form."""
    cfg = TrainConfig()
    text = "def f(x):\n    return x + 1\n"

    def ident(path: Path) -> dict:
        return identity_of(cfg, 2, load_corpus(path).fingerprint)

    a = ident(corpus_file(tmp_path / "a", "corpus.txt", text))
    renamed = ident(corpus_file(tmp_path / "b", "renamed.txt", text))
    edited = ident(corpus_file(tmp_path / "c", "corpus.txt", text.upper()))
    both = ident(corpus_file(tmp_path / "d", "other.txt", text.upper()))
    assert run_changes(a, ident(corpus_file(tmp_path / "e", "corpus.txt", text))) == []
    assert describe(run_changes(a, renamed)) == (
        "--data: the file names differ: saved ['corpus.txt'], now ['renamed.txt'], and the "
        "content is the same (the validation split is drawn by name)"
    )
    n = a["data"]["bytes"]
    sha_a, sha_e = a["data"]["text_sha256"], edited["data"]["text_sha256"]
    assert sha_a != sha_e and len(sha_a) == 16
    assert describe(run_changes(a, edited)) == (
        f"--data: the content differs: saved {n} bytes, sha256 {sha_a}, now {n} bytes, "
        f"sha256 {sha_e}, and the file names are the same"
    )
    assert describe(run_changes(a, both)) == (
        "--data: the file names differ: saved ['corpus.txt'], now ['other.txt'], and the "
        f"content differs: saved {n} bytes, sha256 {sha_a}, now {n} bytes, sha256 {sha_e}"
    )
    for i in range(30):  # many names: their hash, not the names
        corpus_file(tmp_path / "many", f"f{i:02d}.txt", f"text {i}\n", 2000)
    many = ident(tmp_path / "many")
    (tmp_path / "many" / "f07.txt").rename(tmp_path / "many" / "g07.txt")  # another order too
    moved = ident(tmp_path / "many")
    assert many["data"]["names"] is None
    assert describe(run_changes(many, moved)) == (
        f"--data: the file names differ: saved 30 names, sha256 {many['data']['names_sha256']}, "
        f"now 30 names, sha256 {moved['data']['names_sha256']}, and the content is the same "
        "(the validation split is drawn by name)"
    )
    for i in (3, 4):  # two files' contents swapped: the same names, the same contents
        corpus_file(tmp_path / "many", f"f{i:02d}.txt", f"text {7 - i}\n", 2000)
    assert describe(run_changes(moved, ident(tmp_path / "many"))) == (
        "--data: the same file names and contents, but another content under some name"
    )
    # a checkpoint from before: its data is one string, compared with this data in that form
    fp = load_corpus(tmp_path / "a" / "corpus.txt").fingerprint
    old = f"{fp['files']} files, {fp['bytes']} bytes, sha256 {fp['content_sha256'][:16]}"
    assert run_changes({**a, "data": old}, a) == []
    [change] = run_changes({**a, "data": old}, renamed)
    assert change["saved"] == old and change["now"].startswith(f"1 files, {n} bytes, sha256 ")
    assert describe([change]) == f"--data: saved {old!r}, now {change['now']!r}"


def test_a_timeout_below_the_first_collective_is_refused():
    with pytest.raises(
        ValueError, match=r"^timeout_s=0\.001 is not allowed: expected at least 1 s"
    ):
        TrainConfig(timeout_s=0.001)
    TrainConfig(timeout_s=1.0)


# -- consolidate's output path; the loss curve's memory -----------------------------------------


def test_consolidate_checks_its_output_path_first(tmp_path):
    with pytest.raises(ValueError, match=r"^out='.*': is a directory"):
        check_out(tmp_path)
    with pytest.raises(ValueError, match=r"its folder '.*nope' does not exist"):
        check_out(tmp_path / "nope" / "m.pt")
    with pytest.raises(ValueError, match=r"names no file"):
        check_out(f"{tmp_path}/m.pt/")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"its folder '.*f' is not a folder"):
        check_out(tmp_path / "f" / "m.pt")
    assert check_out(tmp_path / "m.pt") == tmp_path / "m.pt"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # the probe left nothing


def test_a_drawn_loss_curve_leaves_no_figure_alive(tmp_path):
    """[Note: memory of a plot]: each figure was kept until a full collection (1.3 MB a time)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    history = {"train": [{"step": i, "loss": 5.0 - i / 10} for i in range(1, 30)],
               "val": [{"step": 0, "loss": 5.5}]}  # fmt: skip
    gc.disable()  # only plot_losses' own collection may free them
    try:
        for _ in range(3):
            plot_losses(history, tmp_path / "c.png", title="t")
        alive = [o for o in gc.get_objects() if type(o) is Figure]
    finally:
        gc.enable()
    assert alive == [] and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
