"""What a job killed whole leaves in the temporary folder, removed by the next launch ([Note:
rendezvous folders of a job killed whole] in zero/ranks/signals.py); and a rank's refusal of its
input reaching the training command as one line (exit 2)."""

import json
import os
import socket
import subprocess
import tempfile

import pytest

from zero.common import owner
from zero.ranks import signals


def _folder(root, name, record):
    path = root / name
    path.mkdir()
    (path / "store").write_text("x")
    if record is not None:
        (path / signals.OWNER).write_text(json.dumps(record))
    return path


def test_the_next_launch_removes_only_dead_launchers_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that runs no more
    dead = _folder(tmp_path, "zero-spawn-dead", {**owner.identity(), "pid": gone.pid})
    pool = _folder(tmp_path, "zero-pool-dead", {**owner.identity(), "pid": gone.pid})
    live = _folder(tmp_path, "zero-spawn-live", owner.identity())
    elsewhere = _folder(
        tmp_path,
        "zero-spawn-far",
        {**owner.identity(), "pid": gone.pid, "host": "not-" + socket.gethostname()},
    )
    unowned = _folder(tmp_path, "zero-spawn-new", None)  # being made right now
    other = _folder(tmp_path, "other-dead", {**owner.identity(), "pid": gone.pid})
    said = []
    removed = signals.clear_dead_launchers(said.append)
    assert sorted(removed) == sorted([str(dead), str(pool)])
    assert not dead.exists() and not pool.exists()
    assert all(p.exists() for p in (live, elsewhere, unowned, other))
    assert len(said) == 2 and all(f"launcher pid {gone.pid}" in x for x in said)
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (live, elsewhere, unowned, other))


def test_a_launch_writes_its_owner_into_its_folder(tmp_path):
    signals.own_folder(str(tmp_path))
    record = json.loads((tmp_path / signals.OWNER).read_text())
    assert record == owner.identity() and not owner.is_dead_here(record)


def test_a_ranks_value_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from zero.common import cli
    from zero.ranks.launch import RankError
    from zero.workloads import train

    why = "offload_dir='/x': this rank's states need 9 bytes there and 1 are free"

    def refused(*a, **kw):
        raise RankError(1, f"Traceback (most recent call last):\n  File ...\nValueError: {why}\n")

    monkeypatch.setattr(train, "spawn", refused)
    args = ["--nproc", "2", "--model", "tiny", "--steps", "1", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as info:
        cli.run(train.cli_main, train.PROG, args)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err == [f"{train.PROG}: error: {why}"]
