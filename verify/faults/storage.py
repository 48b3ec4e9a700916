"""Checkpoints under attack: damaged, hostile and edited files, a full disk, two jobs on one
output directory.

Damage: each of verify/checkpoints/resume.py's damages (a flipped byte, a short shard, a symlink, a
FIFO,
a shape / a unit's states / the optimizer edited and re-checksummed, `latest` outside the
root), plus a shard linked to /dev/zero and `latest` removed, made to a copy of the undisturbed
run's output. `python -m zero.checkpoint verify` and `python -m zero.workloads.train --resume` must
each refuse it, naming the damaged file, without blocking and without removing a committed file.
A full disk is real where an unprivileged process can make one: RLIMIT_FSIZE (with SIGXFSZ
ignored, as Python does) makes a write past the limit fail with EFBIG, as a full file system
fails one with ENOSPC; the run resumed under it must fail naming the file, leave no partial
files and `latest` on the previous checkpoint, and a resume in place after it must be bitwise.
Two jobs on one --out: the second must be refused in one line, the first finish bitwise.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import time
from functools import partial
from pathlib import Path

from . import runs
from .core import PY, Case, Ctx, Result, one_line_error
from .runs import LONG_STEPS, STEPS, bytes_lost, committed, final_sha, resume, rolled_back
from .signals import steps_done


def _extra_damages(step: Path):
    shard = sorted(p.name for p in step.glob("u*-r*.bin"))[0]

    def dev_zero(root):
        f = root / step.name / shard
        f.unlink()
        f.symlink_to("/dev/zero")
        return f

    def no_latest(root):
        (root / "latest").unlink()
        return root / "latest"

    return [
        ("a shard linked to /dev/zero", dev_zero),
        ("latest removed (--resume must not start afresh)", no_latest),
    ]


def damages(step: Path) -> list:
    """(what, damage(root) -> the damaged path): verify/checkpoints/resume.py's, and two more."""
    from verify.checkpoints.resume import _damages

    return [(what, fn) for what, fn, _ in _damages(step)] + _extra_damages(step)


def snapshot(root: Path) -> dict:
    """size and mtime of every file of every committed step directory."""
    return {
        str(f): (f.lstat().st_size, f.lstat().st_mtime_ns)
        for d in committed(root)
        for f in d.iterdir()
    }


def damage_case(ctx: Ctx, *, index: int) -> Result:
    _, base = ctx.shared.baseline(ctx)
    out = ctx.dir / "run"
    shutil.copytree(base, out, symlinks=True)
    root = out / "ckpt"
    from zero.checkpoint import resolve

    what, damage = damages(resolve(root))[index]
    bad = damage(root)
    before = snapshot(root)
    verify = ctx.job([PY, "-m", "zero.checkpoint", "verify", str(root)], tag="verify")
    train = None
    if verify.wait(ctx) is not None:
        train = resume(ctx, ctx.shared, out, steps=STEPS + 1, tag="resume")
    if train is None or train.wait(ctx) is None:
        return Result("hang", f"{what}: {'verify' if train is None else '--resume'} blocked")
    ctx.settle(train)
    after = snapshot(root)
    lost = sum(size for path, (size, _) in before.items() if after.get(path) != before[path])
    lost -= before.get(str(bad), (0, 0))[0] if after.get(str(bad)) != before.get(str(bad)) else 0
    verdicts = []
    for job in (verify, train):
        text = job.text()
        if job.proc.returncode == 0:
            return Result("silent_wrong", f"{what}: {job.tag} accepted it", lost)
        if bad.name not in text:
            tail = text.strip().splitlines()[-1:] or [""]
            return Result("unclear", f"{what}: {job.tag} does not name {bad.name}: {tail[0]}")
        verdicts.append("one line" if one_line_error(text) else "traceback")
    return Result("refused", f"{what}: verify ({verdicts[0]}), --resume ({verdicts[1]}) name "
                  f"{bad.name}", lost)  # fmt: skip


FSIZE_LIMIT = 100_000
"""Bytes a file may reach in the full-disk case: above the loss curve (~40 KB), the log and
the history, below every shard of the tiny GPT (147 KB and more), so the save fails first."""


def _small_disk():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def disk_full_case(ctx: Ctx) -> Result:
    sha, base = ctx.shared.baseline(ctx)
    out = ctx.dir / "run"
    shutil.copytree(base, out, symlinks=True)
    root = out / "ckpt"
    last = f"step-{STEPS:08d}"
    shutil.rmtree(root / last)  # back to the checkpoint before the last step
    (root / "latest").write_text(f"step-{STEPS - 1:08d}\n")
    full = ctx.job(ctx.shared.argv(out, "--resume"), tag="small-disk", preexec=_small_disk)
    if full.wait(ctx) is None:
        return Result("hang", "the run on a full disk did not end")
    ctx.settle(full)
    text = full.text()
    lost, why = bytes_lost(root)
    partial = [d.name for d in root.glob("step-*") if not (d / "manifest.json").exists()]
    temps = [f.name for f in root.rglob("*") if ".tmp" in f.name]
    if full.proc.returncode == 0:
        return Result("silent_wrong", "the save past the limit reported success", lost)
    if not re.search(rf"File too large: '{re.escape(str(root))}/step-\S+'", text):
        tail = text.strip().splitlines()[-1:] or [""]
        return Result("unclear", f"the error names no file or cause: {tail[0]}", lost)
    if one_line_error(text) is None:
        return Result("unclear", "the full disk is named, but not in one line", lost)
    if partial or temps:
        return Result("unclear", f"partial files left: {partial + temps}", lost)
    again = resume(ctx, ctx.shared, out, tag="resume")
    if again.wait(ctx) is None:
        return Result("hang", "the resume after the full disk did not end", lost)
    ctx.settle(again)
    if again.proc.returncode != 0:
        return Result("unclear", f"resume in place failed: {again.text()[-300:]}", lost)
    if final_sha(out) != sha:
        return Result("silent_wrong", "resumed in place, but not bitwise", lost)
    return Result("survived", "EFBIG named in one line, no partial files, resumed in place bitwise"
                  + (f"; {why}" if why else ""), lost)  # fmt: skip


def two_jobs_case(ctx: Ctx) -> Result:
    sha, _ = ctx.shared.baseline(ctx, LONG_STEPS)
    out = ctx.dir / "run"
    first = ctx.job(ctx.shared.argv(out, steps=LONG_STEPS), tag="first")
    while steps_done(out) < 2 and not first.done() and ctx.left() > 0:
        time.sleep(0.01)
    second = ctx.job(ctx.shared.argv(out), tag="second")
    if second.wait(ctx) is None or first.wait(ctx) is None:
        return Result("hang", "a job did not end")
    ctx.settle(first)
    ctx.settle(second)
    lost, why = bytes_lost(out / "ckpt")
    line = one_line_error(second.text())
    if second.proc.returncode == 0:
        return Result("silent_wrong", "the second job ran on the same --out", lost)
    if first.proc.returncode != 0 or final_sha(out) != sha:
        return Result("silent_wrong", f"the first job ended {first.proc.returncode}, "
                      f"not bitwise: {first.text()[-300:]}", lost)  # fmt: skip
    if line is None or "run.lock" not in line:
        return Result("unclear", f"the refusal is not one line naming run.lock: {line}", lost)
    return Result("survived", f"second refused ({line.split(': ', 2)[-1][:90]}...); first "
                  "finished bitwise" + (f"; {why}" if why else ""), lost)  # fmt: skip


# -- what a killed job leaves: a stale run.lock, temp files ------------------------------------


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped): one that runs no more here."""
    import subprocess

    done = subprocess.Popen([PY, "-c", "pass"])
    done.wait()
    return done.pid


def _lock(out: Path, pid: int, host: str) -> None:
    (out / "run.lock").write_text(json.dumps({"pid": pid, "host": host, "started": "then"}))


def stale_lock_case(ctx: Ctx) -> Result:
    """run.lock of a holder killed with its whole job (SIGKILL, an OOM kill): --resume reports it
    in one line, clears it and finishes bitwise; a lock of a live process, or of another host,
    still refuses in one line naming the holder."""
    sha, out = rolled_back(ctx)
    refusals = []
    for tag, pid, host in (("live", os.getpid(), socket.gethostname()),
                           ("elsewhere", 1, "another-host.invalid")):  # fmt: skip
        _lock(out, pid, host)
        job = resume(ctx, ctx.shared, out, tag=tag)
        if job.wait(ctx) is None:
            return Result("hang", f"--resume with a {tag} lock did not end")
        ctx.settle(job)
        line = one_line_error(job.text())
        if job.proc.returncode == 0:
            return Result("silent_wrong", f"--resume ran past the lock of a {tag} holder")
        if job.proc.returncode != 2 or line is None or f"pid {pid} on {host}" not in line:
            return Result("unclear", f"{tag} lock: not one line naming pid {pid} on {host}: "
                          f"{job.text()[-200:]}")  # fmt: skip
        refusals.append(tag)
    dead = _dead_pid()
    _lock(out, dead, socket.gethostname())
    job = resume(ctx, ctx.shared, out, tag="stale")
    if job.wait(ctx) is None:
        return Result("hang", "--resume with a stale lock did not end")
    ctx.settle(job)
    lost, why = bytes_lost(out / "ckpt")
    said = [x for x in job.text().splitlines() if "stale lock" in x]
    if job.proc.returncode != 0:
        return Result("unclear", f"--resume with a stale lock failed: {job.text()[-300:]}", lost)
    if len(said) != 1 or f"pid {dead} on {socket.gethostname()}" not in said[0]:
        return Result("unclear", f"the stale lock was not reported in one line: {said}", lost)
    if (out / "run.lock").exists() or final_sha(out) != sha:
        return Result("silent_wrong", "resumed, but not bitwise or the lock left behind", lost)
    return Result("survived", f"stale lock of pid {dead} reported and cleared, resumed bitwise; "
                  f"{' and '.join(refusals)} holders refused" + (f"; {why}" if why else ""),
                  lost)  # fmt: skip


TEMPS = ("ckpt/.latest.a1b2c3d4.tmp", "ckpt/step-{s}/.manifest.json.k9x8w7v6.tmp",
         "ckpt/step-{s}/.u0000-r0001.bin.q1w2e3r4.tmp", ".train_log.json.z0y9x8w7.tmp")  # fmt: skip
"""0-byte temp files as a SIGTERM or SIGKILL between mkstemp and the rename leaves them."""
NOT_OURS = ("ckpt/.notes.tmp", ".model.pt.tmp")
"""Files that are not this run's temp files (another tool's): a resume must keep them."""


def temp_leftover_case(ctx: Ctx) -> Result:
    """Temp files of a killed writer in OUT and OUT/ckpt: no such file outlives --resume; files
    that are not the run's own temp files are kept."""
    sha, out = rolled_back(ctx)
    planted = [out / t.format(s=f"{STEPS - 1:08d}") for t in TEMPS]
    for f in planted + [out / n for n in NOT_OURS]:
        f.write_bytes(b"")
    job = resume(ctx, ctx.shared, out)
    if job.wait(ctx) is None:
        return Result("hang", "--resume with leftover temp files did not end")
    ctx.settle(job)
    lost, why = bytes_lost(out / "ckpt")
    if job.proc.returncode != 0:
        return Result("unclear", f"--resume failed: {job.text()[-300:]}", lost)
    left = [str(f.relative_to(out)) for f in planted if os.path.lexists(f)]
    left += [str(f.relative_to(out)) for f in out.rglob(".*.tmp")
             if f.name not in {Path(n).name for n in NOT_OURS}]  # fmt: skip
    kept = [n for n in NOT_OURS if (out / n).exists()]
    if left:
        return Result("unclear", f"temp files outlived the resume: {sorted(set(left))}", lost)
    if kept != list(NOT_OURS):
        return Result("unclear", f"files that are not temp files were removed: {NOT_OURS}", lost)
    if final_sha(out) != sha:
        return Result("silent_wrong", "resumed, but not bitwise", lost)
    detail = f"{len(planted)} temp files removed at the resume, {len(kept)} other files kept, "
    return Result("survived", detail + "resumed bitwise" + (f"; {why}" if why else ""), lost)


# -- every file checked: the RNG and buffer file; consolidate's output path -------------------


def rng_damage_case(ctx: Ctx) -> Result:
    """A flipped byte in r0000.bin (rank 0's RNG state and the buffers), which consolidation's
    reading of the parameters never opens: verify, consolidate and --resume name the file."""
    _, base = ctx.shared.baseline(ctx)
    out = ctx.dir / "run"
    shutil.copytree(base, out, symlinks=True)
    from zero.checkpoint import resolve

    bad = resolve(out / "ckpt") / "r0000.bin"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    ck, model = str(out / "ckpt"), str(ctx.dir / "model.pt")
    jobs = [
        ctx.job([PY, "-m", "zero.checkpoint", "verify", ck], tag="verify"),
        ctx.job([PY, "-m", "zero.checkpoint", "consolidate", ck, model], tag="consolidate"),
    ]
    jobs.append(resume(ctx, ctx.shared, out, steps=STEPS + 1, tag="resume"))  # fmt: skip
    shown = []
    for job in jobs:
        if job.wait(ctx) is None:
            return Result("hang", f"{job.tag} with a damaged r0000.bin did not end")
        ctx.settle(job)
        line = one_line_error(job.text())
        if job.proc.returncode == 0:
            return Result("silent_wrong", f"{job.tag} accepted a damaged r0000.bin")
        if line is None or "r0000.bin" not in line:
            tail = job.text().strip().splitlines()[-1:] or [""]
            return Result("unclear", f"{job.tag}: not one line naming r0000.bin: {tail[0][:160]}")
        shown.append(f"{job.tag} (exit {job.proc.returncode})")
    if Path(model).exists():
        return Result("unclear", "consolidate refused, but wrote its output")
    return Result("refused", f"{', '.join(shown)}: one line naming r0000.bin")


def _read_only(ctx: Ctx) -> Path | None:
    """A folder this process cannot write in: one made read-only, or (as root, whom modes do not
    stop) /sys, read-only where the kernel's sysfs is; None if there is none."""
    import tempfile

    ro = ctx.dir / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    for d in (ro, Path("/sys")):
        try:
            with tempfile.TemporaryFile(dir=d):
                pass
        except OSError:
            return d
    return None


def consolidate_out_case(ctx: Ctx) -> Result:
    """consolidate CKPT OUT with OUT an existing directory, in a missing folder, in a read-only
    folder: exit 2, one line naming OUT, found before the work (the checkpoint given is damaged,
    so that reading it first would give another error), no temp file left anywhere."""
    _, base = ctx.shared.baseline(ctx)
    out = ctx.dir / "run"
    shutil.copytree(base, out, symlinks=True)
    from zero.checkpoint import resolve

    shard = sorted(resolve(out / "ckpt").glob("u*-r*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-8])  # consolidating would fail on it, exit 1
    target = ctx.dir / "target"
    target.mkdir()
    ro = _read_only(ctx)
    bad = {"an existing directory": target, "a missing folder": ctx.dir / "nope" / "m.pt"}
    if ro is not None:
        bad["a read-only folder"] = ro / "m.pt"
    shown = []
    for what, path in bad.items():
        job = ctx.job([PY, "-m", "zero.checkpoint", "consolidate", str(out / "ckpt"), str(path)],
                      tag=what.split()[-1])  # fmt: skip
        if job.wait(ctx) is None:
            return Result("hang", f"consolidate to {what} did not end")
        ctx.settle(job)
        line = one_line_error(job.text())
        if job.proc.returncode != 2 or line is None or f"out={str(path)!r}" not in line:
            tail = job.text().strip().splitlines()[-1:] or [""]
            return Result("unclear", f"OUT {what}: exit {job.proc.returncode}, not 2 with one "
                          f"line naming it: {tail[0][:160]}")  # fmt: skip
        shown.append(what)
    temps = [str(p) for p in ctx.dir.rglob(".*.tmp")]
    if temps or list(target.iterdir()):
        return Result(
            "unclear", f"consolidate left files: {temps + list(map(str, target.iterdir()))}"
        )
    missing = "" if ro is not None else " (no read-only folder here to try)"
    return Result("refused", f"OUT {', '.join(shown)}: exit 2, one line naming OUT, before "
                  f"reading the checkpoint; no temp files{missing}")  # fmt: skip


def cases(release: bool) -> list[Case]:
    names = ["flip", "short", "symlink", "fifo", "shape", "states", "optimizer", "outside",
             "dev_zero", "no_latest"]  # fmt: skip
    out = []
    for i, name in enumerate(names):
        if release or name == "fifo":
            out.append(Case(f"ckpt_{name}", "checkpoints", f"checkpoint damage: {name}",
                            "verify and --resume refuse, naming the file; nothing removed",
                            180, partial(damage_case, index=i), fast=name == "fifo"))  # fmt: skip
    out.append(Case("disk_full", "checkpoints", f"RLIMIT_FSIZE {FSIZE_LIMIT} B: EFBIG mid-save",
                    "error naming the file, no partial files, latest intact, resume bitwise",
                    240, disk_full_case))  # fmt: skip
    out += [
        Case("stale_lock", "checkpoints", "run.lock of a job killed whole (a dead pid, this host)",
             "reported in one line and cleared, resume bitwise; live and other-host holders "
             "refused in one line", 240, stale_lock_case, fast=True),
        Case("temp_leftover", "checkpoints", "0-byte temp files a killed writer left",
             "none outlives --resume, other files kept; resume bitwise", 180,
             temp_leftover_case, fast=True),
        Case("ckpt_rng_r0000", "checkpoints", "a flipped byte in r0000.bin (RNG, buffers)",
             "verify, consolidate and --resume refuse in one line naming it", 180,
             rng_damage_case, fast=True),
        Case("consolidate_bad_out", "checkpoints", "consolidate to a directory, a missing or "
             "read-only folder", "exit 2, one line naming OUT, before the work; no temp file",
             120, consolidate_out_case, fast=True),
        *runs.cases(release),
    ]  # fmt: skip
    if release:
        out.append(Case("two_jobs_one_out", "checkpoints", "a second job on a running job's --out",
                        "second refused in one line naming run.lock; first finishes bitwise",
                        240, two_jobs_case))  # fmt: skip
    return out
