"""Planted bugs: deliberately broken engines that verify must report failing.

    python -m verify.planted                         # every bug on every observable cell
    python -m verify.planted --cheap                 # the two cheapest cells per bug
    python -m verify.planted --bugs one_ulp shard_offset --json p.json --markdown p.md

Each bug (BUGS, a verify.features.Bug) is a name, one line on what it breaks, where it shows, a
plant function that patches the library through a Patch (undone afterwards), never touching the
library's own code path when not planted, and the check that must catch it. The base bugs are
_TABLE's (plants in verify/planted/plants.py: plant_<name>); a feature's bugs live in its record
(verify/features/). A bug of kind "cells" runs on the --quick cells where its predicate says it
is observable (verify.cells.observable.OBSERVABLE for the base ones, [Note: observable] there), a
bug of
kind "resume" on the --resume rows. Every such cell or row must fail *by the bug's named check*
(a row's `checks`, verify/checks/verdict.py): a row that failed only otherwise, or only by raising,
is
a miss, unless the bug's record says why raising is the right catch. The same cells pass
unpatched in `python -m verify --quick --resume`. A bug that no
--quick cell can catch is a bug in the preset (verify/cells/matrix.py's PLANTED_GAPS holds the
cells added
for that reason). It prints the table (--markdown writes it); docs/verification.md holds the last
full run's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .. import features
from ..cells import matrix
from ..cells.cell import Cell
from ..cells.observable import OBSERVABLE
from ..checkpoints import resume as resume_mod
from ..checks.harness import run_cells
from ..checks.report import merge
from ..features import Bug
from . import plants
from .plants import Patch

_TABLE = (
    # name, what it breaks, where it is observable, kind, the check that must catch it (the
    # plant: plants.plant_<name>; where: verify.cells.observable.OBSERVABLE or RESUME_OBSERVABLE)
    ("one_ulp", "one master element on rank N-1 one ULP off",
     "deterministic, N ≥ 2", "cells", "state"),
    ("shard_offset", "ranks >= 1 take their shard one element early",
     "deterministic, N ≥ 2, stage ≥ 1", "cells", "state"),
    ("one_over_n_for_m", "averages by 1/(S·N), not 1/(S·M)",
     "deterministic, M > N, clipping off", "cells", "reported"),
    ("bias_correction_t_minus_1", "Adam's bias corrections use step t-1",
     "deterministic, Adam(W), two optimizer steps", "cells", "state"),
    ("reduce_order", "reduce-scatter sums in ring order, not the tree T",
     "deterministic, N ≥ 3, fp32 or widely spread gradients", "cells", "reported"),
    ("stale_prefetch", "stage 3: a prefetched unit keeps its previous gather",
     "stage 3, overlap, real forward, tiny units", "cells", "traffic"),
    ("overflow_one_rank", "ranks 1..N-1 ignore the agreed overflow flag",
     "stage 0, non-finite gradients", "cells", "reported"),
    ("loss_m_over_n", "the reported loss is M/N times the mean",
     "M > N (any mode)", "cells", "reported"),
    ("extra_all_gather_stage3", "stage 3 gathers one unit too many per step",
     "stage 3 (counted collectives)", "cells", "traffic"),
    ("decay_on_biases", "the engine's grouping decays every parameter",
     "every cell (groups compared)", "cells", "structure"),
    ("decay_rule_vectors", "zero.config.decay_matrices_only decays biases and norms too",
     "every cell (groups against verify/checks/expect.py's table)", "cells", "structure"),
    ("uncapped_clip", "clip coefficient not capped at 1 (norm below the limit)",
     "clipping on some steps only (BRANCHES)", "cells", "state"),
    ("unchecked_reduced_overflow", "R unchecked for overflow when S < 1/M",
     "loss scale < 1/M, overflow in R only", "cells", "reported"),
    ("extra_partial_sum", "the streaming tree keeps one partial-sum shard too many",
     "deterministic (resident bytes)", "cells", "memory"),
    ("fast_norm_misreported", "fast mode reports its norm 1e-6 too large",
     "fast mode (norm bitwise against the pinned order)", "cells", "reported"),
    ("t_advances_on_skip", "a skipped step counts as an optimizer step",
     "a skipped step", "cells", "reported"),
    ("unused_updated", "a parameter no micro-batch had a gradient for is updated with zeros",
     "a model with a branch whole steps skip", "cells", "state"),
    ("microbatch_rank_major", "rank r runs micro-batch r·K + k, not k·N + r",
     "deterministic, backward, N ≥ 2, M > N, fp32", "cells", "reported"),
    ("clip_first_unit_only", "clipping (norm above the limit) scales the first unit only",
     "deterministic, tiny units, steps that clip", "cells", "state"),
    ("scaler_backoff_quarter", "the loss scaler backs off by 1/4, not 1/2",
     "fp16 with a skipped step", "cells", "reported"),
    ("group_run_boundary", "a group's first element gets the previous group's hypers",
     "deterministic, a group starting inside a shard", "cells", "state"),
    ("prefetch_wrong_unit", "stage 3 backward prefetches the unit just done",
     "stage 3, overlap, real forward, tiny units", "cells", "traffic"),
    ("persist_threshold_off_by_one", "stage 3 persists numel < persist_below, not <=",
     "stage 3, a unit of exactly persist_below (PLANTED_GAPS)", "cells", "traffic"),
    ("model_scales_input_in_place", "model code: the MLP halves its input in place",
     "the MLP's own backward in fp32", "cells", "reported"),
    ("runs_cut_on_use_only", "optimizer runs not cut where t_p changes",
     "unused × one group × one unit (interactions)", "cells", "state"),
    ("load_scaler_fresh", "load restores everything but the loss scaler",
     "fp16 resume rows", "resume", "state"),
    ("consolidate_swaps_moments", "consolidation swaps exp_avg and exp_avg_sq",
     "Adam(W) resume rows (consolidation)", "resume", "consolidation"),
)  # fmt: skip


def _native(case) -> bool:
    """A resume row in the native format: the base bugs patch its loader and consolidation."""
    return features.checkpoint_of(case.features) is None


RESUME_OBSERVABLE: dict[str, Callable] = {
    # the scaler is compared after the resume; only fp16 has one
    "load_scaler_fresh": lambda case: case.precision == "fp16" and _native(case),
    # the consolidated states are compared with the engine's bit for bit; Adam and AdamW only
    "consolidate_swaps_moments": lambda case: case.optimizer in ("adam", "adamw") and _native(case),
}


def _base(name, breaks, where, kind, check) -> Bug:
    seen = RESUME_OBSERVABLE[name] if kind == "resume" else OBSERVABLE[name]
    plant = getattr(plants, f"plant_{name}")
    return Bug(name=name, breaks=breaks, where=where, plant=plant, observable=seen, kind=kind,
               check=check)  # fmt: skip


BUGS: dict[str, Bug] = {row[0]: _base(*row) for row in _TABLE}
BUGS.update({bug.name: bug for bug in features.bugs()})
"""The planted bugs by name: the base ones, then each feature's (verify/features/)."""


def observable(name: str, *, quick=None) -> list:
    """The --quick cells (or --resume quick cases) where bug `name` must show."""
    if BUGS[name].kind == "resume":
        return [c for c in resume_mod.resume_cases(quick=True) if BUGS[name].observable(c)]
    cells = quick if quick is not None else matrix.quick()[0]
    return [c for c in cells if BUGS[name].observable(c)]


def cost(c) -> int:
    """A rough cost to pick the cheapest cells (ranks · micro-batches · steps; forward 4x)."""
    if isinstance(c, Cell):
        return c.world_size * c.micro_batches * c.steps * (4 if c.gradients == "backward" else 1)
    return c.n1 + c.n2 + 8 * (c.model == "gpt")


_PLANTED: set[str] = set()
"""[Note: planted once per process] The bugs planted in this process now. A process forked
while its parent had a bug planted (a resumed run's fresh ranks) inherits the patch and this set
with it; planting again there would patch the patched function, and a bug that swaps two things
would swap them back. Pools are started before the parent plants (run_bug), so that no
long-lived worker keeps a bug for the runs after."""


@contextlib.contextmanager
def planted(bug: str):
    """The bug planted in this process for the block, unless it already is (inherited)."""
    if bug in _PLANTED:
        yield
        return
    with Patch() as p:
        BUGS[bug].plant(p)
        _PLANTED.add(bug)
        try:
            yield
        finally:
            _PLANTED.discard(bug)


def run_planted(rank: int, n: int, bug: str, cells: list[Cell]) -> list[dict]:
    """On every rank: run_cells with the bug planted (a pool worker's entry point)."""
    with planted(bug):
        return run_cells(rank, n, cells)


def planted_resume_rank(rank: int, n: int, *args, bug: str):
    """verify.checkpoints.resume.run_rank with the bug planted (a pool worker's entry point)."""
    with planted(bug):
        return resume_mod.run_rank(rank, n, *args)


def check_of(row: dict) -> str:
    """Which check a failing row failed first: reported / traffic / memory / state / ..."""
    why = row.get("first_mismatch", "")
    for word, check in (
        ("raised", "raised"),
        ("failed", "raised"),
        ("consolidat", "consolidation"),
        ("traffic", "traffic"),
        ("resident bytes", "memory"),
        ("units:", "units"),
        ("parameter groups", "groups"),
        ("bound exceeded", "bound"),
        ("loss", "reported"),
        ("global norm", "reported"),
        ("skip decision", "reported"),
        ("step count", "reported"),
        ("data step", "reported"),
        ("scaler", "state"),
    ):
        if word in why:
            return check
    return "state" if why else ""


def run_bug(name: str, chosen: list, *, timeout_s: float = 300) -> list[dict]:
    """Rows of bug `name` planted on `chosen` (cells or resume cases); each with `passed`."""
    from zero.ranks.local import get_pool

    if BUGS[name].kind == "resume":
        rows = []
        runner = functools.partial(planted_resume_rank, bug=name)
        for n in sorted({case.n1 for case in chosen}):
            get_pool(n)  # started unplanted ([Note: planted once per process])
        for case in chosen:
            with tempfile.TemporaryDirectory(prefix="zero-planted-") as tmp, planted(name):
                try:  # the bug in this process too: consolidation runs here
                    rows.append(resume_mod.run_case(case, tmp, timeout_s=timeout_s, rank_fn=runner))
                except Exception as exc:  # a broken run is a caught bug, reported as raised
                    first = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    rows.append(
                        {
                            "passed": False,
                            "first_mismatch": first,
                            "checks": ["raised"],
                            "config": dataclasses.asdict(case),
                        }
                    )
        return rows
    rows = []
    for n in sorted({c.world_size for c in chosen}):
        mine = [c for c in chosen if c.world_size == n]
        per_rank = get_pool(n).run(run_planted, name, mine, timeout_s=timeout_s)
        rows += [merge(c, [r[i] for r in per_rank]) for i, c in enumerate(mine)]
    return rows


def checks_of(row: dict) -> list[str]:
    """The named checks a row failed: a cell's own record of them (verify/checks/harness.py's
    Verdict), a resume row's from its first mismatch (check_of)."""
    if "checks" in row:
        return list(row["checks"])
    return [check_of(row)] if not row.get("passed") else []


def by_its_check(bug: Bug, row: dict) -> bool:
    """Caught as the bug's record says: its named check failed (a row that failed only by
    raising, or by another check, is a miss unless the record says why raising is right). A
    fast-mode cell checks its state against the derived bounds, so there "bound" counts as
    "state" too."""
    wanted = {bug.check}
    if bug.check == "state" and (row.get("config") or {}).get("mode") == "fast":
        wanted.add("bound")  # the state against the derived bounds (or, frozen, its bits)
    return bool(wanted & set(checks_of(row)))


def run(bugs=None, *, cheap: bool = False, say=print) -> list[dict]:
    """One summary per bug: {bug, breaks, kind, check, observable, ran, caught, failed_other,
    first_check, first_mismatch, seconds, missed}. caught counts the rows its named check
    failed; failed_other the rows that failed only otherwise (a miss too). cheap: the two
    cheapest observable cells per bug."""
    quick = matrix.quick()[0]
    out = []
    for name in bugs or list(BUGS):
        bug, every = BUGS[name], observable(name, quick=quick)
        chosen = sorted(every, key=cost)[:2] if cheap else every
        started = time.perf_counter()
        rows = run_bug(name, chosen) if chosen else []
        caught = [r for r in rows if by_its_check(bug, r)]
        other = [r for r in rows if not r["passed"] and not by_its_check(bug, r)]
        shown = caught or other
        summary = {
            "bug": name,
            "breaks": bug.breaks,
            "kind": bug.kind,
            "check": bug.check,
            "observable": len(every),
            "ran": len(rows),
            "caught": len(caught),
            "failed_other": len(other),
            "first_check": ",".join(checks_of(shown[0])) if shown else "",
            "first_mismatch": shown[0].get("first_mismatch", "") if shown else "",
            "missed": [r["config"] for r in rows if not by_its_check(bug, r)],
            "seconds": round(time.perf_counter() - started, 1),
        }
        say(f"{name:<32} {bug.check}: caught {summary['caught']}/{summary['ran']} "
            f"(observable {len(every)}, failed otherwise {len(other)})  "
            f"{summary['first_check']}: {summary['first_mismatch'][:80]}")  # fmt: skip
        out.append(summary)
    return out


def markdown(summaries: list[dict]) -> str:
    """The table of a run: bug | breaks | observable where | caught / observable | first check."""
    lines = [
        "| planted bug | what it breaks | observable where | must fail | caught / observable "
        "| checks that failed |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        where = "`--resume` rows" if s["kind"] == "resume" else "`--quick` cells"
        count = f"{s['caught']}/{s['observable']} {where}"
        if s["ran"] != s["observable"]:
            count = f"{s['caught']}/{s['ran']} run ({s['observable']} observable {where})"
        lines.append(
            f"| `{s['bug']}` | {s['breaks']} | {BUGS[s['bug']].where} | {s['check']} | {count} "
            f"| {s['first_check']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m verify.planted", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--bugs", nargs="+", default=None, choices=list(BUGS))
    ap.add_argument("--cheap", action="store_true", help="the two cheapest cells per bug")
    ap.add_argument("--json", default=None, help="write the summaries here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    ap.add_argument("--list", action="store_true", help="print the bugs and their cells")
    args = ap.parse_args(argv)
    if args.list:
        quick = matrix.quick()[0]
        for name, bug in BUGS.items():
            print(f"{name:<32} {len(observable(name, quick=quick)):>4}  {bug.breaks}")
        return 0
    summaries = run(args.bugs, cheap=args.cheap)
    if args.json:
        from zero.common.results import write_json

        write_json(args.json, {"planted": summaries, "cheap": args.cheap})
    if args.markdown:
        Path(args.markdown).write_text(markdown(summaries))
    print(markdown(summaries))
    missed = [s["bug"] for s in summaries if s["caught"] < s["ran"] or not s["ran"]]
    if missed:
        print(f"NOT CAUGHT everywhere: {missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
