"""ZeRO-Infinity's disk tier (zero/zero_r/disk.py): the master and the optimizer states in
memory-mapped files under ZeroConfig.offload_dir. What is tested: the bits (the same as host
offload's, which are the reference's), where every byte is reported (memory_split's "disk"),
the counted disk traffic, a full disk and a state file changed from outside refused by name, the
files removed with the engine, and the configuration's refusals. verify's DISK cells and disk
resume row run the same at every stage (verify/matrix.py, verify/resume.py)."""

import errno
import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from verify.cell import GROUPS
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.local import get_pool
from zero.workloads.models import MLP, MLPConfig, mlp_microbatches

pytestmark = pytest.mark.timeout(600)
CFG = MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)


def engine(stage, directory, *, offload_dir=True, precision="bf16"):
    model = MLP(CFG, seed=5)
    return ZeroEngine(
        model,
        ZeroConfig(
            stage=stage, precision=precision, optimizer="adamw", groups=GROUPS["adamw"][:1],
            micro_batches=2 * dist.get_world_size(), units=tuple(model.unit_names()), chunk=128,
            offload_optimizer=True, offload_dir=str(directory) if offload_dir else None,
        ),
    )  # fmt: skip


def train(eng, steps=3):
    n, r = eng.world_size, eng.rank
    for s in range(steps):
        batches = mlp_microbatches(CFG, seed=0, data_step=s, count=2 * n, batch_size=4)
        for k in range(2):
            _, loss = eng(*batches[k * n + r])
            eng.backward(loss)
        eng.step()


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
        assert len(row["files"]) == 3 * len(row["extent_bytes"])  # master, exp_avg, exp_avg_sq


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


def _full_disk(rank, n, directory):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real, os.posix_fallocate = os.posix_fallocate, no_space
    err = (None, "built")
    try:
        engine(1, directory)
    except OSError as exc:
        err = (exc.errno, str(exc))
    finally:
        os.posix_fallocate = real
    gc.collect()  # the half-built engine, and with it its directory
    return *err, sorted(str(p) for p in Path(directory).rglob("*"))


@pytest.mark.dist
def test_a_full_disk_is_an_error_at_construction_naming_the_file(tmp_path):
    code, message, left = get_pool(1).run(_full_disk, str(tmp_path))[0]
    assert code == errno.ENOSPC
    assert "cannot allocate" in message and "u0000-master.f32" in message
    assert left == []  # no half-made file, and the engine's directory removed


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
