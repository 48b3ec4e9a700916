"""ZeRO-Infinity's disk tier (zero/zero_r/disk.py): the master and the optimizer states in
memory-mapped files under ZeroConfig.offload_dir. What is tested: the bits (the same as host
offload's, which are the reference's), where every byte is reported (memory_split's "disk"),
the counted disk traffic, a full disk refused in one line (before any file, or at allocation, the
folder then removed), a state file changed from outside refused by name, the files removed with
the engine, and the configuration's refusals (how a process's end removes them:
tests/distributed/test_disk_exits.py, tests/unit/test_disk_cleanup.py). verify's DISK cells and
disk resume row run the same at every stage (verify/cells/matrix.py,
verify/checkpoints/resume.py)."""

import errno
import gc
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.disk_child import engine, train
from zero.config import ZeroConfig
from zero.ranks.local import get_pool
from zero.zero_r.disk import disk_bytes

pytestmark = pytest.mark.timeout(600)


def states(eng) -> list[bytes]:
    return [t.numpy().tobytes() for u in eng.units for t in (u.master, *u.opt.values())]


def _same_bits_as_host_offload(rank, n, stage, directory):
    disk, host = engine(stage, directory), engine(stage, directory, offload_dir=False)
    train(disk)
    train(host)
    split = disk.memory_split()
    per_step = [
        sorted((r.op, r.unit, r.nbytes) for r in disk.counter.of_step(s, "disk")) for s in range(3)
    ]
    extent_bytes = [4 * disk.master_extent(u).stop - 4 * disk.master_extent(u).start
                    for u in disk.units]  # fmt: skip
    return {
        "same": states(disk) == states(host),
        "working": all(
            torch.equal(disk.working_extent(u)[0], host.working_extent(u)[0]) for u in disk.units
        ),
        "split": split,
        "host_split": host.memory_split(),
        "per_step": per_step,
        "extent_bytes": extent_bytes,
        "files": sorted(os.listdir(disk.placement.offload.root)),
        "file_bytes": sum(p.stat().st_size for p in disk.placement.offload.root.glob("*.f32")),
        "needed": disk.placement.offload.needed,
    }


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_disk_tier_has_host_offloads_bits_and_reports_every_byte(stage, tmp_path):
    """Three steps at N = 2: master, states and working copy equal host offload's bit for bit;
    the master and optimizer bytes move from "host" to "disk", every other byte stays where
    it was; each step reads and writes 3 states x 4 bytes x the extent of every unit."""
    rows = get_pool(2).run(_same_bits_as_host_offload, stage, str(tmp_path))
    for row in rows:
        assert row["same"] and row["working"]
        disk, host = row["split"], row["host_split"]
        for k in ("master", "optimizer"):
            assert disk["disk"][k] == host["host"][k] > 0 and disk["host"][k] == 0
        for at in ("device", "host"):
            for k in ("params", "grads", "staging"):
                assert disk[at].get(k, 0) == host[at].get(k, 0)
        want = sorted(
            (op, i, 3 * b) for i, b in enumerate(row["extent_bytes"])
            for op in ("disk_read", "disk_write")
        )  # fmt: skip
        assert row["per_step"] == [want] * 3
        # master, exp_avg, exp_avg_sq of each unit, and the owner's record
        assert (
            len(row["files"]) == 3 * len(row["extent_bytes"]) + 1 and "owner.json" in row["files"]
        )
        assert row["file_bytes"] == row["needed"] == 3 * sum(row["extent_bytes"])  # disk_bytes


def _one_engine(rank, n, directory):
    eng = engine(1, directory)
    root = eng.placement.offload.root
    train(eng, 1)
    there = root.is_dir()
    del eng
    gc.collect()
    return there, root.exists()


@pytest.mark.dist
def test_the_state_files_go_with_the_engine(tmp_path):
    assert get_pool(1).run(_one_engine, str(tmp_path)) == [(True, False)]
    assert list(tmp_path.iterdir()) == []


def _tamper(rank, n, directory, how):
    eng = engine(2, directory)
    train(eng, 1)
    f = eng.placement.offload.files[eng.units[1].index][1]
    if how == "remove":
        f.path.unlink()
    else:
        os.truncate(f.path, f.nbytes // 2)
    try:
        train(eng, 1)
    except RuntimeError as exc:
        return str(exc), str(f.path)
    return "trained on", str(f.path)


@pytest.mark.dist
@pytest.mark.parametrize("how", ["remove", "truncate"])
def test_a_state_file_changed_from_outside_is_refused_by_name(how, tmp_path):
    """Removed: its data would survive in the open mapping, but the run's state on disk is
    gone; resized: reading past the end would be a SIGBUS. Both are refused, by name, before
    the unit's next update."""
    message, path = get_pool(1).run(_tamper, str(tmp_path), how)[0]
    assert path in message
    assert ("removed" in message) if how == "remove" else ("resized" in message)


def _full_disk(rank, n, directory, how):
    """Engine construction over a disk found short before any file (statvfs), or whose
    allocation fails all the same (posix_fallocate: another process took the space)."""

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def small(path):
        return os.statvfs_result((4096, 4096, 1000, 10, 10, 100, 50, 50, 0, 255))

    name = "posix_fallocate" if how == "fallocate" else "statvfs"
    real = getattr(os, name)
    setattr(os, name, no_space if how == "fallocate" else small)
    err = (None, "built")
    try:
        eng = engine(1, directory)
        err = (eng.placement.offload.needed, "built")
    except ValueError as exc:
        err = (type(exc).__name__, str(exc))
    finally:
        setattr(os, name, real)
    # no gc.collect(): the folder goes with the error, not with the half-built engine
    needed = disk_bytes(*_parts_and_stages(directory))
    return *err, needed, sorted(str(p) for p in Path(directory).rglob("*"))


def _parts_and_stages(directory):
    """disk_bytes's arguments for engine(1, directory) at this world size."""
    eng = engine(1, directory, offload_dir=False)
    return eng.config, [u.part for u in eng.units], [type(eng.stage_of(u)) for u in eng.units]


@pytest.mark.dist
@pytest.mark.parametrize("how", ["statvfs", "fallocate"])
def test_a_full_disk_is_refused_in_one_line_at_construction(how, tmp_path):
    """Short before any file: refused naming offload_dir, the bytes needed and the bytes free,
    nothing written. Short all the same at allocation: refused naming offload_dir, the bytes
    needed and the file, and the rank's folder removed at once. One line each (ValueError: a
    CLI prints it as `prog: error: ...`, exit status 2)."""
    kind, message, needed, left = get_pool(1).run(_full_disk, str(tmp_path), how)[0]
    assert kind == "ValueError" and "\n" not in message, message
    assert message.startswith(f"offload_dir={str(tmp_path)!r}: ")
    if how == "statvfs":
        free = 10 * 4096  # f_bavail x f_frsize
        assert f"need {needed:,} bytes there and {free:,} bytes are free" in message
        assert "nothing was written" in message
    else:
        assert f"({needed:,} bytes in all; No space left on device allocating u0000-master" in (
            message
        )
        assert "zero-states-" in message and "is removed" in message
    assert left == []  # no file and no folder


@pytest.mark.parametrize(
    "kw, text",
    [
        (dict(offload_dir="/nonexistent/dir", offload_optimizer=True), "not an existing"),
        (dict(offload_dir=".", offload_optimizer=False), "offload_optimizer=True"),
        (dict(offload_dir=3, offload_optimizer=True), "directory path"),
    ],
)
def test_offload_dir_refusals_name_the_field(kw, text):
    with pytest.raises(ValueError, match="offload_dir=") as exc:
        ZeroConfig(**kw)
    assert text in str(exc.value)
