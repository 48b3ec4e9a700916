"""Feature interactions as a covered dimension: every pair of features whose combination takes a
code path of its own, and which cells, resume rows or sections run it.

A covering array reaches every pair of *values* of the matrix's dimensions (verify/matrix.py),
but the options outside them (frozen parameters, unused parameters, dropout, release_grads,
contiguous memory, offload, the watchdog, model parallelism) meet only where some cell puts them
together. PAIRS lists those meetings: each row names the two features, the path the pair takes
that neither takes alone, and where it is run, as a predicate on that place's plan:
  cells     verify's cells (verify/cell.py)                  python -m verify --quick
  resume    the resume cases (verify/resume.py)              python -m verify --quick --resume
  mp        the model-parallel cells and checkpoint rows     python -m verify --quick --resume
  watchdog  the watchdog cells (verify/watchdog_cells.py)    python -m verify --quick
  gpu       a test that needs a CUDA device (tests/gpu/)     make test-gpu
`python -m verify --list` prints, per pair, the items of the plan that cover it (CELLS holds the
cells added for that reason); tests/unit/test_verify_interactions.py checks that the --quick
plan covers every pair but the GPU's. Each pair added here has a planted bug that only it can
show (verify/planted.py, the rows whose `where` names the pair).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .cell import Cell


@dataclass(frozen=True)
class Pair:
    features: str  # "A × B"
    path: str  # the code path the pair takes that neither feature takes alone
    where: str  # "cells", "resume", "mp", "watchdog" or "gpu"
    covers: Callable  # predicate on one item of that place's plan


def _cell(c) -> Cell | None:
    return c if isinstance(c, Cell) else None


PAIRS = (
    Pair("frozen × stage 3", "frozen buffers sharded, gathered in forward and backward",
         "cells", lambda c: c.model == "mlp-frozen" and c.stage == 3),
    Pair("frozen × meta device", "frozen units materialised unit by unit",
         "cells", lambda c: c.model == "mlp-frozen" and c.meta),
    Pair("frozen × save at stage 1-2, N >= 2", "frozen buffers saved whole by rank 0, beside "
         "sharded masters", "resume",
         lambda r: r.model == "mlp-frozen" and r.s1 in (1, 2) and r.n1 >= 2),
    Pair("frozen × save at stage 3", "frozen shards saved by every rank, resharded on load",
         "resume", lambda r: r.model == "mlp-frozen" and r.s1 == 3),
    Pair("unused × stage 3", "ranks agree on which units ran before the reduction",
         "cells", lambda c: c.model == "mlp-skip" and c.stage == 3),
    Pair("unused × one unit of several parameters", "the optimizer's runs cut inside a unit",
         "cells", lambda c: c.model in ("mlp-branch", "mlp-skip") and c.units == "huge"),
    Pair("unused × one parameter group × one unit", "a run of one group spans parameters of "
         "different step counts", "cells",
         lambda c: c.model in ("mlp-branch", "mlp-skip") and c.units == "huge"
         and c.groups == "one"),
    Pair("dropout × N >= 2", "masks drawn per micro-batch from (seed, data step, j), not rank",
         "cells", lambda c: c.model == "gpt-dropout" and c.world_size >= 2),
    Pair("dropout × stage 3", "masks drawn while units are gathered and freed",
         "cells", lambda c: c.model == "gpt-dropout" and c.stage == 3),
    Pair("release_grads × checkpointing", "buffers allocated again during recomputation",
         "cells", lambda c: bool(c.release_grads) and c.checkpointing),
    Pair("release_grads × contiguous_memory", "arena views kept, never released",
         "cells", lambda c: bool(c.release_grads) and c.contiguous),
    Pair("release_grads × offload_optimizer, stage 0-1", "the device buffer released, the host "
         "copy kept", "cells", lambda c: bool(c.release_grads) and c.offload and c.stage <= 1),
    Pair("release_grads × offload_optimizer, stage 2-3", "host shards kept, never released",
         "cells", lambda c: bool(c.release_grads) and c.offload and c.stage >= 2),
    Pair("checkpointing × offload", "checkpoints kept in host memory (P_a+cpu's path on one "
         "rank)", "cells", lambda c: c.checkpointing and c.offload),
    Pair("contiguous × checkpointing", "the checkpoint arena", "cells",
         lambda c: c.contiguous and c.checkpointing),
    Pair("contiguous × offload", "the host gradient arena", "cells",
         lambda c: c.contiguous and c.offload),
    Pair("offload × fast mode, stage 2-3", "the running sum of reduced shards on the host",
         "cells", lambda c: c.offload and c.mode == "fast" and c.stage >= 2),
    Pair("C_B × stage 2-3", "pieces filled straight from the parameters' gradients",
         "cells", lambda c: c.bucket_elements is not None and c.stage >= 2),
    Pair("persist_below × fast mode", "stage 3's whole units all-reduced", "cells",
         lambda c: c.persist_below > 0 and c.mode == "fast"),
    Pair("fp16 × loss scale < 1/M", "R checked for overflow itself", "cells",
         lambda c: c.precision == "fp16" and c.loss_scale is not None and c.loss_scale < 1),
    Pair("buffers × N >= 2", "rank 0's buffers broadcast before every forward", "cells",
         lambda c: c.model == "mlp-bn" and c.world_size >= 2),
    Pair("buffers × resume", "buffers saved from rank 0, loaded on every rank", "resume",
         lambda r: r.model == "mlp-bn"),
    Pair("offload × resume", "master and states saved from host memory and loaded into it",
         "resume", lambda r: r.offload),
    Pair("disk tier × stage 2-3", "the reduced shard in host memory, its states in files",
         "cells", lambda c: c.disk and c.stage >= 2),
    Pair("disk tier × fast mode", "the host running sum beside state files", "cells",
         lambda c: c.disk and c.mode == "fast"),
    Pair("disk tier × resume", "saved from state files, resharded into them", "resume",
         lambda r: getattr(r, "disk", False)),
    Pair("MP × P_a+cpu", "activation parts on the host, gathered over the MP group", "mp",
         lambda m: getattr(m, "p_a", None) == "cpu"),
    Pair("MP × offload_optimizer", "sliced masters in host memory", "mp",
         lambda m: "offload_optimizer" in getattr(m, "extra", ())),
    Pair("MP × contiguous_memory", "sliced gradients in arenas", "mp",
         lambda m: "contiguous_memory" in getattr(m, "extra", ())),
    Pair("MP × plain checkpoint", "a plain checkpoint cut into slices on load", "mp",
         lambda m: isinstance(m, str) and m.startswith("plain ")),
    Pair("MP checkpoint × plain engine", "slices joined on load", "mp",
         lambda m: isinstance(m, str) and m.endswith("-> plain 2")),
    Pair("MP checkpoint × N_m = 1", "slices joined, cut for one slice", "mp",
         lambda m: isinstance(m, str) and m.endswith("x1")),
    Pair("watchdog × a tie", "no strict majority: every rank named", "watchdog",
         lambda w: w.fault not in ("extra_backward", "skipped_step")
         and 2 * len(w.ranks) == w.world_size),
    Pair("watchdog × a majority", "the ranks outside it named", "watchdog",
         lambda w: 2 * len(w.ranks) < w.world_size and w.world_size > 2),
    Pair("P_a+cpu × a CUDA device", "the parts in pinned host memory, the rest on the device",
         "gpu", lambda t: t == "tests/gpu/test_p_a_placement.py"),
)  # fmt: skip

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
    # dropout at N = 2 and N = 4 (M > N: micro-steps draw different masks), stages 1 and 3
    _branch(stage=1, precision="fp32", optimizer="adamw", model="gpt-dropout", seed=6300),
    _branch(stage=3, precision="bf16", optimizer="adam", model="gpt-dropout", world_size=4,
            accumulation=1, steps=2, seed=6301),
    # unused parameters in one unit under one group: runs span used and unused parameters
    _branch(stage=1, precision="fp32", optimizer="adam", model="mlp-branch", units="huge",
            groups="one", seed=6302),
    _branch(stage=3, precision="bf16", optimizer="adamw", model="mlp-skip", units="huge",
            groups="one", seed=6303),
    # release_grads with contiguous memory (arena views stay) and with offload (host shards stay
    # at stages 2-3; the device buffer goes at stages 0-1)
    _branch(stage=0, precision="bf16", optimizer="adam", contiguous=True, release_grads=True,
            seed=6304),
    _branch(stage=2, precision="fp32", optimizer="adamw", contiguous=True, checkpointing=True,
            release_grads=True, seed=6305),
    _branch(stage=1, precision="bf16", optimizer="adamw", offload=True, release_grads=True,
            seed=6306),
    _branch(stage=3, precision="fp32", optimizer="sgd", offload=True, release_grads=True,
            seed=6307),
)  # fmt: skip
"""The cells added for the pairs no other cell covered; in --quick and --complete."""

OBSERVABLE = {
    "dropout_mask_per_micro_step": lambda c: c.model == "gpt-dropout" and c.world_size >= 2,
    "runs_cut_on_use_only": lambda c: (
        c.model in ("mlp-branch", "mlp-skip") and c.units == "huge" and c.groups == "one"
        and c.mode == "deterministic" and c.optimizer in ("adam", "adamw")
    ),
    "release_arena_views": lambda c: bool(c.release_grads) and c.contiguous,
    "release_host_shards": lambda c: bool(c.release_grads) and c.offload and c.stage >= 2,
    # the released buffers are compared after the last step (verify.expect.expected_released)
    "release_ignored": lambda c: (
        bool(c.release_grads) and not c.contiguous and not (c.offload and c.stage >= 2)
    ),
}  # fmt: skip
"""Where each pair's planted bug (verify/plants.py) must show: verify.matrix.OBSERVABLE's rows."""
