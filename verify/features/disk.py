"""ZeRO-Infinity's disk tier (ZeroConfig.offload_dir): with optimizer offload, master weights
and optimizer states in files under a folder, mapped one unit at a time (zero/zero_r/disk.py)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from .record import Bug, Feature, Pair


def expected_disk_traffic(config, spec, n: int, skipped: bool) -> tuple[str, dict[str, int]]:
    """The disk tier's counted bytes of one step as {"op:u<index>": float32 elements}: per
    unit, its master and optimizer states over the master's extent (as in
    verify.checks.expect.expected_offload_copies) read once before its update and written once
    after;
    nothing in a skipped step, whose update does not run. Empty without offload_dir."""
    from ..checks.expect import optimizer_states, persistent

    if config.offload_dir is None or skipped:
        return "disk", {}
    out = {}
    for i, lay in enumerate(spec.layouts):
        stage = 0 if persistent(config, lay) else config.stage
        extent = lay.padded_numel(n) if stage == 0 else lay.shard_numel(n)
        for op in ("disk_read", "disk_write"):
            out[f"{op}:u{i}"] = (1 + optimizer_states(config)) * extent
    return "disk", out


def dead_owners_folder(rank: int, config):
    """Rank 0: a disk-tier folder as a process killed outright leaves it (its owner's record, a
    state file), whose owner has exited; the engine must remove it at its start. Returns the
    check of that (None on other ranks)."""
    from zero.common import owner

    if rank != 0:
        return None
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid runs no more
    folder = Path(tempfile.mkdtemp(prefix=f"zero-states-{dead.pid}-", dir=config.offload_dir))
    record = {**owner.identity(), "pid": dead.pid, "proc_start": None}
    (folder / "owner.json").write_text(json.dumps(record))
    (folder / "u0000-master.f32").write_bytes(bytes(64))
    return lambda: (
        f"disk tier: a dead owner's folder, {folder}, was not removed at the start"
        if folder.exists()
        else ""
    )


def plant_disk_mapped_private(p) -> None:
    """The disk tier maps its state files privately (copy-on-write): each update lands in
    private pages that the write-back drops, so the next step reads the file's old values."""
    import mmap

    from zero.zero_r import disk

    real = mmap.mmap

    def private(fd, length, *args, **kw):
        return real(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    p.setattr(disk.mmap, "mmap", private)


FEATURE = Feature(
    name="disk",
    doc="ZeRO-Infinity's disk tier: master and optimizer states in files (offload_dir)",
    config=lambda value: {"offload_dir": tempfile.gettempdir()},
    needs=lambda c: "" if c.offload else "the disk tier holds offloaded states; add 'offload'",
    # master and states in files at every stage, and in fast mode at stage 2 (the running sum
    # on the host beside files)
    quick=tuple(
        dict(stage=s, precision=p, optimizer=o, mode=mode, features=("offload", "disk"),
             seed=8000 + s)
        for s, p, o, mode in ((0, "bf16", "adamw", "deterministic"),
                              (1, "fp32", "adam", "deterministic"),
                              (2, "fp16", "sgd", "deterministic"),
                              (3, "bf16", "adamw", "deterministic"), (2, "bf16", "adamw", "fast"))
    ),
    resume=(
        # saved from state files, resharded into them
        ({1, 2}, dict(n1=2, s1=3, n2=1, s2=1, precision="bf16", optimizer="adamw",
                      features=("offload", "disk"))),
    ),
    branches={"the disk tier (offload_dir)": lambda c: c.disk},
    pairs=(
        Pair("disk tier × stage 2-3", "the reduced shard in host memory, its states in files",
             "cells", lambda c: c.disk and c.stage >= 2),
        Pair("disk tier × fast mode", "the host running sum beside state files", "cells",
             lambda c: c.disk and c.mode == "fast"),
        Pair("disk tier × resume", "saved from state files, resharded into them", "resume",
             lambda r: "disk" in r.features),
    ),
    bugs=(
        # the states read back from the files are compared after every step: the second shows it
        Bug(name="disk_mapped_private", breaks="the disk tier's state files mapped copy-on-write",
            where="the disk tier, two optimizer steps", plant=plant_disk_mapped_private,
            observable=lambda c: c.disk and c.mode == "deterministic" and c.optimizer_steps >= 2,
            check="state"),
    ),
    traffic=expected_disk_traffic,
    arrange=dead_owners_folder,
)  # fmt: skip
