"""verify's watchdog section: ranks that stop agreeing must be named, the right one, on every rank.

Each cell builds the project's small MLP on N gloo ranks, trains a step, and then makes some
ranks (rank 1, by default) diverge in one way. What must happen is built from the cell alone
(expected_blame): every rank raises zero.ranks.watchdog.CollectiveError at the same exchange,
whose `blamed` is exactly the diverging ranks, or, where they are no minority (a 1-1 split at
N = 2, a 2-2 split at N = 4), every rank, with a first line that says there was no strict
majority; and no rank hangs or goes on training. Before the watchdog each of these hung until
the timeout, aborted a healthy rank inside gloo, or (equal-size units reduced in another order)
summed the wrong units silently. The cells exercise the watchdog's boundary check, its legality
rules, the majority rule, its ties and the trace to the first differing collective. One cell
stops rank 1 (SIGSTOP) at the default collective timeout: the others must name it, as stopped,
within the heartbeat bound ([Note: a stopped rank named in seconds] in zero/ranks/watchdog.py),
after which rank 0 lets it continue and it leaves. Deaths, and stalls under the launchers, are
the fault suite's (python -m verify.faults).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.local import get_pool
from zero.ranks.watchdog import CollectiveError
from zero.workloads.models import MLP, MLPConfig, mlp_microbatches


@dataclass(frozen=True, kw_only=True)
class WatchCell:
    fault: str  # what rank 1 does: see diverge()
    world_size: int
    stage: int
    mode: str = "calls"  # ZeroConfig.watchdog
    ranks: tuple[int, ...] = (1,)  # the ranks that diverge

    @property
    def label(self) -> str:
        who = "" if self.ranks == (1,) else f" ranks {','.join(map(str, self.ranks))}"
        return f"{self.fault} N={self.world_size} stage {self.stage} watchdog={self.mode}{who}"


NOT_ALLOWED = ("extra_backward", "skipped_step")
"""Faults whose call the step does not allow: their ranks are named whatever the others do."""


def expected_blame(cell: WatchCell) -> list[int]:
    """The ranks the watchdog must name, from the cell alone: a call the step does not allow
    names its ranks; otherwise the ranks outside a strict majority, and with no strict majority
    on either side (a tie) every rank."""
    n, bad = cell.world_size, sorted(set(cell.ranks))
    good = [r for r in range(n) if r not in bad]
    if cell.fault in (*NOT_ALLOWED, "stopped", "killed") or 2 * len(good) > n:  # not by vote
        return bad
    return good if 2 * len(bad) > n else list(range(n))


def is_tie(cell: WatchCell) -> bool:
    return cell.fault not in NOT_ALLOWED and expected_blame(cell) == list(range(cell.world_size))


CELLS = (
    WatchCell(fault="extra_backward", world_size=2, stage=2),
    WatchCell(fault="skipped_step", world_size=2, stage=3),
    WatchCell(fault="extra_eval", world_size=4, stage=3),
    WatchCell(fault="unit_order", world_size=4, stage=2),
    WatchCell(fault="unit_order_sizes", world_size=4, stage=1, mode="collectives"),
    WatchCell(fault="extra_eval", world_size=2, stage=3),
    WatchCell(fault="extra_eval", world_size=4, stage=3, ranks=(2, 3)),
    WatchCell(fault="stopped", world_size=2, stage=2),
    WatchCell(fault="killed", world_size=2, stage=2),
)
"""One cell per rule: a call the step does not allow (backward beyond M/N; step() before
them), a majority against one rank (an evaluation forward the others do not make), and the
trace of equal calls with other collectives, at the boundaries ('calls') and before every
collective ('collectives', where the units' sizes differ and a boundary check would come too
late); and two ties, where each side is as large as the other: two legal but different calls
at N = 2, and a 2-2 split at N = 4 (every rank named, the first line saying why); a stopped
rank, named in seconds at the default timeout; and a killed rank, named by the launcher with its
signal, whose launch also removes the rendezvous folder a job killed whole left."""


def _engine(cell: WatchCell, n: int):
    equal = cell.fault == "unit_order"  # two hidden layers of one size: 48·48 + 48 each
    model = MLP(MLPConfig(d_in=48 if equal else 16, d_hidden=48, d_out=4, n_layer=3))
    cfg = ZeroConfig(
        stage=cell.stage,
        micro_batches=2 * n,
        units=tuple(model.unit_names()),
        chunk=128,
        watchdog=cell.mode,
    )
    return model, ZeroEngine(model, cfg)


STOP_SLACK_S = 10.0
"""Beyond the watchdog's own bound (STOPPED_S + SLICE_S), what a loaded machine may add between
the stop and the error: scheduling and one step's collective. Still 50x below the timeout."""


def diverge(rank: int, n: int, cell: WatchCell, scratch: str | None = None) -> dict:
    """One rank's part of a cell: its verdict of what the watchdog said on this rank."""
    model, eng = _engine(cell, n)
    if cell.fault == "stopped":
        return _stopped(rank, cell, model, eng, Path(scratch))
    bad = rank in cell.ranks
    if bad and cell.fault.startswith("unit_order"):
        i, j = (next(k for k, u in enumerate(eng.units) if u.name == x) for x in model.unit_names())
        eng.units[i], eng.units[j] = eng.units[j], eng.units[i]  # launched in another order
    try:
        for step in range(3):
            batches = mlp_microbatches(model.cfg, seed=0, data_step=step, count=2 * n, batch_size=4)
            mine = [batches[k * n + rank] for k in range(2)]
            if bad and step == 1 and cell.fault == "extra_backward":
                mine.append(mine[0])
            if bad and step == 1 and cell.fault == "extra_eval":
                with torch.no_grad():  # at stage 3 an evaluation forward gathers: collective
                    eng(*mine[0])
            for x in mine:
                _, loss = eng(*x)
                eng.backward(loss)
            if not (bad and step == 1 and cell.fault == "skipped_step"):
                eng.step()
    except CollectiveError as exc:
        return {"blamed": list(exc.blamed), "message": str(exc).splitlines()[0][:200]}
    except Exception:
        return {"blamed": None, "message": traceback.format_exc(limit=3)[-300:]}
    return {"blamed": None, "message": "trained on: no rank was named"}


def _stopped(rank: int, cell: WatchCell, model, eng, scratch: Path) -> dict:
    """Rank 1 notes its pid and the time, and stops itself after a clean step; the others step
    on and must name it within the bound. Rank 0 then continues it (SIGCONT): it returns
    without another collective, and the world ends (the others' waits are left in flight:
    watchdog.stranded())."""
    n = eng.world_size

    def step(k: int) -> None:
        batches = mlp_microbatches(model.cfg, seed=0, data_step=k, count=2 * n, batch_size=4)
        for x in (batches[rank], batches[n + rank]):
            _, loss = eng(*x)
            eng.backward(loss)
        eng.step()

    step(0)
    if rank in cell.ranks:
        (scratch / "stopped").write_text(f"{os.getpid()} {time.monotonic()!r}")
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"blamed": None, "message": "stopped, then continued", "stopped": True}
    try:
        step(1)
    except CollectiveError as exc:
        pid, at = (scratch / "stopped").read_text().split()
        took = time.monotonic() - float(at)
        if rank == 0:
            os.kill(int(pid), signal.SIGCONT)
        return {"blamed": list(exc.blamed), "message": str(exc).splitlines()[0][:200], "s": took}
    return {"blamed": None, "message": "trained on: no rank was named"}


def _killed(rank: int, n: int, cell: WatchCell) -> str:
    """Rank 1 kills itself (SIGKILL) after a clean step; the others go on and fail."""
    model, eng = _engine(cell, n)
    batches = mlp_microbatches(model.cfg, seed=0, data_step=0, count=2 * n, batch_size=4)
    for step in range(2):
        if step == 1 and rank in cell.ranks:
            os.kill(os.getpid(), signal.SIGKILL)
        for x in (batches[rank], batches[n + rank]):
            _, loss = eng(*x)
            eng.backward(loss)
        eng.step()
    return "trained on"


def _run_killed(cell: WatchCell, timeout_s: float) -> list[dict]:
    """The launcher's report of a rank killed by SIGKILL: it must name the rank and its signal.
    Before it, a rendezvous folder as a job killed whole leaves it (its launcher's record, a
    pid that runs no more) is planted: the launch must remove it ([Note: rendezvous folders of a
    job killed whole] in zero/ranks/signals.py)."""
    import json
    import subprocess
    import tempfile

    from zero.common import owner
    from zero.ranks.launch import RankError
    from zero.ranks.local import spawn
    from zero.ranks.signals import OWNER

    gone = subprocess.Popen(["true"])
    gone.wait()
    left = Path(tempfile.mkdtemp(prefix="zero-spawn-", dir=tempfile.gettempdir()))
    (left / OWNER).write_text(json.dumps({**owner.identity(), "pid": gone.pid}))
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # the launch's note on the folder it removed
            spawn(_killed, cell.world_size, cell, timeout_s=60, deadline_s=timeout_s)
        text = "the run ended without an error"
    except RankError as exc:
        text = str(exc)
    blame = next((x for x in text.splitlines() if "watchdog blames" in x), text[:200])
    named = [r for r in range(cell.world_size) if f"watchdog blames rank {r}:" in blame]
    rows = [{"blamed": named, "message": blame.strip()[:200], "killed": True}]
    if left.exists() or str(left) not in said.getvalue():
        rows[0]["message"] = f"a dead launcher's folder {left} was not removed with a note"
    return rows


def _run_stopped(cell: WatchCell, timeout_s: float) -> list[dict]:
    """A stopped cell on a world of its own (a pool's would be left broken), at the default
    collective timeout (600 s): a naming at the timeout would fail the cell's bound."""
    import tempfile

    from zero.ranks.local import spawn

    with tempfile.TemporaryDirectory(prefix="verify-stop-") as scratch:
        return spawn(diverge, cell.world_size, cell, scratch, timeout_s=600, deadline_s=timeout_s)


def run_section(*, timeout_s: float, say, cells=CELLS) -> list[dict]:
    """Every cell on its pool; a row per cell: passed when every rank named exactly
    expected_blame(cell), and a tie's first line says there was no strict majority.
    Under torchrun the section is skipped with one line: its cells make a rank diverge on
    purpose, which a pool of its own survives (a new world per cell) but a launched world
    would not (the sections after it would run on a world whose collectives disagree)."""
    from zero.ranks.launch import under_torchrun

    if under_torchrun():
        say("  (watchdog skipped under torchrun: its cells break their world on purpose; run")
        say("   python -m verify --quick without torchrun for them)")
        return []
    rows = []
    for cell in cells:
        if cell.fault == "stopped":
            per_rank = _run_stopped(cell, timeout_s)
        elif cell.fault == "killed":
            per_rank = _run_killed(cell, timeout_s)
        else:
            per_rank = get_pool(cell.world_size).run(diverge, cell, timeout_s=timeout_s)
        why = verdict(cell, per_rank)
        passed = not why
        rows.append({"cell": cell.label, "passed": passed, "message": per_rank[0]["message"]})
        say(f"  {cell.label:<56} {'PASS' if passed else 'FAIL ' + why}")
    return rows


def verdict(cell: WatchCell, per_rank: list[dict]) -> str:
    """'' when every rank named expected_blame(cell) (and, at a tie, said so); else why not."""
    from zero.ranks.watchdog import SLICE_S, STOPPED_S

    want = expected_blame(cell)
    for rank, r in enumerate(per_rank):
        if r.get("stopped"):
            continue  # the stopped rank itself names no one
        if r["blamed"] != want:
            return f"rank {rank} named {r['blamed']}, not {want}: {r['message']}"
        if is_tie(cell) and "no strict majority" not in r["message"]:
            return f"rank {rank}: a tie not stated as one: {r['message']}"
        if cell.fault == "killed" and "signal 9 (SIGKILL)" not in r["message"]:
            return f"the launcher did not name the signal: {r['message']}"
        if cell.fault == "stopped" and "its process is stopped" not in r["message"]:
            return f"rank {rank}: not named as stopped: {r['message']}"
        if cell.fault == "stopped" and r["s"] > STOPPED_S + SLICE_S + STOP_SLACK_S:
            return f"rank {rank}: named after {r['s']:.1f} s, beyond the heartbeat bound"
    return ""
