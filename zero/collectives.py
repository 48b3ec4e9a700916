"""Stateless collectives, one per function, every resource passed in, every call counted.

Legend: N ranks in `group`; a flat unit buffer has N·L elements (L the shard length); Ψ is the
element count of everything a call moves, summed over units. Volumes are elements *sent per rank*:
    reduce-scatter    (N-1)·L    = (N-1)/N · Ψ
    all-gather        (N-1)·L    = (N-1)/N · Ψ
    all-reduce        2·(N-1)·L  = 2(N-1)/N · Ψ   (reduce-scatter + all-gather, the ring's cost)
The model states' collectives are here; control traffic (overflow flag, norm partials, losses,
rank-agreement checks) goes through zero/control.py's, ZeRO-R's pieces (C_B) and host copies through
zero/zero_r/; all count into zero/common/traffic.py's counter.

[Note: deterministic reduce-scatter] A backend's reduce-scatter sums in an order of its choosing
(a ring: rank r's shard accumulates in rotation order). Deterministic mode instead sends each
rank its slices with one all-to-all and sums the N received slices locally with the reference's
tree T in rank order (reference/tree.py). Same volume; on gloo it is even faster
(docs/machine_notes.md). reference.tree works on torch tensors unchanged, so there is one definition
of the order.

Every function returns a Pending: the collective is launched (asynchronously when async_op) and
`wait()` finishes it, including any local reduction, and stamps the record's end time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from reference.tree import tree_sum

from .common.traffic import KEEP_STEPS as KEEP_STEPS  # re-exported with the counter
from .common.traffic import CommCounter as CommCounter  # every collective records into it
from .common.traffic import CommRecord as CommRecord
from .ranks.nodes import place
from .ranks.watchdog import guard, wait

# torch 2.13 renamed the flat collectives; 2.6-2.11 only have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A launched collective; wait() completes it and returns its result."""

    def __init__(self, work, finish: Callable, record: CommRecord, keep=(), group=None):
        self._work, self._finish, self._record, self._result = work, finish, record, None
        self._keep = keep  # inputs an asynchronous collective still reads; released on wait
        self._group = group

    def wait(self) -> torch.Tensor:
        if self._record.end is None:
            if self._work is not None:
                wait(self._work, self._record, self._group)  # a failure names whom to blame
            self._result = self._finish()
            self._record.end = time.perf_counter()
            self._keep = ()
        return self._result

    def then(self, fn: Callable) -> Pending:
        """This collective, finished by fn(its result) as well: the same record and work (fn
        runs now if the collective has already been waited)."""
        if self._record.end is not None:
            self._result = fn(self._result)
            return self
        finish = self._finish
        self._finish = lambda: fn(finish())
        return self

    def __del__(self):
        if self._record.end is None and self._work is not None:
            _abandon((self._work, self._keep, self._finish))


# [Note: abandoned collectives] A collective launched and never waited (an engine dropped after an
# error in backward, or between backward and step()) must not be destroyed before it completes:
# gloo cancels a point-to-point send or receive whose work object is destroyed, and the peer's
# matching operation, with every collective queued behind it on the group, then never completes
# (the next barrier of the process hangs). A Pending dropped unwaited parks its work, with the
# tensors it reads and writes, here; parked works that have completed are let go at the next park.
_ABANDONED: list = []


def _abandon(parked: tuple) -> None:
    _ABANDONED[:] = [p for p in _ABANDONED if not p[0].is_completed()]
    _ABANDONED.append(parked)


def count_call(counter: CommCounter, op: str, elements: int, padding: int, like, **tag):
    """Count one call: `elements` this rank sends (padding included), in like's dtype."""
    nbytes = elements * like.element_size()
    return counter.add(op=op, elements=elements, padding=padding, nbytes=nbytes, **tag)


def launch(fn, *args, group, async_op, rec, **kwargs):
    """Launch fn; async_op False: also wait for it, watched (zero/ranks/watchdog.py's wait).
    Here, where the group is known, rec's bytes are split by link (zero/ranks/nodes.py)."""
    place(rec, group)
    with guard(rec, group):
        work = fn(*args, group=group, async_op=True, **kwargs)
    return work if async_op else wait(work, rec, group)


def reduce_scatter_tree(
    flat: torch.Tensor, *, group, counter: CommCounter, padding: int, tag: dict, async_op=False
) -> Pending:
    """Rank r receives T(slice r of rank 0, ..., slice r of rank N-1): all-to-all + local tree.

    Sends (N-1)·L elements per rank, (N-1)/N·Ψ ([Note: deterministic reduce-scatter]).
    flat: this rank's padded buffer (N·L). Returns a new tensor of L elements, flat's dtype.
    """
    n = dist.get_world_size(group)
    shard = flat.numel() // n
    rec = count_call(counter, "reduce_scatter", (n - 1) * shard, padding, flat, **tag)
    if n == 1:
        return Pending(None, lambda: flat.clone(), rec)
    recv = torch.empty_like(flat)
    work = launch(dist.all_to_all_single, recv, flat, group=group, async_op=async_op, rec=rec)
    finish = lambda: tree_sum(list(recv.view(n, shard).unbind(0)))  # noqa: E731
    return Pending(work, finish, rec, (flat,), group)


def reduce_scatter_fast(
    flat: torch.Tensor, *, group, counter: CommCounter, padding: int, tag: dict, async_op=False
) -> Pending:
    """The backend's reduce-scatter (SUM, its own order). Sends (N-1)/N·Ψ per rank."""
    n = dist.get_world_size(group)
    shard = flat.numel() // n
    rec = count_call(counter, "reduce_scatter", (n - 1) * shard, padding, flat, **tag)
    out = torch.empty(shard, dtype=flat.dtype, device=flat.device)
    if n == 1:
        return Pending(None, lambda: out.copy_(flat), rec)
    work = launch(_reduce_scatter_flat, out, flat, group=group, async_op=async_op, rec=rec)
    return Pending(work, lambda: out, rec, (flat,), group)


def all_reduce_sum(
    flat: torch.Tensor, *, group, counter: CommCounter, padding: int, tag: dict, async_op=False
) -> Pending:
    """In-place backend all-reduce (SUM). Sends 2(N-1)/N·Ψ per rank (ring cost)."""
    n = dist.get_world_size(group)
    shard = flat.numel() // n
    rec = count_call(counter, "all_reduce", 2 * (n - 1) * shard, padding, flat, **tag)
    if n == 1:
        return Pending(None, lambda: flat, rec)
    work = launch(dist.all_reduce, flat, group=group, async_op=async_op, rec=rec)
    return Pending(work, lambda: flat, rec, (), group)


def all_gather(
    out, shard, *, group, counter: CommCounter, padding: int, tag: dict, async_op=False
) -> Pending:
    """out (N·L) <- every rank's shard (L) in rank order. Sends (N-1)·L = (N-1)/N·Ψ per rank.
    padding: padding elements this rank sends, i.e. (N-1) times those in its own shard."""
    n = dist.get_world_size(group)
    rec = count_call(counter, "all_gather", (n - 1) * shard.numel(), padding, shard, **tag)
    if n == 1:
        return Pending(None, lambda: out.copy_(shard), rec)
    if _p2p(group, shard):  # [Note: all-gather on gloo]
        place(rec, group)  # counted as the ring it stands in for ([Note: traffic per link])
        with guard(rec, group):
            work = _exchange_shards(out, shard, group, tag.get("unit"))
        pending = Pending(work, lambda: out, rec, (shard,), group)
        if not async_op:
            pending.wait()
        return pending
    work = launch(all_gather_flat, out, shard, group=group, async_op=async_op, rec=rec)
    return Pending(work, lambda: out, rec, (shard,), group)


# [Note: all-gather on gloo] gloo's all-gather takes 1.5-2x the time of sending each shard
# straight to every other rank with point-to-point sends (3 MiB: 2.6 against 1.7 ms at N = 2,
# 5.7 against 2.9 ms at N = 4; docs/machine_notes.md). The result is a copy of every rank's
# shard, so no bit depends on how it travels, and each rank sends the same (N-1)·L elements, so
# the counted volume is the collective's. Each unit's exchange has its own tag, so two gathers
# in flight at once (stage 3's prefetch) cannot take each other's messages; every rank launches
# them in the same order ([Note: one launch order] in zero/engine.py). Other backends (NCCL)
# keep their own all-gather. GLOO_ALL_GATHER = "backend" takes gloo's own (to compare them, or
# to let a tool that sees only collectives, such as torch's CommDebugMode, count these too).

GLOO_ALL_GATHER = "p2p"


def _p2p(group, t: torch.Tensor) -> bool:
    """[Note: all-gather on gloo] for host tensors only: gloo's point-to-point path fails on
    CUDA tensors (`writev ... Bad address`, two ranks on one H200), where its all-gather works."""
    return GLOO_ALL_GATHER == "p2p" and on_host(t) and dist.get_backend(group) == "gloo"


def on_host(t: torch.Tensor) -> bool:
    """Whether t lives in host memory (tests stand a CUDA tensor in with it)."""
    return t.device.type == "cpu"


class _Works:
    """Several launched point-to-point operations, finished together.

    [Note: no timed point-to-point waits] gloo treats an expired timed wait on a send or a
    receive as fatal: it closes every pair of the group ("Application timeout caused pair
    closure"), so a peer late by one watchdog slice (SLICE_S, zero/ranks/watchdog.py) would end
    the run; and their is_completed() stays False until they are waited. So a timed wait hands
    the untimed waits to a thread of their own (started at the first timed wait) and waits for
    that thread with the timeout: on expiry the operations go on, as a collective's do."""

    def __init__(self, works):
        self.works = works
        self._done: threading.Event | None = None
        self._error: BaseException | None = None

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except BaseException as exc:  # re-raised by wait() in the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def wait(self, timeout=None) -> None:
        if self._done is None:
            if timeout is None:
                self._wait_all_here()
                return
            self._done = threading.Event()
            threading.Thread(target=self._wait_all, name="zero-p2p-wait", daemon=True).start()
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("timed out waiting for point-to-point operations")
        if self._error is not None:
            raise self._error

    def _wait_all_here(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        if self._done is None:
            return all(w.is_completed() for w in self.works)
        return self._done.is_set() and self._error is None


def _exchange_shards(out: torch.Tensor, shard: torch.Tensor, group, unit) -> _Works:
    """Launch out[j·L:(j+1)·L] <- rank j's shard for every j (this rank's own by a copy)."""
    group = dist.group.WORLD if group is None else group  # get_global_rank needs the object
    n, me, L = dist.get_world_size(group), dist.get_rank(group), shard.numel()
    tag = 0 if unit is None else 1 + unit
    works = []
    for k in range(1, n):  # rank me sends to me+k while it receives from me-k: no two wait
        dst, src = (me + k) % n, (me - k) % n  # on one peer in the same round
        works.append(dist.isend(shard, dist.get_global_rank(group, dst), group=group, tag=tag))
        recv = out[src * L : (src + 1) * L]
        works.append(dist.irecv(recv, dist.get_global_rank(group, src), group=group, tag=tag))
    out[me * L : (me + 1) * L].copy_(shard)
    return _Works(works)


# [Note: host scalars] A 0-dim float32 tensor on the host multiplies (or is added to) a tensor
# on any device as a kernel argument, in float32 as it is: nothing is copied to the device and
# the host does not wait. A scalar made with torch.tensor(x, device=cuda) is a copy from
# pageable memory, which blocks the host until the device has caught up (measure/hostwork.py
# counts such tensors as "makes"). The engine's 1/(S·M) and clipping coefficient and the
# deterministic torch ops' step scalars are host scalars; small vectors go up by to_device.


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device` without waiting: on CUDA a copy from pinned memory
    that the stream orders (a copy from pageable memory blocks the host until it is done).
    The control exchange's values and the optimizer kernels' tables go up this way."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
