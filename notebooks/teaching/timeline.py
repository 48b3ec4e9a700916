"""Timelines of one traced step on real ranks (a Job with trace=True): each rank's compute
intervals (unit forward and backward, the optimizer step) and its collectives, the overlap
between them, and the synchronisation points read off them (notebook 04, claims 1 and 3).

Times are seconds from the start of the traced step; a collective's interval runs from its
launch to its completion (when the engine waited for it).

Legend: see the package docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .common import axes_or_new
from .gloo import RankRun


@dataclass(frozen=True, kw_only=True)
class Interval:
    """One bar of a timeline, in seconds from the start of the traced micro-steps."""

    lane: str  # "compute" or "communication"
    label: str
    start: float
    end: float
    kind: str  # forward, backward, step, or the collective's phase


def timeline(run: RankRun) -> list[Interval]:
    """A rank's compute intervals (unit forward/backward, the optimizer step) and its
    collectives (launch to completion, model and control), sorted by start time.

    A collective's end is when the engine completed it (waited for it): with overlap on, the
    transfer itself may have finished earlier, never later."""
    out = [
        Interval(lane="compute", label=e["name"], start=e["start"], end=e["end"], kind=e["phase"])
        for e in run.events
    ]
    for r in run.records:
        if r["end"] is None:
            continue
        label = r["op"] + ("" if r["unit_name"] is None else f" {r['unit_name']}")
        out.append(
            Interval(
                lane="communication",
                label=label,
                start=r["start"],
                end=r["end"],
                kind=r["phase"] if r["kind"] == "model" else "control",
            )
        )
    return sorted(out, key=lambda i: (i.start, i.end))


def overlap_seconds(intervals: Sequence[Interval], *, comm_phase: str, compute_kind: str) -> float:
    """Seconds during which some collective of `comm_phase` was in flight while some compute
    interval of `compute_kind` ran (union of intersections, so nothing is counted twice)."""
    comm = [
        (i.start, i.end) for i in intervals if i.lane == "communication" and i.kind == comm_phase
    ]
    comp = [(i.start, i.end) for i in intervals if i.lane == "compute" and i.kind == compute_kind]
    pieces = sorted(
        (max(a, c), min(b, d)) for a, b in comm for c, d in comp if min(b, d) > max(a, c)
    )
    total, cur_a, cur_b = 0.0, None, None
    for a, b in pieces:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


TIMELINE_COLORS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "step": "tab:green",
    "grad": "tab:red",
    "grad_gather": "tab:pink",
    "param_update": "tab:purple",
    "param_fwd": "tab:cyan",
    "param_bwd": "tab:olive",
    "control": "tab:gray",
}


def _rows(items: Sequence[Interval]) -> list[int]:
    """Greedy sub-rows so that intervals that overlap in time (collectives in flight together)
    are drawn one above the other, never on top of each other."""
    ends: list[float] = []
    rows = []
    for iv in items:
        row = next((k for k, e in enumerate(ends) if e <= iv.start), len(ends))
        if row == len(ends):
            ends.append(iv.end)
        else:
            ends[row] = iv.end
        rows.append(row)
    return rows


def draw_timeline(runs: Sequence[RankRun], *, title: str, ax=None):
    """One compute lane and one communication lane per rank; milliseconds on the x axis."""
    from matplotlib.patches import Patch

    ax = axes_or_new(ax, (11, 1.0 + 1.1 * len(runs)))
    ticks, labels, seen = [], [], set()
    for i, run in enumerate(runs):
        for j, lane in enumerate(("compute", "communication")):
            y = -(2.4 * i + j)
            ticks.append(y)
            labels.append(f"rank {run.rank} · {lane}")
            items = [iv for iv in timeline(run) if iv.lane == lane]
            rows = _rows(items)
            h = 0.8 / max(1, max(rows, default=0) + 1)
            for iv, row in zip(items, rows):
                ax.barh(
                    y + 0.4 - h * (row + 0.5),
                    1e3 * (iv.end - iv.start),
                    left=1e3 * iv.start,
                    height=h,
                    color=TIMELINE_COLORS.get(iv.kind, "black"),
                    edgecolor="black",
                    linewidth=0.3,
                )
                seen.add(iv.kind)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("time since the first forward of the traced step (ms)")
    ax.set_title(title)
    ax.legend(
        handles=[Patch(color=TIMELINE_COLORS[k], label=k) for k in TIMELINE_COLORS if k in seen],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    return ax


@dataclass(frozen=True, kw_only=True)
class SyncPoints:
    """When, in a traced step of one rank, the gradient became whole and the step ended."""

    last_grad_end: float  # the last gradient reduction completed
    first_control_start: float  # the step's control exchange (every rank takes part) began
    step_end: float  # engine.step() returned
    last_comm_end: float  # every collective of the step completed
    overlapped: float  # seconds of backward compute with a gradient reduction in flight
    backward: float  # seconds of backward compute


def sync_points(run: RankRun) -> SyncPoints:
    """Read the synchronisation structure of a traced step off its timeline."""
    iv = timeline(run)
    grads = [i for i in iv if i.lane == "communication" and i.kind == "grad"]
    control = [i for i in iv if i.lane == "communication" and i.kind == "control"]
    steps = [i for i in iv if i.kind == "step"]
    if not grads or not control or not steps:
        raise ValueError("run: not a traced run with gradient reductions (Job(trace=True))")
    comm = [i for i in iv if i.lane == "communication"]
    return SyncPoints(
        last_grad_end=max(i.end for i in grads),
        first_control_start=min(i.start for i in control),
        step_end=max(i.end for i in steps),
        last_comm_end=max(i.end for i in comm),
        overlapped=overlap_seconds(iv, comm_phase="grad", compute_kind="backward"),
        backward=sum(i.end - i.start for i in iv if i.kind == "backward"),
    )


def forward_calls(run: RankRun) -> dict[str, int]:
    """How many times each (non-root) unit ran forward on this rank in the traced step."""
    out: dict[str, int] = {}
    for e in run.events:
        if e["phase"] == "forward":
            out[e["name"]] = out.get(e["name"], 0) + 1
    return out


def gathers_per_unit(run: RankRun) -> dict[str, dict[str, int]]:
    """Stage 3: per unit, how many parameter all-gathers this rank issued in the last step, for
    forward (param_fwd) and for backward (param_bwd)."""
    out = {name: {"param_fwd": 0, "param_bwd": 0} for name in run.unit_names}
    for r in run.records:
        if r["phase"] in ("param_fwd", "param_bwd"):
            out[r["unit_name"]][r["phase"]] += 1
    return out
