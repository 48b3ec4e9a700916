"""Signals to a rank and to the launcher at seeded random points, mid-save included.

A case starts the 6-step training run (verify/faults/runs.py), waits until rank 0's history
file shows a step drawn from the case's seed (and, for a mid-save case, until a step
directory exists without its manifest: a save under way), and sends the signal. Then:
- a rank SIGKILLed, SIGTERMed or SIGINTed: the run must fail, naming that rank;
- a rank SIGSTOPped: the run must fail within STOP_BOUND_S of the signal, whatever its --timeout
  (the default 600 s included), the watchdog blaming that rank as stopped;
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

from zero.ranks.watchdog import BLAME, SLICE_S, STOPPED_S, blamed

from .core import Case, Ctx, Result, children, marked_pids, one_line_error
from .runs import LONG_STEPS, STEPS, bytes_lost, final_sha

RUN_TIMEOUT_S = 60
"""--timeout of the signalled runs (but those at the default timeout): a collective's limit, far
above what a stopped rank may take to be named (STOP_BOUND_S), and above any wait of a 12-step run
with a checkpoint at every step on a loaded 2-core machine (its whole run takes 10-20 s)."""

STOP_SLACK_S = 6.0
"""What a loaded 2-core machine adds to the watchdog's own bound: the stopped rank's peers must
first reach the collective that waits for it (within one step and its checkpoint: 0.1-1 s here,
2-3 s when the other tiers of `make test` run beside the suite), and after the blame the
launcher ends the ranks and prints its line (under 1 s; torchrun's worker exits likewise)."""
STOP_BOUND_S = STOPPED_S + SLICE_S + STOP_SLACK_S
"""Seconds from a SIGSTOP to a rank to the error naming it, at any --timeout: the watchdog names
a stopped peer within STOPPED_S + SLICE_S of its peers' arrival at the collective that waits for
it ([Note: a stopped rank named in seconds] in zero/ranks/watchdog.py), plus STOP_SLACK_S."""


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


def blame_seen(job, ctx: Ctx, signalled: float) -> float | None:
    """Seconds from `signalled` until the job's output first holds a blame line (polled every
    20 ms, while the job runs), None if it ended without one."""
    while ctx.left() > 0:
        if BLAME in job.text():
            return time.monotonic() - signalled
        if job.done():
            return time.monotonic() - signalled if BLAME in job.text() else None
        time.sleep(0.02)
    return None


def stop_named(text: str, rank: int, seconds: float | None, *, torchrun: bool) -> str:
    """'' if the error names `rank` as stopped within STOP_BOUND_S (one line, from zero.ranks'
    own launcher; torchrun prints each rank's output), else what is wrong."""
    lines = [x for x in text.splitlines() if BLAME in x]
    if seconds is None or not lines:
        return "no blame line"
    if blamed(text) != {rank} or not any("stopped" in x for x in lines):
        return f"the blame line does not name rank {rank} as stopped: {lines[0].strip()[:160]}"
    if not torchrun and (one_line_error(text) is None or BLAME not in one_line_error(text)):
        return "the blame is not one error line"
    if seconds > STOP_BOUND_S:
        return f"named {seconds:.1f} s after the signal, past the bound of {STOP_BOUND_S:.2f} s"
    return ""


def signal_case(
    ctx: Ctx, *, target, sig: int, mid_save=False, torchrun=False, seed=0, timeout=RUN_TIMEOUT_S
) -> Result:
    """`timeout`: the run's --timeout, None for the default (600 s)."""
    steps = LONG_STEPS if target == "launcher" else STEPS
    sha, _ = ctx.shared.baseline(ctx, steps)
    out = ctx.dir / "run"
    limit = () if timeout is None else ("--timeout", str(timeout))
    argv = ctx.shared.argv(out, *limit, torchrun=torchrun, steps=steps)
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
    signalled = time.monotonic()
    if sig == signal.SIGSTOP and target == "launcher":
        time.sleep(3)
        os.kill(pid, signal.SIGCONT)
    stopped = sig == signal.SIGSTOP and target != "launcher"
    seen = blame_seen(job, ctx, signalled) if stopped else None
    code = job.wait(ctx)
    text = job.text()
    if code is None:
        return Result("hang", f"{where}: the run did not end within the case's deadline")
    if stopped:
        where += f"; blamed {seen:.1f} s after the signal" if seen is not None else ""
    at_end = steps_done(out)
    if ctx.settle(job) == 0 and steps_done(out) > at_end:
        ctx.orphans += 1  # ranks that went on and finished within the grace: orphans too
        where += f"; the ranks trained on after the launcher ended (to step {steps_done(out)})"
    lost, why = bytes_lost(out / "ckpt")
    if code == 0:
        same = final_sha(out) == sha
        # the signal came after the target's work was done (or was a stop and continue)
        return Result("survived" if same else "silent_wrong", f"{where}: completed", lost)
    named, late = "", ""
    if target != "launcher" and not names_rank(text, target, stalled=stopped):
        named = (
            f"the error does not name rank {target} (blamed {sorted(blamed(text))}, first "
            f"failure {first_failure(text)})"
        )
    elif stopped:
        why = stop_named(text, target, seen, torchrun=torchrun)
        late, named = (why, "") if why.startswith("named ") else ("", why)
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
    if late:  # the error came, but past the watchdog's bound: the wait it must cut short
        return Result("hang", f"{where}: {late}; resumed bitwise{note}", lost)
    return Result("survived", f"{where}: {'named; ' if target != 'launcher' else ''}resumed "
                  f"bitwise{note}" + (f"; lost: {why}" if why else ""), lost)  # fmt: skip


def resumed(ctx: Ctx, out: Path, steps: int, extra: tuple = ()):
    """--resume-if-present in place (with `extra` options); a stale lock is removed as its error
    says, once."""
    note = ""
    for _ in range(2):
        argv = ctx.shared.argv(out, "--resume-if-present", *extra, steps=steps)
        job = ctx.job(argv, tag=f"resume{len(ctx.jobs)}")
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

    def add(name, target, sig, *, mid_save=False, torchrun=False, seed=0, fast=False,
            timeout=RUN_TIMEOUT_S):  # fmt: skip
        who = "the launcher" if target == "launcher" else f"rank {target}"
        how = f"{'torchrun: ' if torchrun else ''}SIG{sig.upper()} to {who}"
        how += " mid-save" if mid_save else " at a random step"
        how += " (the default --timeout, 600 s)" if timeout is None else ""
        if sig == "stop":
            right = (
                "launcher continued after 3 s: the run finishes bitwise"
                if target == "launcher"
                else f"error within {STOP_BOUND_S:.2f} s of the signal (the watchdog's "
                f"STOPPED_S + SLICE_S + {STOP_SLACK_S:g} s), its blame line naming rank {target} "
                f"as stopped{'' if torchrun else ' in one line'}; --resume bitwise"
            )
        elif target == "launcher":
            right = "every rank ends with it, temp dirs removed; --resume bitwise"
        else:
            right = f"error naming rank {target}; --resume bitwise"
        run = partial(signal_case, target=target, sig=SIGNALS[sig], mid_save=mid_save,
                      torchrun=torchrun, seed=seed, timeout=timeout)  # fmt: skip
        out.append(Case(name, "signals", how, right + ", 0 bytes lost", 240, run, fast=fast))

    add("sigkill_rank1", 1, "kill")
    add("sigkill_rank0_mid_save", 0, "kill", mid_save=True)
    add("sigterm_rank1", 1, "term")
    add("sigint_rank0", 0, "int", fast=True)
    add("sigstop_rank1", 1, "stop")
    add("sigstop_rank1_default_timeout", 1, "stop", seed=2, timeout=None, fast=True)
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
        add("torchrun_sigstop_rank1", 1, "stop", torchrun=True, timeout=None)
        add("torchrun_sigterm_launcher", "launcher", "term", torchrun=True)
    return out
