"""Checkpoints under attack: damaged, hostile and edited files, a full disk, two jobs on one
output directory.

Damage: each of verify/resume.py's damages (a flipped byte, a short shard, a symlink, a FIFO,
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

import re
import resource
import shutil
import signal
import time
from functools import partial
from pathlib import Path

from .core import PY, Case, Ctx, Result, one_line_error
from .runs import LONG_STEPS, STEPS, bytes_lost, committed, final_sha, resume
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
    """(what, damage(root) -> the damaged path): verify/resume.py's, and two more."""
    from verify.resume import _damages

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
    return Result("survived", "EFBIG named, no partial files, resumed in place bitwise"
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
    if release:
        out.append(Case("two_jobs_one_out", "checkpoints", "a second job on a running job's --out",
                        "second refused in one line naming run.lock; first finishes bitwise",
                        240, two_jobs_case))  # fmt: skip
    return out
