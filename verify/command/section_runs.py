"""What each section of python -m verify does, for its entry in the table of
verify/command/sections.py: its run (a dict of report keys), its --list lines, the line it says
when done, its closing summary lines and its Markdown. Each gets the Invocation: the parsed
options, `say`, and the matrix's plan.

A run here is called only when the table chose its section for this invocation, on a device
where it computes (verify/command/sections.py decides both); it returns the report keys it
fills, in the order they are written to the JSON report."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

from zero.ranks import launch

from .. import features
from ..cells import matrix
from ..cells.cell import Cell
from ..cells.observable import coverage
from ..cells.run import Where, run_matrix
from ..checks.report import guarded

MODES = ("deterministic", "fast")


@dataclasses.dataclass(frozen=True)
class Invocation:
    """What every section's functions get: this invocation of python -m verify."""

    args: argparse.Namespace
    say: Callable[..., None]
    """Prints one line (on rank 0 alone under torchrun)."""
    cells: list[Cell]
    """The matrix's cells (plan): none when a section runs alone."""
    runs: list[dict]
    """The world-size invariance table's runs (plan)."""
    where: Where
    alone: bool
    """Whether an option runs its section alone (--parity, --mp): no matrix cells, no presets'."""


def passed(rows: list[dict]) -> str:
    """'passed/all' of some rows."""
    return f"{sum(r['passed'] for r in rows)}/{len(rows)}"


def in_sizes(cells: list, args) -> list:
    """The cells of --world-sizes (all of them without it)."""
    if args.world_sizes is None:
        return cells
    return [c for c in cells if c.world_size in args.world_sizes]


# -- the matrix: cells, injected cells and the world-size invariance table ----------------------


def cells_for(args) -> list[Cell]:
    """The explicit grid of the selection options (no preset)."""
    return matrix.cells(
        world_size=args.world_sizes or [1, 2, 4],
        stage=args.stages,
        precision=args.precisions,
        optimizer=args.optimizers,
        mode=MODES if args.mode == "both" else args.mode,
        model=args.models,
        steps=args.steps,
        accumulation=args.accumulation,
        features=[features.parse_features(args.features or ())],
    )


def with_features(cells: list[Cell], named) -> list[Cell]:
    """A preset's cells that use every feature `named` (bare names; a value is ignored), each
    name checked against the registry."""
    wanted = {n.partition("=")[0] for n in named}
    known = {n for n, f in features.FEATURES.items() if not f.section}
    if wanted - known:
        raise ValueError(
            f"features={sorted(wanted - known)}: not in the registry; allowed are {sorted(known)}"
        )
    out = [c for c in cells if wanted <= set(features.names(c.features))]
    if not out:
        raise ValueError(f"features={sorted(wanted)}: no cell of the preset uses them all")
    return out


def plan(args, alone: bool) -> tuple[list[Cell], list[dict]]:
    """(cells, invariance runs) that this invocation runs: none when a section runs alone."""
    if alone:  # one section alone (--parity, --mp)
        return [], []
    if args.quick or args.complete:
        cells, runs = matrix.quick() if args.quick else matrix.complete()
        if args.world_sizes is not None:
            has = sorted({c.world_size for c in cells})
            cells = [c for c in cells if c.world_size in args.world_sizes]
            if not cells:  # else "0/0 cells" and exit 1 without a reason
                preset = "--quick" if args.quick else "--complete"
                raise ValueError(
                    f"world_sizes={args.world_sizes}: the {preset} preset has cells of world "
                    f"sizes {has} only; allowed are some of those"
                )
        if args.features is not None:  # the features' cells; the invariance table has none
            cells, runs = with_features(cells, args.features), []
    else:
        cells = cells_for(args)
        runs = matrix.invariance_runs(full=False) if args.invariance else []
        runs = [r for r in runs if r["stage"] in args.stages]
    if args.no_invariance:
        runs = []
    if not cells and not runs:
        raise ValueError("the selection options give no cells: allowed is a non-empty selection")
    return cells, runs


def list_plans(args) -> dict[str, list]:
    """The plans besides the cells that `--list` reports feature pairs over (verify/cells/
    interactions.py): the resume cases and model-parallel rows with --resume, the model-parallel
    cells and the watchdog cells with a preset, the GPU tests that exist in this checkout."""
    from ..cells import interactions
    from ..checkpoints import resume
    from ..faults import watchdog_cells
    from ..mp import cells as mp_cells
    from ..mp import resume as mp_resume

    plans: dict[str, list] = {}
    if args.resume:
        plans["resume"] = resume.resume_cases(quick=not args.complete)
    if args.quick or args.complete:
        mp = mp_cells.complete_cells() if args.complete else mp_cells.quick_cells()
        plans["mp"] = list(mp) + (list(mp_resume.row_names()) if args.resume else [])
        plans["watchdog"] = list(watchdog_cells.CELLS)
    root = Path(__file__).resolve().parents[2]
    plans["gpu"] = [t for t in interactions.GPU_TESTS if (root / t).is_file()]
    return plans


def matrix_listing(inv: Invocation) -> None:
    """--list: the cells per world size, the counts, and what the plans cover."""
    cells = inv.cells
    for n in sorted({c.world_size for c in cells}):
        inv.say(f"N={n}: {sum(c.world_size == n for c in cells)} cells")
    inv.say(f"{len(cells)} cells, {len(inv.runs)} invariance runs")
    for line in coverage(cells, list_plans(inv.args)):
        inv.say(line)


def matrix_run(inv: Invocation) -> dict:
    """The matrix (verify/cells/run.py): "cells", "injected", "world_size_invariance", "errors" and
    "timing"; no_matrix's report when it raised as a whole."""
    t0 = time.time()
    return guarded(
        "cells",
        lambda: run_matrix(
            inv.cells, inv.runs, timeout_s=inv.args.timeout, say=inv.say,
            invariance_sizes=inv.args.world_sizes, where=inv.where,
        ),
        wrap=lambda failed: no_matrix(failed, t0),
    )  # fmt: skip


def no_matrix(failed: dict, started: float) -> dict:
    """The report of a run whose cells raised as a whole (run_matrix): no rows, the failing row
    in "errors", so that the sections after it still run and the report is still written."""
    empty = {"cells": [], "injected": [], "world_size_invariance": []}
    return {**empty, "errors": [failed], "timing": {"total_s": round(time.time() - started, 1)}}


def passed_lines(*names: str) -> Callable[[Invocation, dict], list[str]]:
    """Closing lines 'name: passed/all passed', for each of these report keys that has rows."""
    return lambda inv, report: [f"{n}: {passed(report[n])} passed" for n in names if report.get(n)]


def matrix_closing(inv: Invocation, report: dict) -> list[str]:
    """The summary's cells line (not when a section runs alone: no matrix cells), then the
    invariance table's."""
    rows = report["cells"] + report["injected"]
    total = f"{passed(rows)} cells passed in {report['timing']['total_s']:.1f} s"
    return ([] if inv.alone else [total]) + passed_lines("world_size_invariance")(inv, report)


# -- the other sections ------------------------------------------------------------------------


def resume_run(inv: Invocation) -> dict:
    """The checkpoint resume/reshard table (verify/checkpoints/resume.py): the quick cases, or
    every case
    with --complete; no rows when this checkout has no verify/checkpoints/resume.py."""
    say, args = inv.say, inv.args
    if importlib.util.find_spec("verify.checkpoints.resume") is None:
        say("--resume: verify/checkpoints/resume.py is not in this checkout; no resume table")
        return {"resume": []}
    module = importlib.import_module("verify.checkpoints.resume")
    kwargs = {"timeout_s": args.timeout, "quick": not args.complete}
    if args.world_sizes is not None:
        kwargs["world_sizes"] = tuple(args.world_sizes)
    rows = module.run_table(**kwargs)
    say("resume (train k steps, save, load at another N and stage, train on; bitwise;")
    say("        consolidated = engine bitwise, torch.optim's next step within its bound):")
    for r in rows:
        where = f"N={r['from_world_size']} stage {r['from_stage']} -> "
        where += f"N={r['to_world_size']} stage {r['to_stage']}"
        verdict = "PASS" if r["passed"] else "FAIL " + r.get("first_mismatch", "")
        ratio = (r.get("consolidated") or {}).get("torch_ratio")
        torch_step = "" if ratio is None else f"  torch.optim {ratio:.2f} of its bound"
        say(f"  {where} {r.get('precision', '')} {r.get('optimizer', '')}  {verdict}{torch_step}")
    return {"resume": rows}


def parity_cells(args) -> list:
    """The parity cells (verify/parity/section.py): the quick ones, or every one with --complete."""
    from ..parity import section as parity

    return in_sizes(parity.complete_cells() if args.complete else parity.quick_cells(), args)


def parity_listing(inv: Invocation) -> None:
    from ..parity import section as parity

    inv.say(f"parity: {len(parity_cells(inv.args))} cells over {len(parity.FAMILIES)} families")


def parity_run(inv: Invocation) -> dict:
    from ..parity import section as parity

    cells = parity_cells(inv.args)
    rows, inv_rows = parity.run_section(cells, timeout_s=inv.args.timeout, say=inv.say)
    return {"parity": rows, "parity_invariance": inv_rows}


def parity_tally(got: dict, timing: dict) -> str:
    return (
        f"parity: {passed(got['parity'])} cells passed, "
        f"{passed(got['parity_invariance'])} digest groups, {timing['parity_s']} s"
    )


def parity_markdown(got: dict) -> str:
    from ..parity.section import markdown

    return markdown(got["parity"], got["parity_invariance"])


def mp_plan(args) -> tuple[list, list]:
    """(cells of verify/mp/cells.py, operator cells of verify/mp/lockstep.py): the quick ones,
    or every one with --complete."""
    from ..mp import cells as mp_cells
    from ..mp import lockstep as mp_lockstep

    cells = mp_cells.complete_cells() if args.complete else mp_cells.quick_cells()
    ops = mp_lockstep.complete_cells() if args.complete else mp_lockstep.quick_cells()
    return in_sizes(cells, args), in_sizes(ops, args)


def mp_listing(inv: Invocation) -> None:
    cells, ops = mp_plan(inv.args)
    inv.say(f"mp: {len(cells)} cells, {len(ops)} operator cells against N_m = 1")


def mp_run(inv: Invocation) -> dict:
    """ZeRO in the DP group of each tensor-parallel slice against reference/mp.py (verify/mp/
    cells.py), and N_m > 1 against N_m = 1 (verify/mp/lockstep.py)."""
    from ..mp import cells as mp_cells
    from ..mp import lockstep as mp_lockstep

    cells, ops = mp_plan(inv.args)
    rows, inv_rows = mp_cells.run_section(cells, timeout_s=inv.args.timeout, say=inv.say)
    operators = mp_lockstep.run_section(ops, timeout_s=inv.args.timeout, say=inv.say)
    return {"mp": rows, "mp_invariance": inv_rows, "mp_operators": operators}


def mp_tally(got: dict, timing: dict) -> str:
    return (
        f"mp: {passed(got['mp'])} cells passed, {passed(got['mp_invariance'])} digest groups, "
        f"{passed(got['mp_operators'])} operator cells against N_m = 1, {timing['mp_s']} s"
    )


def mp_markdown(got: dict) -> str:
    from ..mp.cells import markdown
    from ..mp.lockstep import markdown as operators_markdown

    return markdown(got["mp"], got["mp_invariance"]) + operators_markdown(got["mp_operators"])


def watchdog_run(inv: Invocation) -> dict:
    """A diverging rank must be named, the right one, on every rank
    (verify/faults/watchdog_cells.py)."""
    from ..faults import watchdog_cells

    cells = in_sizes(watchdog_cells.CELLS, inv.args)
    inv.say("watchdog (some ranks diverge; every rank must name them, or all ranks at a tie):")
    if launch.under_torchrun():  # the section says in one line why it skips
        rows = watchdog_cells.run_section(timeout_s=inv.args.timeout, say=inv.say, cells=cells)
        return {"watchdog": rows}
    return {"watchdog": [r for c in cells for r in watchdog_cell(c, inv.args.timeout, inv.say)]}


def watchdog_cell(cell, timeout_s: float, say) -> list[dict]:
    """One watchdog cell's row; a failing row naming it when its world raised (guarded)."""
    from ..faults import watchdog_cells

    def failed(row: dict) -> list[dict]:
        say(f"  {cell.label:<56} FAIL raised {row['error']}")
        return [{"cell": cell.label, "message": f"raised {row['error']}", **row}]

    run = functools.partial(watchdog_cells.run_section, timeout_s=timeout_s, say=say, cells=[cell])
    return guarded(cell.label, run, wrap=failed)


def watchdog_tally(got: dict, timing: dict) -> str:
    return f"watchdog: {passed(got['watchdog'])} cells passed"


def refusals_listing(inv: Invocation) -> None:
    from ..refusals import section as refusals

    inv.say(refusals.count_line())


def refusals_run(inv: Invocation) -> dict:
    """Each row's bad input or damaged checkpoint must raise its named error saying its named
    text (verify/refusals/section.py)."""
    from ..refusals import section as refusals

    args = inv.args
    rows = refusals.run_section(timeout_s=args.timeout, say=inv.say, world_sizes=args.world_sizes)
    return {"refusals": rows}


def refusals_tally(got: dict, timing: dict) -> str:
    return f"refusals: {passed(got['refusals'])} rows passed, {timing['refusals_s']} s"
