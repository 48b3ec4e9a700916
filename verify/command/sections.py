"""The sections of python -m verify, as one table: TABLE, in the order they run and report.

Each Section names its options (added to the command line in this order, after the selection
options), whether --quick and --complete include it, whether its option runs it alone, whether it
computes on the CPU only, and its functions (verify/command/section_runs.py): the run, its --list
lines, the line said when it is done, its closing summary lines and its Markdown. Adding a
section is one entry here; python -m verify (verify/__main__.py) runs the table:

    for section in TABLE:
        run(section, invocation, report)

Which sections an invocation runs (chosen): the matrix always (with no cells when a section runs
alone, so that the report still has its keys); any other when its option asks for it (--resume,
--parity, --mp), not when its --no- option leaves it out (--no-mp); otherwise not when an option
runs a section alone (--parity, --mp), else when the preset given (--quick, --complete) includes
it. A chosen section that computes on the CPU is skipped on a GPU (--device cuda), saying so in
one line. With --list, a section with --list lines says them instead of running; the others say
nothing."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..cells.run import Where
from ..checks.report import SECTIONS, section
from . import section_runs as runs


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line option of a section (argparse's add_argument)."""

    name: str
    help: str
    action: Any = "store_true"
    default: Any = False

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def add(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.name, action=self.action, default=self.default, help=self.help)


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of python -m verify: what chooses it, what it runs and how it reports."""

    name: str
    """Its name: in "errors" when it raises as a whole, and its timing key (NAME_s)."""
    run: Callable[[runs.Invocation], dict]
    """Its work: a dict of the report keys it fills, in the order the JSON report writes them."""
    keys: tuple[str, ...]
    """The report keys holding its rows: every row counts for the exit status."""
    flag: Flag | None = None
    """The option that asks for it (and leaves it out, as --mp's --no-mp): None if none."""
    options: tuple[Flag, ...] = ()
    """Its other options (before `flag` on the command line)."""
    quick: bool = False
    """Whether --quick includes it."""
    complete: bool = False
    """Whether --complete includes it."""
    always: bool = False
    """Whether every invocation runs it (the matrix: with no cells when a section runs alone)."""
    alone: bool = False
    """Whether its option runs it alone: no matrix cells, none of the presets' sections."""
    cpu: bool = True
    """Whether it computes on the CPU only: on a GPU, skipped, saying so in one line."""
    timed: bool = False
    """Whether the report's timing records its seconds (NAME_s)."""
    listing: Callable[[runs.Invocation], None] | None = None
    """What --list says of it; None: --list says nothing of it."""
    tally: Callable[[dict, dict], str] | None = None
    """The line said when it is done, of what its run returned and the report's timing."""
    closing: Callable[[runs.Invocation, dict], list[str]] | None = None
    """Its lines in the closing summary, of the report."""
    markdown: Callable[[dict], str] | None = None
    """Its part of the Markdown report after verify.checks.report.markdown's, of what its run
    returned."""


TABLE: tuple[Section, ...] = (
    Section(
        "cells",
        runs.matrix_run,
        keys=("cells", "injected", "world_size_invariance"),
        options=(
            Flag("--invariance", "also run the world-size-invariance table (presets always do)"),
            Flag("--no-invariance", "skip the invariance table of a preset"),
        ),
        quick=True,
        complete=True,
        always=True,
        cpu=False,
        listing=runs.matrix_listing,
        closing=runs.matrix_closing,
    ),
    Section(
        "resume",
        runs.resume_run,
        keys=("resume",),
        flag=Flag("--resume", "add the resume/reshard table (verify/checkpoints/resume.py)"),
        closing=runs.passed_lines("resume"),
    ),
    Section(
        "parity",
        runs.parity_run,
        keys=("parity", "parity_invariance"),
        flag=Flag(
            "--parity",
            "only the parity-with-plain-PyTorch section (verify/parity/section.py): its quick "
            "cells, or every cell with --complete (the presets include it)",
        ),
        quick=True,
        complete=True,
        alone=True,
        timed=True,
        listing=runs.parity_listing,
        tally=runs.parity_tally,
        markdown=runs.parity_markdown,
    ),
    Section(
        "mp",
        runs.mp_run,
        keys=("mp", "mp_invariance", "mp_operators"),
        flag=Flag(
            "--mp",
            "the model-parallel section (verify/mp/cells.py): ZeRO in the DP group of each "
            "tensor-parallel slice against reference/mp.py; its quick cells, or every cell with "
            "--complete, and nothing else (as --parity); the presets include it, --no-mp leaves "
            "it out",
            action=argparse.BooleanOptionalAction,
            default=None,
        ),
        quick=True,
        complete=True,
        alone=True,
        timed=True,
        listing=runs.mp_listing,
        tally=runs.mp_tally,
        markdown=runs.mp_markdown,
    ),
    Section(
        "watchdog",
        runs.watchdog_run,
        keys=("watchdog",),
        quick=True,
        complete=True,
        tally=runs.watchdog_tally,
    ),
    Section(
        "refusals",
        runs.refusals_run,
        keys=("refusals",),
        quick=True,
        complete=True,
        timed=True,
        listing=runs.refusals_listing,
        tally=runs.refusals_tally,
    ),
)


def named(name: str) -> Section:
    """The table's section of this name."""
    return next(s for s in TABLE if s.name == name)


def add_options(parser: argparse.ArgumentParser) -> None:
    """Every section's options, in the table's order."""
    for s in TABLE:
        for flag in (*s.options, s.flag):
            if flag is not None:
                flag.add(parser)


def asked(s: Section, args) -> bool | None:
    """True when its option asks for it, False when its --no- option leaves it out, None when
    the option is not given (or the section has none): the presets decide."""
    if s.flag is None:
        return None
    value = getattr(args, s.flag.dest)
    return None if value == s.flag.default else value


def alone(args) -> bool:
    """Whether an option runs its section alone (--parity, --mp)."""
    return any(s.alone and asked(s, args) for s in TABLE)


def alone_on_cpu(args) -> str | None:
    """The option of a section that runs alone and computes on the CPU only, if one is given."""
    return next((s.flag.name for s in TABLE if s.alone and s.cpu and asked(s, args)), None)


def chosen(s: Section, args) -> bool:
    """Whether this invocation runs the section (the module docstring says how)."""
    if s.always:
        return True
    if (want := asked(s, args)) is not None:
        return want
    if alone(args):
        return False
    return bool((args.quick and s.quick) or (args.complete and s.complete))


def invocation(args, say) -> runs.Invocation:
    """This invocation: its options, `say` and the matrix's plan (section_runs.plan)."""
    lone = alone(args)
    cells, invariance_runs = runs.plan(args, lone)
    where = Where(args.backend, args.device)
    return runs.Invocation(args, say, cells, invariance_runs, where=where, alone=lone)


def run(s: Section, inv: runs.Invocation, report: dict) -> dict | None:
    """One section: what its run returned, written into the report, with its timing and its
    line; None when it is not chosen, is skipped on this device, is listed (--list) or raised
    as a whole (its failing row then in report["errors"], verify.checks.report.section)."""
    args, say = inv.args, inv.say
    if not chosen(s, args) or (args.list and s.listing is None):
        return None
    if s.cpu and args.device != "cpu":
        why = "it computes on the CPU; --device cpu runs it"
        say(f"({s.name} skipped on device {args.device}: {why})")
        return None
    if args.list:
        return s.listing(inv)
    t0 = time.time()
    got = section(report, s.name, lambda: s.run(inv))
    if got is None:
        return None
    report.update(got)
    if s.timed:
        report["timing"][f"{s.name}_s"] = round(time.time() - t0, 1)
    if s.tally is not None:
        say(s.tally(got, report["timing"]))
    return got


def row_keys() -> tuple[str, ...]:
    """Every report key that holds rows: verify.checks.report's and the table's."""
    return tuple(dict.fromkeys((*SECTIONS, *(k for s in TABLE for k in s.keys))))
