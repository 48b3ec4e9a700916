"""The collective watchdog: every collective fingerprinted, a diverging, stalled or dead rank named.

Legend: a *fingerprint* is what identifies one collective on every rank alike: (step, kind, op,
phase, unit, elements, bytes); its sequence number counts the engine's collectives; the rolling
hash folds every fingerprint so far into 64 bits. A *boundary* is an engine call that all ranks
must make together: forward (with gradients), eval (forward without), backward, step, save, load,
gather (stage 3's gathered_params) and leave (a rank done with the run).

[Note: collective fingerprints] Ranks that issue different collectives pair them wrongly: a hang,
gloo's "collective mismatch" abort on the rank that happens to receive the larger message (the
victim, not the rank that diverged), or, for equal sizes, silently wrong sums. So before each
boundary's collectives, ranks all-gather six integers (boundary, data step, micro-step, sequence
number, hash): equal sizes on every rank, so this exchange itself cannot mismatch. If the rows
differ, every rank knows it at once, from the same rows, and raises the same CollectiveError:
  - a rank whose call the step does not allow (a backward beyond the step's M/N micro-steps, a
    step() before them) is blamed;
  - otherwise the ranks outside a strict majority are, and without one, ranks that left; else all;
  - equal calls with different hashes (collectives that went out of step within a call) are
    traced to the first differing collective through each rank's last RECENT fingerprints.
Torch's TORCH_DISTRIBUTED_DEBUG=DETAIL checks a fingerprint before every collective (one extra
collective each); checking at boundaries costs one small all-gather per engine call instead
(benchmarked, docs/design.md §3), and the hash still covers every collective in between.

A rank that stops (SIGSTOP), dies, or leaves is found by heartbeats (zero/ranks/beacon.py): a failed
or timed-out collective (each waits at most the process group's timeout, the run's --timeout) asks
every peer's beacon where it is and blames the ranks not responding, gone, or not yet there.
Every error carries one line "watchdog blames rank R: why" that `blamed(text)` reads back.

[Note: a stopped rank named in seconds] A rank that stops (SIGSTOP, a debugger, a hung machine)
closes no connection, so its peers would wait in their next collective for the whole process
group timeout (10 minutes by default). So every guarded wait (`wait`) waits in slices of
SLICE_S, and after each slice reads the peers' heartbeats: a peer whose beat counter has not
advanced for STOPPED_S (two heartbeat periods, on this rank's own clock) and whose process is
stopped or gone on this host is named at once; a peer silent for SILENT_S whatever its state (on
another host, where its process cannot be seen) is named too. A rank that is merely slow (a long
compute, a long save) is never named: its heartbeat thread beats on while it works. So a
stopped rank is named within STOPPED_S + SLICE_S of the later of its stop and its peers' arrival
at the collective that waits for it (SILENT_S + SLICE_S across hosts), instead of at the timeout.
"""

from __future__ import annotations

import hashlib
import pickle
import re
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from . import beacon
from .beacon import BEAT_S, describe
from .nodes import place

BLAME = "watchdog blames"

_BLAME_RE = re.compile(r"watchdog blames ranks? ([0-9]+(?:, [0-9]+)*)")

CALLS = ("forward", "eval", "backward", "step", "save", "load", "gather", "leave", "collective")

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SLICE_S = BEAT_S / 2
"""A guarded wait reads its peers' heartbeats this often ([Note: a stopped rank named in
seconds])."""
STOPPED_S = 2 * BEAT_S
"""A peer whose beat counter has not advanced for this long, and whose process is stopped or gone
on this host, is named."""
SILENT_S = 20 * BEAT_S
"""A peer whose beat counter has not advanced for this long is named whatever its state: its
heartbeat thread, which needs only the interpreter for a moment every BEAT_S, has missed 20 beats
in a row."""

RECENT = 256
"""Fingerprints each rank keeps to find where ranks went out of step ([Note: collective
fingerprints]); older ones are only in the hash."""


class CollectiveError(RuntimeError):
    """A rank diverged, stalled or died; `.blamed` holds the ranks to blame (sorted)."""

    def __init__(self, message: str, *, blamed: tuple[int, ...]):
        super().__init__(message)
        self.blamed = tuple(sorted(blamed))


def blame_line(ranks, why: str) -> str:
    """The one line every watchdog error carries: 'watchdog blames rank R: why'."""
    ranks = sorted(ranks)
    if not ranks:
        return f"watchdog: no rank to blame: {why}"
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"{BLAME} {who}: {why}"


def blamed(text: str) -> set[int]:
    """The ranks named by every 'watchdog blames ...' line in `text` (empty when none)."""
    out: set[int] = set()
    for m in _BLAME_RE.finditer(text):
        out.update(int(x) for x in m.group(1).split(", "))
    return out


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def not_allowed(call: str, micro: int, per_step: int | None) -> str:
    """Why a rank may not make `call` after `micro` of the step's micro-steps ('' if it may;
    per_step None: not known, e.g. at a rank's leave)."""
    if per_step is None:
        return ""
    if call in ("forward", "backward") and micro >= per_step:
        return (
            f"{call}() of micro-step {micro + 1} in a step of {per_step} micro-steps per rank "
            "(micro_batches / world size): step() was due"
        )
    if call == "step" and micro != per_step:
        return f"step() after {micro} of the step's {per_step} micro-steps"
    return ""


class Watch:
    """One engine's fingerprints and boundary checks (one per ZeroEngine; see the Note)."""

    def __init__(self, group, *, per_step: int | None, mode: str, counter, device=None):
        """mode: ZeroConfig.watchdog; a fake group (a simulated rank) has no peers to check."""
        self.group, self.per_step, self.counter = group, per_step, counter
        self.device = torch.device("cpu") if device is None else torch.device(device)
        fake = dist.get_backend(group) == "fake"
        self.ranks = [dist.get_rank()] if fake else dist.get_process_group_ranks(group)
        self.checks = mode != "off" and len(self.ranks) > 1
        self.every = self.checks and mode == "collectives"
        self.seq, self.hash, self._forward_checked = 0, 0, False
        self.recent: deque = deque(maxlen=RECENT)  # the last RECENT launched records
        self.beacon = beacon.beacon() if len(self.ranks) > 1 else None
        if counter is not None:  # None: a rank's leave, outside any engine
            counter.watch = self

    def on_launch(self, rec) -> None:
        """Called by CommCounter.add for every collective, before it is launched."""
        self.seq += 1
        rec.seq = self.seq
        key = f"{rec.step}|{rec.kind}|{rec.op}|{rec.phase}|{rec.unit}|{rec.elements}|{rec.nbytes}"
        h = hashlib.blake2b(key.encode(), digest_size=8, key=self.hash.to_bytes(8, "little"))
        self.hash = int.from_bytes(h.digest(), "little") & (2**63 - 1)
        self.recent.append(rec)  # described only when read: a launch stays cheap
        if self.beacon is not None:
            self.beacon.launched = rec
        if self.every and rec.kind != "watchdog":  # 'collectives': check before launching
            self._check("collective", step=rec.step, micro=-1)

    def boundary(self, call: str, *, step: int, micro: int) -> None:
        """Check that every rank makes this call with the same collectives behind it. A
        backward right after a checked forward of its micro-step is not checked again: a rank
        that then does anything else (another forward, a step) meets the others' next check
        with another micro-step, so one check per micro-step names it as well as two."""
        if self.beacon is not None:  # the heartbeat publishes it (a write costs ~0.5 ms)
            self.beacon.call = f"{call}() at data step {step}, micro-step {micro}"
        after_forward, self._forward_checked = self._forward_checked, call == "forward"
        if self.checks and not (call == "backward" and after_forward):
            self._check(call, step=step, micro=micro)

    def _check(self, call: str, *, step: int, micro: int, timeout_s: float | None = None) -> None:
        row = torch.tensor([CALLS.index(call), step, micro, self.seq, self.hash], dtype=torch.int64)
        n, rec = len(self.ranks) - 1, None
        if self.counter is not None:  # counted apart from model and control traffic
            rec = self.counter.add(
                op="all_gather",
                phase="boundary",
                kind="watchdog",
                unit=None,
                elements=n * row.numel(),
                padding=0,
                nbytes=n * row.numel() * 8,
            )
            place(rec, self.group)
        side = self.boundary_group()
        on = torch.device("cpu") if side is not self.group else self.device
        out = torch.empty(len(self.ranks), row.numel(), dtype=torch.int64, device=on)
        with guard(rec, self.group):
            work = _all_gather_flat(out.view(-1), row.to(on), group=side, async_op=True)
        wait(work, rec, self.group, timeout_s=timeout_s)
        rows = out.tolist()
        if any(r != rows[0] for r in rows):
            raise self._disagreement(rows)

    def boundary_group(self):
        """The group the checks ride: the engine's own under gloo; under NCCL a CPU (gloo) twin
        of the world, so that a check costs no device synchronisation. A subgroup under NCCL
        has no twin (creating one would need every rank of the world) and checks on the device.
        """
        if dist.get_backend(self.group) == "gloo":
            return self.group
        if not hasattr(self, "_cpu_group"):
            whole = len(self.ranks) == dist.get_world_size()
            self._cpu_group = dist.new_group(backend="gloo") if whole else self.group
        return self._cpu_group

    def _disagreement(self, rows) -> CollectiveError:
        def said(r: int) -> str:
            call, step, micro, seq, _ = rows[r]
            return (
                f"rank {self.ranks[r]}: {CALLS[call]}() at data step {step}, micro-step {micro}, "
                f"after collective #{seq}"
            )

        wrong = {
            r: why
            for r, row in enumerate(rows)
            if (why := not_allowed(CALLS[row[0]], row[2], self.per_step))
        }
        if wrong:
            blame = sorted(wrong)
            why = "; ".join(f"rank {self.ranks[r]} called {wrong[r]}" for r in blame)
        else:
            calls = [tuple(r[:3]) for r in rows]
            if len(set(calls)) > 1:
                left = [c[0] == CALLS.index("leave") for c in calls]
                blame = _odd_ones(calls, leavers=left)
                why = "the ranks made different engine calls"
                if all(left[r] for r in blame) and not all(left):
                    why = "left the run while the other ranks went on"
                why += _tie(blame, rows)
            else:
                blame, why = self._trace()
        lines = [blame_line([self.ranks[r] for r in blame], why)]
        lines += [f"  {said(r)}" for r in range(len(rows))]
        return CollectiveError("\n".join(lines), blamed=tuple(self.ranks[r] for r in blame))

    def _trace(self) -> tuple[list[int], str]:
        """Equal calls, different hashes: find the first collective that differs."""
        mine = [(r.seq, describe(r)) for r in self.recent]
        every = gather_objects(mine, self.boundary_group())  # on a CPU group: pickled on the host
        seqs = sorted(set.intersection(*(set(s for s, _ in ring) for ring in every)))
        for s in seqs:
            descs = [dict(ring)[s] for ring in every]
            if len(set(descs)) > 1:
                blame = _odd_ones(descs, leavers=[False] * len(descs))
                what = "; ".join(f"rank {self.ranks[r]} {d}" for r, d in enumerate(descs))
                return blame, f"the ranks issued different collectives: {what}{_tie(blame, descs)}"
        return list(range(len(self.ranks))), (
            f"the ranks' collectives differ before the last {RECENT} each kept"
        )


def _tie(blame, rows) -> str:
    """The note for a disagreement with no strict majority (two ranks, or a 2-2 split): the
    watchdog cannot tell which side is right, so it names every rank and says why."""
    return " (no strict majority: every rank is named)" if len(blame) == len(rows) > 1 else ""


def _odd_ones(keys, *, leavers) -> list[int]:
    """Ranks outside a strict majority; without one, the ranks that left; else every rank."""
    for k in set(keys):
        if keys.count(k) * 2 > len(keys):
            return [r for r, x in enumerate(keys) if x != k]
    left = [r for r, gone in enumerate(leavers) if gone]
    return left if 0 < len(left) < len(keys) else list(range(len(keys)))


class guard:
    """Context manager: a collective that fails or times out inside becomes a CollectiveError
    that names the ranks to blame, from their heartbeats."""

    def __init__(self, rec, group):
        self.rec, self.group = rec, group

    def __enter__(self):
        b = beacon.current()
        if b is not None and self.rec is not None:
            b.waiting = self.rec
        return self

    def __exit__(self, kind, exc, tb):
        b = beacon.current()
        if b is not None:
            b.waiting = None
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, CollectiveError):
            return False
        raise explain(exc, self.rec, self.group) from exc


def wait(work, rec, group, *, timeout_s: float | None = None) -> None:
    """work.wait() for a launched collective, inside guard(rec, group), reading the peers'
    heartbeats every SLICE_S so that a stopped peer is named in seconds ([Note: a stopped rank
    named in seconds]). timeout_s bounds the whole wait (None: the process group's timeout,
    which fails the work itself). A slice that ends is a timed wait that gave up, not a failure:
    the collective goes on (c10d's Work.wait(timeout) leaves the work running)."""
    with guard(rec, group):
        b = beacon.current()
        if b is None:
            work.wait(**({} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}))
            return
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = SLICE_S if end is None else min(SLICE_S, end - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"no reply within {timeout_s:g} s")
            try:
                work.wait(timeout=timedelta(seconds=left))
                return
            except RuntimeError as exc:
                if work.is_completed() or "timed out" not in str(exc).lower():
                    raise  # the work's own outcome: it failed
            _name_silent(b, rec, group, work)


_STRANDED: list = []
"""Collectives left in flight by a wait that named a stopped peer: they complete only when it
goes, and until then gloo's teardown of the group (destroy_process_group, or the interpreter's
exit) waits for them. So this process skips the teardown and ends at once (`stranded`)."""


def stranded() -> bool:
    """Whether a collective is left in flight, waiting for a peer named as stopped: the
    process group cannot be left or destroyed without waiting for that peer, so the process
    ends without it (zero.common.cli.run, zero.ranks.launch.leave_world)."""
    return bool(_STRANDED)


def _name_silent(b, rec, group, work=None) -> None:
    """Raise the CollectiveError that names the peers of `group` that stopped beating, if any;
    `work`, the collective waited for, is kept (_STRANDED)."""
    group = dist.group.WORLD if group is None else group
    me, views = dist.get_rank(), {}
    for p in dist.get_process_group_ranks(group):
        if p != me:
            record, quiet = b.silence(p)
            state = beacon.process_state(record) if record and quiet >= STOPPED_S else ""
            views[p] = (record, quiet, state)
    seen, why = judge_silence(views)
    if why:
        _STRANDED.append(work)
        raise explain(TimeoutError("; ".join(why)), rec, group, seen=seen)


def judge_silence(views: dict) -> tuple[dict, list[str]]:
    """views {peer: (its record or None, seconds its counter has not advanced, its process
    state here: 'stopped', 'gone' or '')} -> ({peer: (record, beating)} for explain, a reason
    per peer named): silent for STOPPED_S and stopped or gone here, or for SILENT_S whatever it
    is ([Note: a stopped rank named in seconds]). A peer that published nothing is not named
    here (it may be starting); the collective's timeout names it."""
    seen, why = {}, []
    for p, (record, quiet, state) in views.items():
        named = record is not None and (
            quiet >= SILENT_S or (quiet >= STOPPED_S and state in ("stopped", "gone"))
        )
        seen[p] = (record, not named)
        if named:
            how = f" (its process is {state})" if state else ""
            why.append(f"rank {p}'s heartbeat has not advanced for {quiet:.1f} s{how}")
    return seen, why


def gather_objects(obj, group) -> list:
    """dist.all_gather_object over `group`, its collectives waited by `wait`: every rank's
    `obj` in group rank order (pickled; on a gloo group, on the host). Other backends: torch's
    own, inside guard (their waits do not block the host, [Note: a stopped rank named in
    seconds] is gloo's)."""
    group = dist.group.WORLD if group is None else group
    n = dist.get_world_size(group)
    if dist.get_backend(group) != "gloo":
        out: list = [None] * n
        with guard(None, group):
            dist.all_gather_object(out, obj, group=group)
        return out
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.empty(n, dtype=torch.int64)
    with guard(None, group):
        work = _all_gather_flat(sizes, torch.tensor([data.numel()]), group=group, async_op=True)
    wait(work, None, group)
    width = int(sizes.max())
    mine, every = torch.zeros(width, dtype=torch.uint8), torch.empty(n * width, dtype=torch.uint8)
    mine[: data.numel()] = data
    with guard(None, group):
        work = _all_gather_flat(every, mine, group=group, async_op=True)
    wait(work, None, group)
    rows = every.view(n, width)
    return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(n)]


def broadcast_object(obj, group, src: int = 0):
    """Group rank `src`'s `obj` on every rank (dist.broadcast_object_list, its collectives waited
    by `wait` on a gloo group; torch's own, inside guard, on others)."""
    group = dist.group.WORLD if group is None else group
    root = dist.get_global_rank(group, src)
    if dist.get_backend(group) != "gloo":
        box = [obj]
        with guard(None, group):
            dist.broadcast_object_list(box, src=root, group=group)
        return box[0]
    mine = dist.get_rank() == root
    data = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    _broadcast_waited(size, root, group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else None
    buf = torch.empty(int(size), dtype=torch.uint8) if buf is None else buf
    _broadcast_waited(buf, root, group)
    return pickle.loads(buf.numpy().tobytes())


def _broadcast_waited(t: torch.Tensor, root: int, group) -> None:
    with guard(None, group):
        work = dist.broadcast(t, src=root, group=group, async_op=True)
    wait(work, None, group)


def explain(exc: BaseException, rec, group, *, seen=None) -> CollectiveError:
    """Why a collective failed, from the peers' heartbeats ([Note: reading a silent rank]).
    seen: {peer: (its record, whether it is beating)} already read by a wait that named a
    silent peer ([Note: a stopped rank named in seconds]); then a peer that beats but has not
    reached the collective yet is on its way, not to blame."""
    me = dist.get_rank()
    what = "a collective" if rec is None else f"collective {describe(rec)}"
    head = f"rank {me} failed in {what}: {first_line(exc)}"
    b = beacon.current()
    if b is None:
        return CollectiveError(blame_line([], f"{head} (no heartbeats to consult)"), blamed=())
    b.set_state("failed", head)
    mine = getattr(rec, "seq", None) or getattr(b.launched, "seq", 0)
    peers = [p for p in dist.get_process_group_ranks(group) if p != me]
    blame, lines = [], []
    early, seen = seen is not None, beacon.survey(peers) if seen is None else seen
    for p, (record, moved) in seen.items():
        if record is None:
            blame.append(p)
            lines.append(f"rank {p}: never published a heartbeat (did it start?)")
            continue
        where = _where(record)
        if record["state"] == "left":
            blame.append(p)
            lines.append(f"rank {p}: left the run ({record['note']}); {where}")
        elif not moved:
            state = beacon.process_state(record)
            how = {"stopped": " (its process is stopped)", "gone": " (its process is gone)"}
            blame.append(p)
            lines.append(f"rank {p}: not responding{how.get(state, '')}; {where}")
        elif record["state"] == "failed" or (record["waiting"] or [0])[0] >= mine:
            lines.append(f"rank {p}: also waiting or failed; {where}")
        elif early:
            lines.append(f"rank {p}: alive, not yet at collective #{mine}; {where}")
        else:
            blame.append(p)
            lines.append(f"rank {p}: alive but has not reached collective #{mine}; {where}")
    named = [x.split(": ", 1) for x in lines]
    why = "; ".join(
        text if len(blame) == 1 else f"{who}: {text}"
        for who, text in named
        if who in {f"rank {p}" for p in blame}
    )
    text = "\n".join([blame_line(blame, why or head), f"  {head}", *(f"  {x}" for x in lines)])
    return CollectiveError(text, blamed=tuple(blame))


def _where(record: dict) -> str:
    desc, waiting = record["launched"][1], record.get("waiting")
    at = f"waiting in {waiting[1]}" if waiting else f"last launched {desc or 'nothing'}"
    return f"{at}, last call {record['call'] or 'none'}"


def leave(note: str, *, timeout_s: float | None = None) -> None:
    """A rank is done with the run: say so in its beacon, and (gloo worlds) exchange one last
    boundary with every rank, so that a rank that leaves while others still train is named by
    all of them instead of pairing its teardown with their collectives. timeout_s bounds the
    wait (None: the group's timeout)."""
    beacon.leaving(note)
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    if dist.get_backend() != "gloo":  # a new CPU group at teardown would cost more than it
        with guard(None, dist.group.WORLD):  # tells: a barrier, so none leaves mid-collective
            work = dist.barrier(async_op=True)
        wait(work, None, dist.group.WORLD, timeout_s=timeout_s)
        return
    watch = Watch(dist.group.WORLD, per_step=None, mode="calls", counter=None)
    watch._check("leave", step=-1, micro=-1, timeout_s=timeout_s)
