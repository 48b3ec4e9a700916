"""What an engine sends: one record per collective (CommRecord) and the counter that keeps them
(CommCounter), grouped by step, with exact totals for the whole run. Torch-free: the collectives
(zero/collectives.py) and the model-parallel ones (zero/mp/tp_comm.py) record here, and reports,
tests and verify read it (verify/expect.py's traffic checks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(kw_only=True)
class CommRecord:
    """One collective as this rank saw it."""

    op: str
    phase: str  # what the traffic is for: grad, grad_gather, param_update, param_fwd, ...
    kind: str  # "model" or "control"
    unit: int | None
    elements: int  # elements this rank sent (padding included)
    padding: int  # of which padding
    nbytes: int
    step: int
    start: float  # time.perf_counter() at launch
    end: float | None = None  # at completion (wait)
    seq: int | None = None  # its number among the engine's collectives (zero/ranks/watchdog.py)


KEEP_STEPS = 8
"""Steps whose records a CommCounter keeps by default ([Note: bounded traffic records])."""


class CommCounter:
    """All traffic of one engine; `step` is set by the engine so records group by step.

    [Note: bounded traffic records] A step adds a few dozen records per rank, so a long run
    would grow without bound (5-6 KB per step). The counter keeps the records of the last
    `keep_steps` steps (the current one included) and, for the whole run, exact totals per
    (kind, op, phase) in `totals`: [calls, elements, padding, nbytes]. Setting `step` drops the
    records that fall out of the window; asking for a dropped step raises instead of answering
    with an empty list. keep_steps=None keeps everything (a short run that reads every step).
    """

    def __init__(self, *, step: int = 0, keep_steps: int | None = KEEP_STEPS):
        if keep_steps is not None and (
            isinstance(keep_steps, bool) or not isinstance(keep_steps, int) or keep_steps < 1
        ):
            raise ValueError(f"keep_steps={keep_steps!r}: must be None or an integer >= 1")
        self.records: list[CommRecord] = []
        self.totals: dict[tuple[str, str, str], list[int]] = {}
        self.keep_steps = keep_steps
        self.dropped_below: int | None = None  # records of steps below this one are gone
        self._step = step
        self.watch = None  # the engine's zero.ranks.watchdog.Watch: fingerprints every record

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        if self.keep_steps is not None:
            floor = value - self.keep_steps + 1
            if self.records and self.records[0].step < floor:
                self.records = [r for r in self.records if r.step >= floor]
                self.dropped_below = max(self.dropped_below or floor, floor)

    def add(self, **kw) -> CommRecord:
        rec = CommRecord(step=self.step, start=time.perf_counter(), **kw)
        if self.watch is not None:
            self.watch.on_launch(rec)
        self.records.append(rec)
        row = self.totals.setdefault((rec.kind, rec.op, rec.phase), [0, 0, 0, 0])
        row[0] += 1
        row[1] += rec.elements
        row[2] += rec.padding
        row[3] += rec.nbytes
        return rec

    def of_step(self, step: int | None = None, kind: str = "model") -> list[CommRecord]:
        s = self.step if step is None else step
        if self.dropped_below is not None and s < self.dropped_below:
            raise ValueError(
                f"step={s}: its traffic records were dropped (the counter keeps the last "
                f"keep_steps={self.keep_steps} steps, from step {self.dropped_below}; totals "
                "keeps the whole run's sums)"
            )
        return [r for r in self.records if r.step == s and r.kind == kind]

    def total(self, kind: str = "model", *, phase: str | None = None) -> dict[str, int]:
        """The whole run's sums of one kind (optionally one phase), exact whatever was dropped:
        {"calls", "elements", "padding", "nbytes"}."""
        out = dict.fromkeys(("calls", "elements", "padding", "nbytes"), 0)
        for (k, _op, ph), row in self.totals.items():
            if k == kind and phase in (None, ph):
                for key, v in zip(out, row, strict=True):
                    out[key] += v
        return out

    def volume(self, step: int | None = None, kind: str = "model") -> tuple[int, int]:
        """(elements sent, of which padding) by this rank in one step."""
        recs = self.of_step(step, kind)
        return sum(r.elements for r in recs), sum(r.padding for r in recs)

    def counts(self, step: int | None = None, kind: str = "model") -> dict[str, int]:
        """Number of calls per op in one step."""
        out: dict[str, int] = {}
        for r in self.of_step(step, kind):
            out[r.op] = out.get(r.op, 0) + 1
        return out


def count_transfer(counter: CommCounter, t, *, phase: str, op: str, unit: int) -> None:
    """Count one host<->device copy of tensor t (kind 'offload'; op 'd2h' or 'h2d'): ZeRO-R's
    P_a+cpu copies (zero/zero_r/activations.py) and their model-parallel twin (zero/mp/)."""
    counter.add(
        op=op,
        phase=phase,
        kind="offload",
        unit=unit,
        elements=t.numel(),
        padding=0,
        nbytes=t.numel() * t.element_size(),
    )
