"""Signals landed at chosen points of a step, and what a crash there must not leave behind.

A case runs the 12-step training run (verify/faults/runs.py) through verify/faults/hooks.py,
which holds one rank at a point of a step drawn from the case's seed: its backward, the disk
tier's write-back of a unit's state files in the optimizer update, a save after its first shard,
a save's first file (owner.json: the new step folder still empty), a prune (an old step folder
renamed to its trash name). Once the rank is held, the case sends its signal: SIGKILL to that
rank, SIGTERM to the launcher, or SIGKILL to the whole job (the launcher and every rank at
once, as a scheduler's kill of a job does). The right outcome:
- the error names the rank (a killed rank), or the launcher ends by its signal (143 for a
  SIGTERM, every rank with it; -9 for a killed job), and every committed checkpoint verifies;
- `--resume` in place (with the same --offload-dir) ends in the undisturbed run's bits;
- nothing is left behind: a state folder (`zero-states-*`) of a rank that could not remove it
  (killed outright) is removed by that next start with a `note:` line naming it, and so are a
  save's step folder without manifest.json and a prune's trash folder (`.trash-*`). What the
  resume did not remove is counted as leftovers (core.leftovers), which fail the case.
A too-small --offload-dir must be refused before training, in one line naming the folder and the
bytes needed, with nothing left in it: a 64 KiB tmpfs mounted in a mount namespace of the job's
own where the system lets an unprivileged process make one (`unshare -Urm`), and a file size
limit (RLIMIT_FSIZE, as the disk_full case: an allocation past it fails with EFBIG, as one on a
full disk fails with ENOSPC).
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import signal
import time
from functools import partial
from pathlib import Path

from . import hooks
from .core import Case, Ctx, Result, marked_pids, one_line_error
from .runs import STEPS, bytes_lost, final_sha
from .signals import RUN_TIMEOUT_S, names_rank, resumed, steps_done

HOWS = {
    "kill_rank": "SIGKILL to the held rank",
    "term_launcher": "SIGTERM to the launcher",
    "kill_job": "SIGKILL to the whole job (launcher and ranks)",
}
NAMES = {
    "kill_rank": "sigkill_rank1",
    "term_launcher": "sigterm_launcher",
    "kill_job": "sigkill_job",
}
POINTS = {
    "backward": "in its backward",
    "update": "in the optimizer update, its state files being written back",
    "mid_save": "mid-save, after its first shard",
    "save_first": "at a save's first file (the step folder still empty)",
    "prune": "in a prune (the old step folder renamed to trash, not yet deleted)",
}


def _held_run(ctx: Ctx, out: Path, spec: str, extra: list[str]):
    """The run with a rank held as `spec` says (hooks.py); (job, the held rank's record or None
    when the run ended, or the case's deadline passed, first)."""
    marker = ctx.dir / "held.json"
    env = {hooks.ENV: spec, hooks.FILE_ENV: str(marker)}
    argv = ctx.shared.argv(out, "--timeout", str(RUN_TIMEOUT_S), *extra, module=hooks.__name__)
    job = ctx.job(argv, env=env, tag="run")
    while not marker.exists() and not job.done() and ctx.left() > 0:
        time.sleep(0.01)
    return job, (json.loads(marker.read_text()) if marker.exists() else None)


def _send(job, how: str, held: dict) -> None:
    if how == "kill_rank":
        os.kill(held["pid"], signal.SIGKILL)
    elif how == "term_launcher":
        os.kill(job.pid, signal.SIGTERM)
    else:  # the whole job at once, as a scheduler kills a job: its process group in one call
        # (no process of it, the launcher's janitor included, runs a line after it), then any
        # process of the job that left the group
        os.killpg(job.pid, signal.SIGKILL)
        for pid in marked_pids(job.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ended_wrong(how: str, code: int, text: str, rank: int) -> str:
    """'' when the run ended as `how` must end it, else what is wrong."""
    if how == "kill_rank":
        if names_rank(text, rank, stalled=False):
            return ""
        return f"the error does not name rank {rank}"
    want = 128 + signal.SIGTERM if how == "term_launcher" else -signal.SIGKILL
    if code != want:
        return f"exit {code}, not {want}"
    lines = text.strip().splitlines()
    if how == "term_launcher" and not (lines and "SIGTERM" in lines[-1]):
        return f"the last line does not name SIGTERM: {lines[-1:]}"
    return ""


def _left(out: Path, offload: Path | None) -> list[Path]:
    """What a crash left that the next start must remove: state folders, step folders without
    a manifest, trash."""
    ckpt = out / "ckpt"
    found = sorted(offload.glob("zero-states-*")) if offload is not None else []
    found += sorted(d for d in ckpt.glob("step-*") if not (d / "manifest.json").exists())
    return found + sorted(ckpt.glob(".trash-*"))


def held_case(ctx: Ctx, *, point: str, how: str, rank: int = 1, stage: int = 2,
              disk: bool = True) -> Result:  # fmt: skip
    sha, _ = ctx.shared.baseline(ctx)
    out, offload = ctx.dir / "run", ctx.dir / "offload"
    extra = ["--stage", str(stage)]
    if disk:
        offload.mkdir()
        extra += ["--offload-optimizer", "--offload-dir", str(offload)]
    after = random.Random(f"{ctx.shared.seed}/{ctx.case.name}").randint(2, STEPS - 4)
    job, held = _held_run(ctx, out, f"{point}:{rank}:{after}", extra)
    if held is None:
        if not job.done():
            return Result("hang", f"rank {rank} did not reach {point} within the deadline")
        tail = job.text().strip().splitlines()[-1:] or [""]
        return Result("unclear", f"the run ended (exit {job.proc.returncode}) before rank "
                      f"{rank} reached {point} after step {after}: {tail[0][:160]}")  # fmt: skip
    where = f"rank {rank} held at {point} after step {held['done']}, {HOWS[how]}"
    _send(job, how, held)
    code = job.wait(ctx)
    if code is None:
        return Result("hang", f"{where}: the run did not end within the case's deadline")
    ctx.settle(job)
    text = job.text()
    lost, why = bytes_lost(out / "ckpt")
    if code == 0:
        return Result("silent_wrong", f"{where}: the run completed as if not signalled", lost)
    wrong = _ended_wrong(how, code, text, rank)
    left = _left(out, offload if disk else None)
    empty = [d for d in left if d.name.startswith("step-") and not any(d.iterdir())]
    trash = [d for d in left if d.name.startswith(".trash-")]
    if point == "save_first" and not empty:
        return Result("unclear", f"{where}: no empty step folder was left ({left})", lost)
    if point == "prune" and (not trash or any(d.name.startswith("step-") for d in left)):
        return Result("unclear", f"{where}: not one trash folder and only committed step "
                      f"folders: {[d.name for d in left]}", lost)  # fmt: skip
    again, note = resumed(ctx, out, STEPS, tuple(extra))
    if again is None:
        return Result("hang", f"{where}: --resume did not end within the deadline", lost)
    said = [x for x in again.text().splitlines() if x.startswith("note:")]
    if again.proc.returncode != 0:
        tail = again.text().strip().splitlines()[-1:] or [""]
        return Result("unclear", f"{where}: --resume failed: {tail[0][:200]}{note}", lost)
    if final_sha(out) != sha:
        return Result("silent_wrong", f"{where}: resumed, but not bitwise{note}", lost)
    silent = [d.name for d in left if not os.path.lexists(d) and not any(d.name in x for x in said)]
    if wrong:
        return Result("unclear", f"{where}: {wrong}; resumed bitwise{note}", lost)
    if silent:
        return Result("unclear", f"{where}: resumed bitwise, but {silent} went without a note "
                      "line naming it", lost)  # fmt: skip
    kinds = {
        "state folder(s)": sum(d.name.startswith("zero-states-") for d in left),
        "empty step folder(s)": len(empty),
        "unfinished step folder(s)": sum(d.name.startswith("step-") for d in left) - len(empty),
        "trash folder(s)": len(trash),
    }
    shown = ", ".join(f"{n} {k}" for k, n in kinds.items() if n) or "nothing"
    named = {"kill_rank": f"rank {rank} named; ", "kill_job": "exit -9; "}.get(how, "")
    if how == "term_launcher":
        named = f"exit {code} ({text.strip().splitlines()[-1].split(': ', 1)[-1].split(':')[0]}); "
    removed = ", removed at the next start with a note" if left else ""
    return Result("survived", f"{where}: {named}the crash left {shown}{removed}; resumed bitwise"
                  f"{note}" + (f"; lost: {why}" if why else ""), lost)  # fmt: skip


# -- a too-small offload_dir ---------------------------------------------------------------------

SMALL_DIR_BYTES = 64 * 1024
"""The tmpfs offload_dir: below one rank's state files of the tiny GPT (835,584 bytes at N = 2)."""
FSIZE_STATES = 16 * 1024
"""The file size limit: below every state file of the tiny GPT (the smallest, a 2-rank shard of
a layer's master, ~50 KB), above the files written before them (run.lock, owner.json)."""

MOUNT = ('mount -t tmpfs -o size="$2" tmpfs "$1" || exit 97; : > "$3.mounted"; dir=$1 list=$3; '
         'shift 3; "$@"; rc=$?; ls -A "$dir" > "$list"; exit $rc')  # fmt: skip
"""In the job's own mount namespace: a tmpfs of $2 bytes on $1, the run ($4...), then what is
left in $1 written to $3 (the tmpfs goes with the namespace)."""


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_STATES, FSIZE_STATES))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _in_tmpfs(ctx: Ctx, offload: Path, listing: Path, argv: list[str]):
    """The run with `offload` a SMALL_DIR_BYTES tmpfs: None where no mount namespace can be
    made here (unprivileged: a user namespace too)."""
    unshare = shutil.which("unshare")
    for flags in (["-Urm"], ["-m"]) if unshare else ():
        inner = ["sh", "-c", MOUNT, "sh", str(offload), str(SMALL_DIR_BYTES), str(listing)]
        job = ctx.job([unshare, *flags, *inner, *argv], tag="tmpfs" + flags[0])
        job.wait(ctx)
        ctx.settle(job)
        if Path(f"{listing}.mounted").exists():
            return job
    return None


def small_dir_case(ctx: Ctx, *, tmpfs: bool) -> Result:
    out, offload, listing = ctx.dir / "run", ctx.dir / "offload", ctx.dir / "left.txt"
    offload.mkdir()
    argv = ctx.shared.argv(out, "--offload-optimizer", "--offload-dir", str(offload))
    job, how = None, f"a {SMALL_DIR_BYTES // 1024} KiB tmpfs"
    if tmpfs:
        job = _in_tmpfs(ctx, offload, listing, argv)
        if job is None:
            how = f"no mount namespace here: RLIMIT_FSIZE {FSIZE_STATES} B instead"
    if job is None:
        if tmpfs is False:
            how = f"RLIMIT_FSIZE {FSIZE_STATES} B"
        job = ctx.job(argv, tag="fsize", preexec=_limit_file_size)
        if job.wait(ctx) is None:
            return Result("hang", f"{how}: the run did not end")
        ctx.settle(job)
        listing.write_text("".join(f"{p.name}\n" for p in offload.iterdir()))
    if job.proc.returncode is None or not listing.exists():
        return Result("hang", f"{how}: the run did not end")
    text, code = job.text(), job.proc.returncode
    line = one_line_error(text)
    left = listing.read_text().split()
    if code == 0:
        return Result("silent_wrong", f"{how}: the run trained on a too-small offload_dir")
    trained = steps_done(out) or list((out / "ckpt").glob("step-*"))
    facts = (f"exit {code}, {'after training began' if trained else 'before training'}, "
             + (f"{left} left in the folder" if left else "the folder left empty"))  # fmt: skip
    if line is None:
        last = [x for x in text.strip().splitlines() if "offload_dir=" in x][-1:] or [""]
        return Result("unclear", f"{how}: {facts}; not one line (a traceback): "
                      f"{last[0].strip()[:150]}")  # fmt: skip
    if str(offload) not in line or not re.search(r"\d[\d,]* bytes", line):
        return Result("unclear", f"{how}: {facts}; the line does not name the folder and the "
                      f"bytes needed: {line[:200]}")  # fmt: skip
    if trained or left:
        return Result("unclear", f"{how}: {facts}: {line[:120]}")
    return Result("refused", f"{how}: {facts}; one line naming the folder and the bytes "
                  f"({line.split(': error: ', 1)[-1][:110]}...)")  # fmt: skip


def cases(release: bool) -> list[Case]:
    out = []
    stages = {"backward": 3, "update": 2, "mid_save": 3}
    for point, stage in stages.items():
        for how in HOWS:
            fast = (point, how) == ("update", "kill_rank")
            if not (release or fast):
                continue
            run = partial(held_case, point=point, how=how, stage=stage)
            right = ("error naming rank 1" if how == "kill_rank" else
                     "the launcher ends by its signal, every rank with it")  # fmt: skip
            out.append(Case(
                f"disk_{NAMES[how]}_{point}", "disk tier",
                f"--offload-dir, stage {stage}: rank 1 held {POINTS[point]}, "
                + HOWS[how].replace("the held rank", "it"),
                f"{right}; --resume bitwise; no zero-states-* folder left after it (a dead "
                "rank's removed at the next start with a note), 0 bytes lost", 240, run,
                fast=fast,
            ))  # fmt: skip
    out.append(Case("offload_dir_too_small", "disk tier",
                    f"--offload-dir a {SMALL_DIR_BYTES // 1024} KiB tmpfs (RLIMIT_FSIZE where no "
                    "mount namespace can be made)", "exit non-zero before training, one line "
                    "naming the folder and the bytes needed; nothing left in it", 120,
                    partial(small_dir_case, tmpfs=True)))  # fmt: skip
    if release:
        out.append(Case("offload_dir_file_limit", "disk tier",
                        f"--offload-dir under RLIMIT_FSIZE {FSIZE_STATES} B: EFBIG allocating a "
                        "state file", "exit non-zero before training, one line naming the "
                        "folder and the bytes needed; nothing left in it", 120,
                        partial(small_dir_case, tmpfs=False)))  # fmt: skip
        out.append(Case("sigkill_rank0_save_first_file", "checkpoints",
                        "SIGKILL to rank 0 at a save's first file (owner.json): an empty step "
                        "folder", "error naming rank 0; the next start removes the folder with "
                        "a note; --resume bitwise, 0 bytes lost", 240,
                        partial(held_case, point="save_first", how="kill_rank", rank=0,
                                disk=False)))  # fmt: skip
        out.append(Case("sigterm_launcher_mid_prune", "checkpoints",
                        "--ckpt-every 1, SIGTERM to the launcher inside a prune (an old step "
                        "folder renamed to trash, not deleted)", "no step folder without a "
                        "manifest; the next start removes the trash with a note; --resume "
                        "bitwise, 0 bytes lost", 240,
                        partial(held_case, point="prune", how="term_launcher", rank=0,
                                disk=False)))  # fmt: skip
    return out
