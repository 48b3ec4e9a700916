"""The fault-injection suite: faults a hostile user or an unlucky cluster would bring, injected
into real runs, with the right outcome of each checked (docs/verification.md, "Fault injection").

    python -m verify.faults [--fast | --release] [--only NAME ...] [--json PATH]

Families: signals to ranks and to the launcher (signals.py), divergent and stalled ranks
(diverge.py, driven by driver.py; a slow rank that must not be named), signals landed at chosen
points of a step (points.py, through the hooks of hooks.py: the disk tier's update, a save's first
file, a prune) and a too-small offload_dir, damaged, hostile and edited checkpoints, a full disk
and two jobs on one output directory (storage.py), stale launcher variables, the bad inputs of
verify/refusals/bad_inputs.py and a long run for leaks (inputs.py). core.py runs each case's
processes
in their own session, marked, under a deadline, cleans up whatever they leave and counts what a
crash left that the next run did not remove; runs.py holds the undisturbed training run every
bitwise verdict is compared with.
"""

from __future__ import annotations


def all_cases(*, release: bool = True) -> list:
    """Every case, in running order (the fast subset is those with `fast=True`)."""
    from . import diverge, inputs, points, signals, storage

    return [
        *signals.cases(release),
        *diverge.cases(release),
        *points.cases(release),
        *storage.cases(release),
        *inputs.cases(release),
    ]
