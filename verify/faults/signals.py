"""Signals to a rank and to the launcher at seeded random points, mid-save included.

A case starts the 6-step training run (verify/faults/runs.py), waits until rank 0's history
file shows a step drawn from the case's seed (and, for a mid-save case, until a step
directory exists without its manifest: a save under way), and sends the signal. Then:
- a rank SIGKILLed, SIGTERMed or SIGINTed: the run must fail, naming that rank;
- a rank SIGSTOPped: the run must fail within its --timeout, the watchdog blaming that rank;
- the launcher SIGTERMed, SIGINTed or SIGKILLed: every rank must end with it (no orphans);
- the launcher SIGSTOPped for a few seconds, then continued: the run must finish;
and in every case the committed checkpoints must still verify (0 bytes lost), and `--resume` in
place (after removing a stale lock, as its error says to) must end in exactly the bits of the
undisturbed run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from functools import partial
from pathlib import Path

from zero.ranks.watchdog import blamed

from .core import Case, Ctx, Result, children, marked_pids
from .runs import LONG_STEPS, STEPS, bytes_lost, final_sha, resume

RUN_TIMEOUT_S = 60
"""--timeout of the signalled runs: a stopped rank must be named within it (the watchdog). For
local ranks it is also the whole run's limit (zero/workloads/train.py), which a 12-step run with a
checkpoint at every step keeps well under on a loaded 2-core machine (10-20 s)."""


def steps_done(out: Path) -> int:
    """Train steps rank 0 has logged so far (OUT/ckpt/history.jsonl)."""
    try:
        return (out / "ckpt" / "history.jsonl").read_bytes().count(b'"split": "train"')
    except OSError:
        return 0


def saving(out: Path) -> bool:
    """A save is under way: a step directory exists without its manifest."""
    root = out / "ckpt"
    try:
        return any(d.is_dir() and not (d / "manifest.json").exists() for d in root.glob("step-*"))
    except OSError:
        return False


def rank_pids(job, torchrun: bool) -> dict[int, int]:
    """rank -> pid of the run's ranks: the launcher's forked children in start order, or under
    torchrun the job's processes whose environment holds RANK."""
    if not torchrun:
        return dict(enumerate(children(job.pid)))
    out = {}
    for pid in marked_pids(job.mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = pid
    return out


def first_failure(text: str) -> int | None:
    """The rank a launcher reports as failing first: zero.ranks.launch's 'rank R failed', or
    torchrun's 'Root Cause (first observed failure)' block."""
    m = re.search(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", text, re.S)
    if m:
        return int(m.group(1))
    m = re.search(r"^(?:\S+: )?rank (\d+) failed", text, re.M)
    return int(m.group(1)) if m else None


def names_rank(text: str, rank: int, *, stalled: bool) -> bool:
    """The error names `rank` (and no other) as the culprit. A stalled rank gives no sign of
    its own, so only the watchdog can name it; a dead rank is named by the launcher too."""
    who = blamed(text)
    if stalled or who:
        return who == {rank}
    return first_failure(text) == rank


def signal_case(ctx: Ctx, *, target, sig: int, mid_save=False, torchrun=False, seed=0) -> Result:
    steps = LONG_STEPS if target == "launcher" else STEPS
    sha, _ = ctx.shared.baseline(ctx, steps)
    out = ctx.dir / "run"
    argv = ctx.shared.argv(out, "--timeout", str(RUN_TIMEOUT_S), torchrun=torchrun, steps=steps)
    job = ctx.job(argv, tag="run")
    rng = random.Random(f"{ctx.shared.seed}/{ctx.case.name}/{seed}")
    # after the step-1 checkpoint; a launcher goes while its ranks have most of the run left
    at = rng.randint(2, steps // 4 if target == "launcher" else steps - 4)
    while steps_done(out) < at and not job.done() and ctx.left() > 0:
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 0.2))
    caught = False
    if mid_save:
        until = time.monotonic() + 10
        while not (caught := saving(out)) and not job.done() and time.monotonic() < until:
            time.sleep(0.002)
    if job.done():
        return Result("unclear", f"the run ended before the fault (exit {job.proc.returncode})")
    pids = rank_pids(job, torchrun)
    pid = job.pid if target == "launcher" else pids.get(target)
    if pid is None:
        return Result("unclear", f"rank {target} not found among {pids}")
    where = f"after step {steps_done(out)}" + (" mid-save" if caught else "")
    os.kill(pid, sig)
    if sig == signal.SIGSTOP and target == "launcher":
        time.sleep(3)
        os.kill(pid, signal.SIGCONT)
    code = job.wait(ctx)
    text = job.text()
    if code is None:
        return Result("hang", f"{where}: the run did not end within the case's deadline")
    at_end = steps_done(out)
    if ctx.settle(job) == 0 and steps_done(out) > at_end:
        ctx.orphans += 1  # ranks that went on and finished within the grace: orphans too
        where += f"; the ranks trained on after the launcher ended (to step {steps_done(out)})"
    lost, why = bytes_lost(out / "ckpt")
    if code == 0:
        same = final_sha(out) == sha
        # the signal came after the target's work was done (or was a stop and continue)
        return Result("survived" if same else "silent_wrong", f"{where}: completed", lost)
    named = ""
    if target != "launcher" and not names_rank(text, target, stalled=sig == signal.SIGSTOP):
        named = (
            f"the error does not name rank {target} (blamed {sorted(blamed(text))}, first "
            f"failure {first_failure(text)})"
        )
    again, note = resumed(ctx, out, steps)
    if again is None:
        return Result("hang", f"{where}: --resume did not end within the deadline", lost)
    if again.proc.returncode != 0:
        tail = again.text().strip().splitlines()[-1:] or [""]
        return Result("unclear", f"{where}: --resume failed: {tail[0]}{note} {why}", lost)
    if final_sha(out) != sha:
        return Result("silent_wrong", f"{where}: resumed, but not bitwise{note}", lost)
    if named:
        return Result("unclear", f"{where}: {named}; resumed bitwise{note}", lost)
    return Result("survived", f"{where}: {'named; ' if target != 'launcher' else ''}resumed "
                  f"bitwise{note}" + (f"; lost: {why}" if why else ""), lost)  # fmt: skip


def resumed(ctx: Ctx, out: Path, steps: int):
    """--resume-if-present in place; a stale lock is removed as its error says, once."""
    note = ""
    for _ in range(2):
        job = resume(
            ctx, ctx.shared, out, "--resume-if-present", tag=f"resume{len(ctx.jobs)}", steps=steps
        )
        if job.wait(ctx) is None:
            return None, note
        ctx.settle(job)
        text = job.text()
        if job.proc.returncode == 2 and "stale lock" in text and not note:
            holder = json.loads((out / "run.lock").read_text())
            note = f" (stale lock of pid {holder.get('pid')} named and removed)"
            (out / "run.lock").unlink()
            continue
        break
    return job, note


SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT,
           "stop": signal.SIGSTOP}  # fmt: skip


def cases(release: bool) -> list[Case]:
    out = []

    def add(name, target, sig, *, mid_save=False, torchrun=False, seed=0, fast=False):
        who = "the launcher" if target == "launcher" else f"rank {target}"
        how = f"{'torchrun: ' if torchrun else ''}SIG{sig.upper()} to {who}"
        how += " mid-save" if mid_save else " at a random step"
        if sig == "stop":
            right = (
                "launcher continued after 3 s: the run finishes bitwise"
                if target == "launcher"
                else f"error within --timeout {RUN_TIMEOUT_S} s, watchdog blames rank {target}"
            )
        elif target == "launcher":
            right = "every rank ends with it, temp dirs removed; --resume bitwise"
        else:
            right = f"error naming rank {target}; --resume bitwise"
        run = partial(signal_case, target=target, sig=SIGNALS[sig], mid_save=mid_save,
                      torchrun=torchrun, seed=seed)  # fmt: skip
        out.append(Case(name, "signals", how, right + ", 0 bytes lost", 240, run, fast=fast))

    add("sigkill_rank1", 1, "kill")
    add("sigkill_rank0_mid_save", 0, "kill", mid_save=True)
    add("sigterm_rank1", 1, "term")
    add("sigint_rank0", 0, "int", fast=True)
    add("sigstop_rank1", 1, "stop")
    add("sigterm_launcher", "launcher", "term")
    add("sigint_launcher_mid_save", "launcher", "int", mid_save=True)
    add("sigkill_launcher", "launcher", "kill")
    add("sigstop_launcher", "launcher", "stop")
    if release:
        add("sigkill_rank1_mid_save", 1, "kill", mid_save=True, seed=1)
        add("sigterm_launcher_mid_save", "launcher", "term", mid_save=True, seed=1)
        add("sigkill_launcher_mid_save", "launcher", "kill", mid_save=True, seed=1)
        add("sigstop_rank0", 0, "stop", seed=1)
        add("torchrun_sigkill_rank1", 1, "kill", torchrun=True)
        add("torchrun_sigstop_rank1", 1, "stop", torchrun=True)
        add("torchrun_sigterm_launcher", "launcher", "term", torchrun=True)
    return out
