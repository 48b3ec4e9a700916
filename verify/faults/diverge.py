"""Divergent ranks: one rank issues other collectives than the rest (verify/faults/driver.py).

The issue's list at stages 2 and 3: an extra backward, a skipped step, a save or a load by one
rank alone, an early exit; and ranks whose collectives differ from the start: another unit
order, another micro-batch count. The right outcome: the run ends within the driver's
--timeout (plus start-up) with an error whose blame line (zero.ranks.watchdog.blamed) names exactly
the diverging rank. A run that finishes anyway is a silent wrong result; one that outlives the
case's deadline a hang; an error that blames no rank, or another, an unclear error.

And the converse: a rank that is merely slow (it computes for longer than the watchdog's SILENT_S
before a step's collectives, its heartbeats going on) diverges from nothing and must not be named:
the run completes with the undisturbed run's bits.
"""

from __future__ import annotations

import json
import re
from functools import partial

from zero.ranks.watchdog import BLAME, SILENT_S, blamed

from .core import PY, Case, Ctx, Result
from .driver import AT_START

TIMEOUT_S = 20
"""The driver's --timeout: the watchdog must name the rank within it. It also bounds the whole
local run (zero.ranks.local.spawn), which on a loaded 2-core machine takes up to about 10 s."""

KINDS = ("extra_backward", "skipped_step", "skipped_iteration", "save_alone", "load_alone",
         "early_exit")  # fmt: skip


NPROC = {"save_alone": 3, "load_alone": 3, "skipped_iteration": 3}
"""World sizes other than 2: a save or load by one rank alone, or an iteration skipped by one
rank, is symmetric at N = 2 (one rank saves, the other does not; one rank is one step ahead of
the other), so the watchdog names both ranks there, each with its call; at N = 3 the two that
agree are the majority and the odd one is blamed alone."""


def diverge_case(ctx: Ctx, *, kind: str, stage: int, rank: int = 1, at: int = 2) -> Result:
    argv = [PY, "-m", "verify.faults.driver", "--diverge", kind, "--rank", str(rank),
            "--at-step", str(at), "--stage", str(stage), "--timeout", str(TIMEOUT_S),
            "--nproc", str(NPROC.get(kind, 2))]  # fmt: skip
    job = ctx.job(argv, tag="driver")
    code = job.wait(ctx)
    if code is None:
        return Result("hang", f"no end within {ctx.case.deadline_s:g} s")
    ctx.settle(job)
    text = job.text()
    if code == 0:
        return Result("silent_wrong", "the run finished as if no rank had diverged")
    who = blamed(text)
    if who == {rank}:
        line = next(x for x in text.splitlines() if "watchdog blames" in x)
        return Result("refused", line.strip()[:160])
    # a rank built differently is named by the engine's construction check (zero/engine.py)
    check = re.search(rf"^\w+Error: rank {rank} disagrees with rank \d+ on .*$", text, re.M)
    if not who and kind in AT_START and check:
        return Result("refused", check.group(0)[:160])
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return Result("unclear", f"blamed {sorted(who)}, not [{rank}]: {last[:160]}")


SLOW_S = SILENT_S + 3
"""How long the slow rank computes: longer than SILENT_S, after which a peer that does not beat
is named whatever its state, so that only its beating heartbeat keeps it unnamed."""
SLOW_TIMEOUT_S = 60
"""The driver's --timeout in the slow-rank case: its peers wait SLOW_S in one collective, which
must stay below it (a wait past the timeout is an error, rightly)."""


def slow_rank_case(ctx: Ctx, *, stage: int = 2, rank: int = 1, at: int = 2) -> Result:
    shas = {}
    for kind in ("none", "slow"):
        argv = [PY, "-m", "verify.faults.driver", "--diverge", kind, "--rank", str(rank),
                "--at-step", str(at), "--stage", str(stage), "--timeout", str(SLOW_TIMEOUT_S),
                "--slow-s", str(SLOW_S)]  # fmt: skip
        job = ctx.job(argv, tag=kind)
        if job.wait(ctx) is None:
            return Result("hang", f"--diverge {kind}: no end within {ctx.case.deadline_s:g} s")
        ctx.settle(job)
        text = job.text()
        if BLAME in text:
            line = next(x for x in text.splitlines() if BLAME in x)
            return Result("unclear", f"--diverge {kind}: a rank was blamed: {line.strip()[:160]}")
        found = re.search(r"^ok ([0-9a-f]{64})$", text, re.M)
        if job.proc.returncode != 0 or not found:
            last = text.strip().splitlines()[-1] if text.strip() else ""
            return Result("unclear", f"--diverge {kind}: exit {job.proc.returncode}: {last[:160]}")
        shas[kind] = found.group(1)
    slow = re.search(r"^slow (\{.*\})$", text, re.M)
    took = json.loads(slow.group(1))["seconds"] if slow else None
    if took is None or took < SILENT_S:
        return Result("unclear", f"rank {rank} was not slow past SILENT_S {SILENT_S:g} s: {took}")
    if shas["slow"] != shas["none"]:
        return Result("silent_wrong", f"rank {rank} computed {took:g} s: other bits")
    return Result("survived", f"rank {rank} computed {took:g} s (SILENT_S {SILENT_S:g} s) at "
                  f"step {at}, stage {stage}: nobody blamed, the undisturbed run's "
                  "bits")  # fmt: skip


def cases(release: bool) -> list[Case]:
    out = []
    for stage in (2, 3):
        for kind in KINDS:
            fast = stage == 2 and kind == "early_exit"  # the plainest hang
            if not (release or fast):
                continue
            run = partial(diverge_case, kind=kind, stage=stage)
            out.append(Case(f"diverge_{kind}_s{stage}", "divergence",
                            f"rank 1: {kind.replace('_', ' ')} at step 2, stage {stage}",
                            f"error within {TIMEOUT_S} s, watchdog blames rank 1",
                            TIMEOUT_S + 90, run, fast=fast))  # fmt: skip
    for kind in ("unit_order", "micro_batches"):
        if not (release or kind == "unit_order"):
            continue
        run = partial(diverge_case, kind=kind, stage=2)
        fault = f"rank 1 built with another {kind.replace('_', ' ')}, stage 2"
        right = "error naming rank 1 (blame line, or the construction check)"
        out.append(Case(f"diverge_{kind}", "divergence", fault, right, TIMEOUT_S + 90, run,
                        fast=kind == "unit_order"))  # fmt: skip
    if release:
        out.append(Case("slow_rank_not_blamed", "divergence",
                        f"rank 1 computes {SLOW_S:g} s (> SILENT_S {SILENT_S:g} s) before step 2's "
                        "collectives, stage 2", "the run completes with the undisturbed run's "
                        "bits; no rank blamed", 2 * SLOW_TIMEOUT_S + 120,
                        slow_rank_case))  # fmt: skip
    return out
