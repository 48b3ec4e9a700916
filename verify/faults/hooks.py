"""`python -m verify.faults.hooks OPTIONS`: `python -m zero.workloads.train OPTIONS` with one rank
held at a chosen point of a step, so that a fault case lands its signal there and nowhere else.

    FAULTS_PAUSE=POINT:RANK:AFTER FAULTS_PAUSE_FILE=PATH python -m verify.faults.hooks --nproc 2 ...

This process is the launcher and its ranks are forked from it, so the hooks installed here are
theirs. Rank RANK, the first time it reaches POINT once AFTER steps are done (engine.step()
calls returned in that process), writes PATH (JSON: its pid, rank, point and steps done) and
waits there for up to PAUSE_S: to its peers a rank merely slow (its heartbeat thread beats on,
so the watchdog names nobody), to the case a process stopped at a known place, for the signal
it sends once PATH exists. The points:

    backward    ZeroEngine.backward, before it runs (the micro-step's forward has run)
    update      inside step(): the disk tier's update of a unit done, its state files'
                write-back just queued (DiskOffload._write_back; the writer thread writes
                them back, the next units' update not yet run): the update's disk writes
    save_first  a save's first file (owner.json), before it is written: the new step folder
                exists and is empty (rank 0 makes it: RANK 0)
    mid_save    a save, right after this rank's first shard file is durably written
                (zero.checkpoint._after_write)
    prune       a prune (rank 0, after the commit): an old step folder renamed to its trash
                name, before the trash is deleted (RANK 0)

Without FAULTS_PAUSE it is zero.workloads.train itself. The lines it prints are
zero.workloads.train's (the same `python -m zero.workloads.train: error: ...`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

POINTS = ("backward", "update", "save_first", "mid_save", "prune")
PAUSE_S = 120.0
"""How long the held rank waits for the case's signal before it goes on (the case's deadline
is shorter: a signal that never comes is a hang of the case, not a silent pass)."""
ENV, FILE_ENV = "FAULTS_PAUSE", "FAULTS_PAUSE_FILE"

_done = [0]  # engine.step() calls returned in this process (a forked rank counts its own)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Pause:
    """Hold rank `rank` at `point` once `after` steps are done, once."""

    def __init__(self, spec: str, path: str):
        point, rank, after = spec.split(":")
        if point not in POINTS:
            raise ValueError(f"{ENV}={spec!r}: point {point!r} is not one of {POINTS}")
        self.point, self.rank, self.after, self.path = point, int(rank), int(after), Path(path)
        self.fired = False

    def __call__(self, point: str) -> None:
        if self.fired or point != self.point or _done[0] < self.after or _rank() != self.rank:
            return
        self.fired = True
        record = {"pid": os.getpid(), "rank": self.rank, "point": point, "done": _done[0]}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)  # whole or not at all: the case reads it at once
        end = time.monotonic() + PAUSE_S
        while time.monotonic() < end:
            time.sleep(0.05)


def install(pause: Pause) -> None:
    """The hooks: every point wrapped (only `pause.point` ever holds)."""
    import zero.checkpoint as checkpoint
    from zero.checkpoint import commit
    from zero.engine import ZeroEngine

    step, backward = ZeroEngine.step, ZeroEngine.backward

    def counted_step(self, *args, **kw):
        out = step(self, *args, **kw)
        _done[0] += 1
        return out

    def held_backward(self, *args, **kw):
        pause("backward")
        return backward(self, *args, **kw)

    ZeroEngine.step, ZeroEngine.backward = counted_step, held_backward

    if pause.point == "update":
        from zero.zero_r import disk

        write_back = getattr(getattr(disk, "DiskOffload", None), "_write_back", None)
        if write_back is None:
            raise RuntimeError("zero.zero_r.disk.DiskOffload has no _write_back to hold in")

        def held_write_back(self, *args, **kw):
            out = write_back(self, *args, **kw)
            pause("update")
            return out

        disk.DiskOffload._write_back = held_write_back

    write_durably, rmtree = commit._write_durably, commit._rmtree
    owner_file = getattr(commit, "OWNER", "owner.json")

    def held_write(path, *args, **kw):
        if Path(path).name == owner_file:
            pause("save_first")
        return write_durably(path, *args, **kw)

    def held_rmtree(d, *args, **kw):
        if commit.TRASH.fullmatch(Path(d).name):
            pause("prune")
        return rmtree(d, *args, **kw)

    commit._write_durably, commit._rmtree = held_write, held_rmtree
    before = checkpoint._after_write

    def after_write(path):
        if before is not None:
            before(path)
        if Path(path).suffix == ".bin":
            pause("mid_save")

    checkpoint._after_write = after_write


def main() -> None:
    from zero.common import cli
    from zero.workloads import train

    spec = os.environ.get(ENV)
    if spec:
        install(Pause(spec, os.environ[FILE_ENV]))
    cli.run(train.cli_main, "python -m zero.workloads.train")


if __name__ == "__main__":
    main()
