"""Feature interactions as a covered dimension: every pair of features whose combination takes a
code path of its own, and which cells, resume rows or sections run it.

A covering array reaches every pair of *values* of the matrix's dimensions (verify/cells/matrix.py),
but the options outside them (frozen parameters, unused parameters, dropout, release_grads,
contiguous memory, offload, the watchdog, model parallelism) meet only where some cell puts them
together. PAIRS lists those meetings: each row names the two features, the path the pair takes
that neither takes alone, and where it is run, as a predicate on that place's plan:
  cells     verify's cells (verify/cells/cell.py)                  python -m verify --quick
  resume    the resume cases (verify/checkpoints/resume.py)              python -m verify --quick
  --resume
  mp        the model-parallel cells and checkpoint rows     python -m verify --quick --resume
  watchdog  the watchdog cells (verify/faults/watchdog_cells.py)    python -m verify --quick
  gpu       a test that needs a CUDA device (tests/gpu/)     make test-gpu
`python -m verify --list` prints, per pair, the items of the plan that cover it (CELLS holds the
cells added for that reason); tests/unit/test_verify_interactions.py checks that the --quick
plan covers every pair but the GPU's. A feature of the registry (verify/features/) declares its
own pairs, cells and planted bugs in its record; PAIRS holds the pairs of what is not a
registered feature (unused parameters, buffers, persist_below, the loss scale, the watchdog, a
CUDA device) and appends every feature's. Each pair has a planted bug that only it can show
where one exists (verify/planted/suite.py, the rows whose `where` names the pair).
"""

from __future__ import annotations

from .. import features
from ..features import Pair
from .cell import Cell


def _cell(c) -> Cell | None:
    return c if isinstance(c, Cell) else None


PAIRS = (
    Pair("unused × stage 3", "ranks agree on which units ran before the reduction",
         "cells", lambda c: c.model == "mlp-skip" and c.stage == 3),
    Pair("unused × one unit of several parameters", "the optimizer's runs cut inside a unit",
         "cells", lambda c: c.model in ("mlp-branch", "mlp-skip") and c.units == "huge"),
    Pair("unused × one parameter group × one unit", "a run of one group spans parameters of "
         "different step counts", "cells",
         lambda c: c.model in ("mlp-branch", "mlp-skip") and c.units == "huge"
         and c.groups == "one"),
    Pair("persist_below × fast mode", "stage 3's whole units all-reduced", "cells",
         lambda c: c.persist_below > 0 and c.mode == "fast"),
    Pair("fp16 × loss scale < 1/M", "R checked for overflow itself", "cells",
         lambda c: c.precision == "fp16" and c.loss_scale is not None and c.loss_scale < 1),
    Pair("buffers × N >= 2", "rank 0's buffers broadcast before every forward", "cells",
         lambda c: c.model == "mlp-bn" and c.world_size >= 2),
    Pair("buffers × resume", "buffers saved from rank 0, loaded on every rank", "resume",
         lambda r: r.model == "mlp-bn"),
    Pair("watchdog × a tie", "no strict majority: every rank named", "watchdog",
         lambda w: w.fault not in ("extra_backward", "skipped_step")
         and 2 * len(w.ranks) == w.world_size),
    Pair("watchdog × a majority", "the ranks outside it named", "watchdog",
         lambda w: 2 * len(w.ranks) < w.world_size and w.world_size > 2),
    Pair("P_a+cpu × a CUDA device", "the parts in pinned host memory, the rest on the device",
         "gpu", lambda t: t == "tests/gpu/test_p_a_placement.py"),
)  # fmt: skip
PAIRS += tuple(features.pairs())  # each feature's own (verify/features/)

GPU_TESTS = ("tests/gpu/test_p_a_placement.py",)
"""The GPU half of the plan: tests that need a CUDA device (skipped without one)."""


def covering(pairs, plans: dict[str, list]) -> list[tuple[Pair, list[int]]]:
    """Each pair with the indices of the items of its place's plan that cover it."""
    out = []
    for pair in pairs:
        items = plans.get(pair.where, [])
        out.append((pair, [i for i, x in enumerate(items) if _safe(pair.covers, x)]))
    return out


def _safe(pred, item) -> bool:
    """A predicate on an item of another kind (a row name where a cell is expected) is False."""
    try:
        return bool(pred(item))
    except (AttributeError, TypeError):
        return False


def lines(plans: dict[str, list]) -> list[str]:
    """verify --list's lines: per pair, where it runs and how many items cover it."""
    out = ["per feature pair (interactions):"]
    for pair, idx in covering(PAIRS, plans):
        if pair.where not in plans:
            shown = "   -  not in this plan"
        elif idx:
            shown = f"{len(idx):>4}  " + " ".join(f"#{i}" for i in idx[:8])
            shown += " …" if len(idx) > 8 else ""
        else:
            shown = "   0  NOT COVERED"
        out.append(f"  {pair.features:<46} {pair.where:<8} {shown}")
    return out


def _branch(**fields) -> Cell:
    base = {"world_size": 2, "accumulation": 2, "steps": 3, "mode": "deterministic"}
    return Cell(**{**base, **fields})


CELLS = (
    # unused parameters in one unit under one group: runs span used and unused parameters
    _branch(stage=1, precision="fp32", optimizer="adam", model="mlp-branch", units="huge",
            groups="one", seed=6302),
    _branch(stage=3, precision="bf16", optimizer="adamw", model="mlp-skip", units="huge",
            groups="one", seed=6303),
)  # fmt: skip
"""The cells added for the pairs no other cell covered; in --quick and --complete."""

OBSERVABLE = {
    "runs_cut_on_use_only": lambda c: (
        c.model in ("mlp-branch", "mlp-skip") and c.units == "huge" and c.groups == "one"
        and c.mode == "deterministic" and c.optimizer in ("adam", "adamw")
    ),
}  # fmt: skip
"""Where each pair's planted bug (verify/planted/plants.py) must show: rows of
verify.cells.observable's
OBSERVABLE."""
