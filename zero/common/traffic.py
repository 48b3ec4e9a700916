"""What an engine sends: one record per collective (CommRecord) and the counter that keeps them
(CommCounter), grouped by step, with exact totals for the whole run, and the bytes of each
record that stay inside a node or cross between nodes ([Note: traffic per link]). Torch-free:
the collectives (zero/collectives.py) and the model-parallel ones (zero/mp/tp_comm.py) record
here, and reports, tests and verify read it (verify/checks/expect.py's traffic checks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLayout:
    """Which node every rank of a world is on: node-major, rank r on node r // ranks_per_node
    (torchrun numbers a node's ranks consecutively; zero/ranks/nodes.py finds the layout)."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        for name in ("world_size", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if self.world_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node!r}: must divide the world size "
                f"{self.world_size} (every node holds the same number of ranks)"
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node


# [Note: traffic per link] Every record also splits the bytes THIS rank sends into those that stay
# inside its node (intra_bytes) and those that cross to another node (inter_bytes), under the
# algorithm each collective is taken to use. Ranks are node-major (NodeLayout) and a group's
# members are taken in group order; member i's neighbour is member i+1 (mod N).
# - all_gather, reduce_scatter: a ring. Each of the N-1 steps sends one chunk (L elements) from
#   member i to member i+1, so all of member i's (N-1)·L go over one link, inter-node when the two
#   are on different nodes. Over the world with k > 1 nodes of R ranks, the last rank of each
#   node sends everything inter-node and the others nothing: k·(N-1)·L elements cross nodes per
#   collective, all ranks together (2 x 2: ranks 1 and 3; 2 x 4: ranks 3 and 7).
# - all_reduce: a reduce-scatter then an all-gather on the same ring: 2(N-1) chunks, all to
#   member i+1.
# - broadcast: a chain from member 0 (the root) in ring order: member i < N-1 sends the payload
#   once, to member i+1; the last member sends nothing (its record's nbytes, the payload it
#   receives, stays what it was: intra + inter is 0 there).
# - all_to_all: direct: member i sends its j-th chunk, nbytes/(N-1), to member j for every j != i;
#   those to members on other nodes are inter-node.
# The split models the collective by its name, not by the transport that carries it on gloo:
# deterministic mode's reduce-scatter is an all-to-all and a local tree, and gloo's all-gather is
# point-to-point sends to every rank ([Note: all-gather on gloo] in zero/collectives.py). Both
# send the ring's volume per rank, the quantity docs/design.md §2.5 counts, but more of it across
# nodes (2 x 2: 8L elements in all, against the ring's 6L); the ring is the algorithm a
# multi-node backend runs for these collectives and what node-aware schemes are measured against.
# A record is split when its collective launches (zero/ranks/nodes.py's place, where the group
# is known); one never launched (N = 1) sends nothing on either link. The sums over a run are
# CommCounter.link_totals.

RING_OPS = ("all_gather", "reduce_scatter", "all_reduce")
LINK_OPS = (*RING_OPS, "broadcast", "all_to_all")


def link_bytes(op: str, nbytes: int, nodes: Sequence[int], me: int) -> tuple[int, int]:
    """(intra, inter): the bytes member `me` of a group sends over each link class for one
    collective of `nbytes` counted bytes ([Note: traffic per link]). nodes: the node of every
    member, in group order."""
    n = len(nodes)
    if op not in LINK_OPS:
        raise ValueError(f"op={op!r}: no link model; allowed are {LINK_OPS}")
    if not 0 <= me < n:
        raise ValueError(f"me={me!r}: must be a member index in [0, {n})")
    nxt = (me + 1) % n
    if n == 1 or (op == "broadcast" and me == n - 1):
        return 0, 0
    if op == "all_to_all":
        chunk, away = nbytes // (n - 1), sum(1 for j in range(n) if nodes[j] != nodes[me])
        return chunk * (n - 1 - away), chunk * away
    return (0, nbytes) if nodes[nxt] != nodes[me] else (nbytes, 0)


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
    layout: NodeLayout | None = None  # the world's nodes (None: one node) [Note: traffic per link]
    intra_bytes: int = 0  # of what this rank sends, the bytes that stay inside its node
    inter_bytes: int = 0  # and those that cross to another node

    def place(self, members_nodes: Sequence[int], me: int) -> None:
        """Split this record's bytes over the links for a group whose members sit on
        members_nodes (group order), this rank being member `me` ([Note: traffic per link])."""
        self.intra_bytes, self.inter_bytes = link_bytes(self.op, self.nbytes, members_nodes, me)


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
    The bytes per link ([Note: traffic per link]) are summed the same way: `link_totals` has, per
    (kind, op, phase), [intra_bytes, inter_bytes] for the whole run; total_links and
    link_volume read them as total and volume read the rest.
    `layout` is the world's NodeLayout (None: one node), set by the engine at construction.
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
        self.layout: NodeLayout | None = None
        self._links_dropped: dict[tuple[str, str, str], list[int]] = {}
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
                self._fold_links(r for r in self.records if r.step < floor)
                self.records = [r for r in self.records if r.step >= floor]
                self.dropped_below = max(self.dropped_below or floor, floor)

    def add(self, **kw) -> CommRecord:
        rec = CommRecord(step=self.step, start=time.perf_counter(), layout=self.layout, **kw)
        if self.watch is not None:
            self.watch.on_launch(rec)
        self.records.append(rec)
        row = self.totals.setdefault((rec.kind, rec.op, rec.phase), [0, 0, 0, 0])
        row[0] += 1
        row[1] += rec.elements
        row[2] += rec.padding
        row[3] += rec.nbytes
        return rec

    def _fold_links(self, records) -> None:
        """Add dropped records' link bytes to the run's sums (split at launch, so final)."""
        for r in records:
            row = self._links_dropped.setdefault((r.kind, r.op, r.phase), [0, 0])
            row[0] += r.intra_bytes
            row[1] += r.inter_bytes

    @property
    def link_totals(self) -> dict[tuple[str, str, str], list[int]]:
        """The whole run's [intra_bytes, inter_bytes] per (kind, op, phase), exact whatever was
        dropped (a record's split is set when it launches, after it is added)."""
        out = {key: list(row) for key, row in self._links_dropped.items()}
        for r in self.records:
            row = out.setdefault((r.kind, r.op, r.phase), [0, 0])
            row[0] += r.intra_bytes
            row[1] += r.inter_bytes
        return out

    def total_links(self, kind: str = "model", *, phase: str | None = None) -> dict[str, int]:
        """The whole run's bytes per link of one kind (optionally one phase), exact whatever was
        dropped, as total() is: {"intra", "inter"}."""
        out = {"intra": 0, "inter": 0}
        for (k, _op, ph), (intra, inter) in self.link_totals.items():
            if k == kind and phase in (None, ph):
                out["intra"] += intra
                out["inter"] += inter
        return out

    def link_volume(self, step: int | None = None, kind: str = "model") -> tuple[int, int]:
        """(bytes within this rank's node, bytes across nodes) sent by this rank in one step."""
        recs = self.of_step(step, kind)
        return sum(r.intra_bytes for r in recs), sum(r.inter_bytes for r in recs)

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
