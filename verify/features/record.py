"""The records of the feature registry (verify/features/__init__.py): a Feature, its planted
bugs (Bug) and the pairs it forms with other features (Pair).

A Feature holds everything verify knows about one option in one place: how a cell asks for it
(its name in Cell.features, with a value for the options that take one), what it sets in
ZeroConfig, which models it needs or builds, the cells and resume rows added for it, the
branches and feature pairs it opens, the bytes it moves that verify counts, and the bugs
planted to show that verify would see it broken. Every part is data or a small function of a
cell; the readers (verify/cells/, verify/planted/, verify/checkpoints/resume.py,
verify/checks/harness.py and `python -m verify --list`) loop over the registry and know no feature
by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CHECKS = ("structure", "state", "bound", "reported", "traffic", "memory", "start", "raised")
"""The harness's named checks (verify/checks/harness.py's Verdict): the engine's units and groups,
its state bit for bit, the fast-mode bounds, what it reported, the collectives and disk bytes
it counted, what it holds resident, what it found at its start (a dead run's leftovers), and
an exception. A resume row's checks (verify/checkpoints/resume.py) are "state" and
"consolidation"."""
RESUME_CHECKS = ("state", "consolidation", "raised")


@dataclass(frozen=True)
class Pair:
    """Two features whose meeting takes a code path of its own (verify/cells/interactions.py)."""

    features: str  # "A × B"
    path: str  # the code path the pair takes that neither feature takes alone
    where: str  # "cells", "resume", "mp", "watchdog" or "gpu"
    covers: Callable  # predicate on one item of that place's plan


@dataclass(frozen=True, kw_only=True)
class Bug:
    """One planted bug (verify/planted/suite.py): a patch of the library that verify must report."""

    name: str
    breaks: str
    """What it breaks, in one line."""
    where: str
    """Where it is observable, in words (the summary of `observable`)."""
    plant: Callable
    """plant(p: verify.planted.plants.Patch) patches the library; the Patch undoes it."""
    observable: Callable
    """Predicate on a --quick cell (kind "cells") or a resume case (kind "resume"): where the
    bug must show."""
    check: str
    """The check that must catch it (CHECKS; RESUME_CHECKS for kind "resume"): a row caught
    only by another check, or only by raising, is a miss. "state" means the bits in a
    deterministic cell, and the derived bounds ("bound") or the bits in a fast one."""
    kind: str = "cells"
    why_raise: str = ""
    """For check="raised": why an exception is the right catch (nothing to observe first)."""

    def __post_init__(self):
        allowed = RESUME_CHECKS if self.kind == "resume" else CHECKS
        if self.kind not in ("cells", "resume"):
            raise ValueError(f"bug {self.name}: kind={self.kind!r}; allowed 'cells', 'resume'")
        if self.check not in allowed:
            raise ValueError(f"bug {self.name}: check={self.check!r}; allowed are {allowed}")
        if (self.check == "raised") != bool(self.why_raise):
            raise ValueError(f"bug {self.name}: check='raised' needs why_raise, and only it")


@dataclass(frozen=True, kw_only=True)
class Feature:
    """One option verify checks, declared once."""

    name: str
    """Its name in Cell.features and ResumeCase.features; "name=value" where it takes one."""
    doc: str
    """One line: what it is, in the paper's or the engine's words."""
    config: Callable
    """config(value) -> the ZeroConfig fields it sets (value: True, or the parsed value)."""
    parse: Callable | None = None
    """For a feature with a value ("bucket_elements=256"): str -> value; None: a flag."""
    absent: object = False
    """What `cell.<name>` reads where the cell does not ask for it."""
    needs: Callable | None = None
    """needs(cell) -> "" or why this cell cannot have it (the Cell's error names the feature)."""
    models: dict | None = None
    """A feature that changes the model: {base model key: build(device=None)}; the model's
    micro-batches stay the base model's."""
    quick: tuple = ()
    """Cells added for it, in --quick and --complete: dicts of Cell fields over the defaults
    of verify.cells.matrix.branch_cell (N = 2, M = 2N, 3 steps, deterministic)."""
    complete: tuple = ()
    """Cells added for it in --complete only."""
    resume: tuple = ()
    """Resume rows (verify/checkpoints/resume.py): (world sizes the run must include, ResumeCase
    fields)."""
    branches: dict | None = None
    """{branch in words: predicate on a cell}: what `verify --list` shows covered."""
    pairs: tuple = ()
    """Its pairs with other features (Pair)."""
    bugs: tuple = ()
    """Its planted bugs (Bug)."""
    traffic: Callable | None = None
    """traffic(ref_config, spec, n, skipped) -> (counter kind, {"op:u<unit>": elements}): the
    bytes it moves that the engine's counter records, expected in every cell (an empty dict
    where the config does not ask for it, so that a cell without it that moves some fails)."""
    checkpoint: object | None = None
    """A checkpoint format of its own, for resume rows: an object with save(engine, directory),
    load(engine, directory) and consolidated(case, directory) -> the dict
    zero.checkpoint.consolidate returns, read as plain PyTorch reads the format (None: the
    native format)."""
    section: str = ""
    """A feature verified in a section of its own (e.g. "mp": python -m verify --mp) rather
    than in cells: a Cell refuses it by name."""
    arrange: Callable | None = None
    """arrange(rank, config) before the engine is built -> a check returning "" or what the
    engine's start left undone; None where nothing is arranged. Its failure is the "start"
    check."""

    def __post_init__(self):
        for bug in self.bugs:
            if not isinstance(bug, Bug):
                raise TypeError(f"feature {self.name}: bugs holds {bug!r}, not a Bug")
