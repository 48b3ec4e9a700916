"""Planted bugs: deliberately broken engines that verify must report failing.

    python -m verify.planted                         # every bug on every observable cell
    python -m verify.planted --cheap                 # the two cheapest cells per bug
    python -m verify.planted --bugs one_ulp shard_offset --json p.json --markdown p.md

Each bug (BUGS) is a name, one line on what it breaks, where it shows, and a plant function
(verify/plants.py: plant_<name>) that patches the library through a Patch (undone afterwards),
never touching the library's own code path when not planted. A bug of kind "cells" runs on the
--quick cells where verify.matrix.OBSERVABLE says it is observable ([Note: observable] there),
a bug of kind "resume" on the --resume rows where RESUME_OBSERVABLE says so. Every such cell or row
must fail; the same cells pass unpatched in `python -m verify --quick --resume`. A bug that no
--quick cell can catch is a bug in the preset (verify/matrix.py's PLANTED_GAPS holds the cells added
for that reason). It prints the table (--markdown writes it); docs/verification.md holds the last
full run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import matrix, plants
from . import resume as resume_mod
from .cell import Cell
from .harness import run_cells
from .plants import Patch
from .report import merge


@dataclass(frozen=True, kw_only=True)
class Bug:
    """One planted bug."""

    breaks: str
    """What it breaks, in one line (the table's second column)."""
    where: str
    """Where it is observable, in words (the predicate's summary)."""
    plant: Callable[[Patch], None]
    """Patches the library; Patch undoes it."""
    kind: str = "cells"
    """'cells': run on --quick cells (matrix.OBSERVABLE); 'resume': on --resume rows."""


_TABLE = (
    # name, what it breaks, where it is observable, kind (the plant: plants.plant_<name>)
    ("one_ulp", "one master element on rank N-1 one ULP off",
     "deterministic, N ≥ 2", "cells"),
    ("shard_offset", "ranks >= 1 take their shard one element early",
     "deterministic, N ≥ 2, stage ≥ 1", "cells"),
    ("one_over_n_for_m", "averages by 1/(S·N), not 1/(S·M)",
     "deterministic, M > N, clipping off", "cells"),
    ("bias_correction_t_minus_1", "Adam's bias corrections use step t-1",
     "deterministic, Adam(W), two optimizer steps", "cells"),
    ("reduce_order", "reduce-scatter sums in ring order, not the tree T",
     "deterministic, N ≥ 3, fp32 or widely spread gradients", "cells"),
    ("stale_prefetch", "stage 3: a prefetched unit keeps its previous gather",
     "stage 3, overlap, real forward, tiny units", "cells"),
    ("overflow_one_rank", "ranks 1..N-1 ignore the agreed overflow flag",
     "stage 0, non-finite gradients", "cells"),
    ("loss_m_over_n", "the reported loss is M/N times the mean",
     "M > N (any mode)", "cells"),
    ("extra_all_gather_stage3", "stage 3 gathers one unit too many per step",
     "stage 3 (counted collectives)", "cells"),
    ("decay_on_biases", "the engine's grouping decays every parameter",
     "every cell (groups compared)", "cells"),
    ("decay_rule_vectors", "zero.config.decay_matrices_only decays biases and norms too",
     "every cell (groups against verify/expect.py's table)", "cells"),
    ("uncapped_clip", "clip coefficient not capped at 1 (norm below the limit)",
     "clipping on some steps only (BRANCHES)", "cells"),
    ("unchecked_reduced_overflow", "R unchecked for overflow when S < 1/M",
     "loss scale < 1/M, overflow in R only", "cells"),
    ("extra_partial_sum", "the streaming tree keeps one partial-sum shard too many",
     "deterministic (resident bytes)", "cells"),
    ("half_width_pieces", "C_B pieces half as wide as allowed",
     "bucket_elements set (reduce-scatter calls)", "cells"),
    ("fast_norm_misreported", "fast mode reports its norm 1e-6 too large",
     "fast mode (norm bitwise against the pinned order)", "cells"),
    ("t_advances_on_skip", "a skipped step counts as an optimizer step",
     "a skipped step", "cells"),
    ("unused_updated", "a parameter no micro-batch had a gradient for is updated with zeros",
     "a model with a branch whole steps skip", "cells"),
    ("frozen_drift", "a frozen parameter moves by one ULP per step",
     "a model with frozen parameters", "cells"),
    # the features: ZeRO-R, offload, prefetch, C_B, scaler, clipping, groups, data, model
    ("microbatch_rank_major", "rank r runs micro-batch r·K + k, not k·N + r",
     "deterministic, backward, N ≥ 2, M > N, fp32", "cells"),
    ("clip_first_unit_only", "clipping (norm above the limit) scales the first unit only",
     "deterministic, tiny units, steps that clip", "cells"),
    ("scaler_backoff_quarter", "the loss scaler backs off by 1/4, not 1/2",
     "fp16 with a skipped step", "cells"),
    ("group_run_boundary", "a group's first element gets the previous group's hypers",
     "deterministic, a group starting inside a shard", "cells"),
    ("arena_slots_overlap", "M_D checkpoint arena: consecutive slots overlap",
     "deterministic, contiguous memory + checkpointing", "cells"),
    ("offload_grad_one_late", "offload: the host gradient is one copy behind",
     "optimizer offload, two optimizer steps", "cells"),
    ("offloaded_checkpoints_rounded", "offloaded activation checkpoints kept in bf16",
     "deterministic, checkpointing + offload, fp32/fp16", "cells"),
    ("prefetch_wrong_unit", "stage 3 backward prefetches the unit just done",
     "stage 3, overlap, real forward, tiny units", "cells"),
    ("persist_threshold_off_by_one", "stage 3 persists numel < persist_below, not <=",
     "stage 3, a unit of exactly persist_below (PLANTED_GAPS)", "cells"),
    ("piece_drops_boundary", "C_B: each piece's last column is not reduced",
     "deterministic, bucket_elements set", "cells"),
    ("model_scales_input_in_place", "model code: the MLP halves its input in place",
     "the MLP's own backward in fp32", "cells"),
    # feature pairs (verify/interactions.py): each only where the two meet
    ("dropout_mask_per_micro_step", "dropout seeded by micro-step, not j = k·N + r",
     "dropout × N ≥ 2 (interactions)", "cells"),
    ("runs_cut_on_use_only", "optimizer runs not cut where t_p changes",
     "unused × one group × one unit (interactions)", "cells"),
    ("release_arena_views", "release_grads releases contiguous arena views",
     "release_grads × contiguous_memory (interactions)", "cells"),
    ("release_host_shards", "release_grads releases offload's host shards",
     "release_grads × offload, stage 2-3 (interactions)", "cells"),
    ("release_ignored", "release_grads=True keeps every gradient buffer",
     "release_grads, outside arenas and host shards", "cells"),
    ("frozen_saved_from_start", "a whole frozen buffer saved from its start on every rank",
     "frozen × a save at stage 0-2, N ≥ 2 (interactions)", "resume"),
    ("disk_mapped_private", "the disk tier's state files mapped copy-on-write",
     "the disk tier, two optimizer steps", "cells"),
    ("load_scaler_fresh", "load restores everything but the loss scaler",
     "fp16 resume rows", "resume"),
    ("consolidate_swaps_moments", "consolidation swaps exp_avg and exp_avg_sq",
     "Adam(W) resume rows (consolidation)", "resume"),
)  # fmt: skip
BUGS: dict[str, Bug] = {
    name: Bug(breaks=breaks, where=where, plant=getattr(plants, f"plant_{name}"), kind=kind)
    for name, breaks, where, kind in _TABLE
}
"""The planted bugs by name, in the order of the table."""


RESUME_OBSERVABLE: dict[str, Callable] = {
    # the scaler is compared after the resume; only fp16 has one
    "load_scaler_fresh": lambda case: case.precision == "fp16",
    # frozen buffers held whole when saved (stages 0-2) on N >= 2 ranks: the loaded values
    # are compared with the saving run's
    "frozen_saved_from_start": lambda case: (
        case.model == "mlp-frozen" and case.s1 <= 2 and case.n1 >= 2
    ),
    # the consolidated states are compared with the engine's bit for bit; Adam and AdamW only
    "consolidate_swaps_moments": lambda case: case.optimizer in ("adam", "adamw"),
}


def observable(name: str, *, quick=None) -> list:
    """The --quick cells (or --resume quick cases) where bug `name` must show."""
    if BUGS[name].kind == "resume":
        return [c for c in resume_mod.resume_cases(quick=True) if RESUME_OBSERVABLE[name](c)]
    cells = quick if quick is not None else matrix.quick()[0]
    return [c for c in cells if matrix.OBSERVABLE[name](c)]


def cost(c) -> int:
    """A rough cost to pick the cheapest cells (ranks · micro-batches · steps; forward 4x)."""
    if isinstance(c, Cell):
        return c.world_size * c.micro_batches * c.steps * (4 if c.gradients == "backward" else 1)
    return c.n1 + c.n2 + 8 * (c.model == "gpt")


def run_planted(rank: int, n: int, bug: str, cells: list[Cell]) -> list[dict]:
    """On every rank: run_cells with the bug planted (a pool worker's entry point)."""
    with Patch() as p:
        BUGS[bug].plant(p)
        return run_cells(rank, n, cells)


def planted_resume_rank(rank: int, n: int, *args, bug: str):
    """verify.resume.run_rank with the bug planted (a pool worker's entry point)."""
    with Patch() as p:
        BUGS[bug].plant(p)
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
        for case in chosen:
            with tempfile.TemporaryDirectory(prefix="zero-planted-") as tmp, Patch() as p:
                BUGS[name].plant(p)  # in this process too: consolidation runs here
                try:
                    rows.append(resume_mod.run_case(case, tmp, timeout_s=timeout_s, rank_fn=runner))
                except Exception as exc:  # a broken run is a caught bug, reported as raised
                    first = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    rows.append(
                        {
                            "passed": False,
                            "first_mismatch": first,
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


def run(bugs=None, *, cheap: bool = False, say=print) -> list[dict]:
    """One summary per bug: {bug, breaks, kind, observable, ran, caught, first_check,
    first_mismatch, seconds, missed}. cheap: the two cheapest observable cells per bug."""
    quick = matrix.quick()[0]
    out = []
    for name in bugs or list(BUGS):
        every = observable(name, quick=quick)
        chosen = sorted(every, key=cost)[:2] if cheap else every
        started = time.perf_counter()
        rows = run_bug(name, chosen) if chosen else []
        caught = [r for r in rows if not r["passed"]]
        summary = {
            "bug": name,
            "breaks": BUGS[name].breaks,
            "kind": BUGS[name].kind,
            "observable": len(every),
            "ran": len(rows),
            "caught": len(caught),
            "first_check": check_of(caught[0]) if caught else "",
            "first_mismatch": caught[0].get("first_mismatch", "") if caught else "",
            "missed": [r["config"] for r in rows if r["passed"]],
            "seconds": round(time.perf_counter() - started, 1),
        }
        say(f"{name:<32} caught {summary['caught']}/{summary['ran']} "
            f"(observable {len(every)})  {summary['first_check']}: "
            f"{summary['first_mismatch'][:90]}")  # fmt: skip
        out.append(summary)
    return out


def markdown(summaries: list[dict]) -> str:
    """The table of a run: bug | breaks | observable where | caught / observable | first check."""
    lines = [
        "| planted bug | what it breaks | observable where | caught / observable | first check |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        where = "`--resume` rows" if s["kind"] == "resume" else "`--quick` cells"
        count = f"{s['caught']}/{s['observable']} {where}"
        if s["ran"] != s["observable"]:
            count = f"{s['caught']}/{s['ran']} run ({s['observable']} observable {where})"
        lines.append(
            f"| `{s['bug']}` | {s['breaks']} | {BUGS[s['bug']].where} | {count} "
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
