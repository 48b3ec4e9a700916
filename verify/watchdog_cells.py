"""verify's watchdog section: ranks that stop agreeing must be named, the right one, on every rank.

Each cell builds the project's small MLP on N gloo ranks, trains a step, and then makes some
ranks (rank 1, by default) diverge in one way. What must happen is built from the cell alone
(expected_blame): every rank raises zero.ranks.watchdog.CollectiveError at the same exchange,
whose `blamed` is exactly the diverging ranks, or, where they are no minority (a 1-1 split at
N = 2, a 2-2 split at N = 4), every rank, with a first line that says there was no strict
majority; and no rank hangs or goes on training. Before the watchdog each of these hung until
the timeout, aborted a healthy rank inside gloo, or (equal-size units reduced in another order)
summed the wrong units silently. The cells exercise the watchdog's boundary check, its legality
rules, the majority rule, its ties and the trace to the first differing collective; stalls and
deaths, which need a timeout to pass, are the fault suite's (python -m verify.faults).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

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
    if cell.fault in NOT_ALLOWED or 2 * len(good) > n:
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
)
"""One cell per rule: a call the step does not allow (backward beyond M/N; step() before
them), a majority against one rank (an evaluation forward the others do not make), and the
trace of equal calls with other collectives, at the boundaries ('calls') and before every
collective ('collectives', where the units' sizes differ and a boundary check would come too
late); and two ties, where each side is as large as the other: two legal but different calls
at N = 2, and a 2-2 split at N = 4 (every rank named, the first line saying why)."""


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


def diverge(rank: int, n: int, cell: WatchCell) -> dict:
    """One rank's part of a cell: its verdict of what the watchdog said on this rank."""
    model, eng = _engine(cell, n)
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
        per_rank = get_pool(cell.world_size).run(diverge, cell, timeout_s=timeout_s)
        why = verdict(cell, per_rank)
        passed = not why
        rows.append({"cell": cell.label, "passed": passed, "message": per_rank[0]["message"]})
        say(f"  {cell.label:<56} {'PASS' if passed else 'FAIL ' + why}")
    return rows


def verdict(cell: WatchCell, per_rank: list[dict]) -> str:
    """'' when every rank named expected_blame(cell) (and, at a tie, said so); else why not."""
    want = expected_blame(cell)
    for rank, r in enumerate(per_rank):
        if r["blamed"] != want:
            return f"rank {rank} named {r['blamed']}, not {want}: {r['message']}"
        if is_tie(cell) and "no strict majority" not in r["message"]:
            return f"rank {rank}: a tie not stated as one: {r['message']}"
    return ""
