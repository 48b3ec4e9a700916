"""Running a verification plan: cells batched per world size, then the invariance table.

`run_matrix(cells, runs)` is what `python -m verify` and notebooks/05_verification.ipynb call. Each
world size's cells go to one long-lived worker pool in one call (zero.ranks.local.get_pool), so a
world starts once per run; under torchrun only the launched world's cells run. A world that dies (a
rank raising outside a cell, or a hang that the pool's timeout ends) fails all its cells with the
reason, and the run goes on with the next world. `where` (a Where: backend and device) says what
kind of pool runs them, e.g. gloo ranks sharing one GPU; None: gloo on the CPU, or torchrun's
default world. Every cell, world and section runs through verify.checks.report.guarded: what raises
fails its rows, named, with the error ([Note: a row that raised]), and the run goes on."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..checks.harness import run_cells
from ..checks.report import (
    CONSOLE_HEADER,
    cell_name,
    console_row,
    failed_rows,
    guarded,
    merge,
    section,
)
from . import invariance
from .cell import Cell


@dataclass(frozen=True)
class Where:
    """Where the ranks of a run compute (python -m verify --backend, --device)."""

    backend: str = "gloo"
    """The process group's backend: "gloo" or "nccl" (zero.ranks.launch.BACKENDS)."""
    device: str = "cpu"
    """Each rank's device: "cpu" or "cuda" (zero.ranks.launch.rank_device; with gloo, local ranks
    share the GPUs: rank r on cuda:(r % GPUs))."""

    def label(self, torchrun: bool) -> str:
        """One line for the report: backend, device and who started the ranks."""
        how = "a torchrun world" if torchrun else "local worker pools"
        shared = (self.backend, self.device) == ("gloo", "cuda") and not torchrun
        share = ", ranks sharing the GPUs" if shared else ""
        return f"backend {self.backend}, device {self.device} ({how}{share})"


def pool_run(n: int, fn, items, timeout_s: float, where: Where | None = None):
    """Per-rank results of fn(rank, n, items) on world size n, on local ranks of `where`'s
    kind or under torchrun (joined with `where` if this process has not joined yet); None
    when this torchrun world has another size."""
    from zero.ranks import launch, local

    kind = {} if where is None else {"backend": where.backend, "device": where.device}
    if launch.under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            launch.init_from_env(**kind)
        if dist.get_world_size() != n:
            return None
        mine = fn(dist.get_rank(), n, items)
        every: list = [None] * n
        dist.all_gather_object(every, mine)
        return every
    return local.get_pool(n, **kind).run(fn, items, timeout_s=timeout_s)


def section_rows(cells, run_cells, row, *, name, timeout_s, say, show, skip=(), pool=None):
    """{index: row} of a section's cells (parity, model parallelism), batched per world size:
    one pool call per world runs `run_cells` on its cells, `row(cell, per_rank)` makes each row
    and `show(row)` prints it. A world that dies fails its cells with the reason; under
    torchrun the other world sizes are skipped with one line; indices in `skip` are left out.
    `pool` replaces pool_run (a test's stand-in)."""
    pool = pool_run if pool is None else pool
    rows: dict[int, dict] = {}
    for n in sorted({c.world_size for c in cells}):
        mine = [i for i, c in enumerate(cells) if c.world_size == n and i not in skip]
        if not mine:
            continue
        per_rank = guarded(
            f"{name} N={n}",
            lambda n=n, mine=mine: pool(n, run_cells, [cells[i] for i in mine], timeout_s),
            wrap=lambda failed, n=n, mine=mine: [  # a world that died fails its cells
                [{"error": f"world N={n} failed: {failed['error']}", "rank": None}] * len(mine)
            ],
        )
        if per_rank is None:
            say(f"({name} at N={n} skipped: this torchrun world has another size)")
            continue
        for k, i in enumerate(mine):
            ranks = [r[k] for r in per_rank]
            rows[i] = guarded(
                cell_name(cells[i]),
                lambda i=i, ranks=ranks: section_row(cells[i], row, ranks),
                failed=lambda error, i=i: row(cells[i], [{"error": error}]),
            )
            show(rows[i])
    return rows


def section_row(cell, row, ranks: list[dict]) -> dict:
    """row(cell, ranks), with the cell's name and the first error where the cell raised on a
    rank (its rank) or its world died (rank None)."""
    out = row(cell, ranks)
    k, first = next(((k, r) for k, r in enumerate(ranks) if r.get("error")), (None, None))
    if first is None:
        return out
    rank = first.get("rank", k)
    where = "" if rank is None else f" (rank {rank})"
    return {**out, "name": cell_name(cell), "error": first["error"] + where}


def run_world(
    n: int, cells: list[Cell], timeout_s: float, where: Where | None = None
) -> list[list[dict]]:
    """Per-rank verdicts for every cell of world size n ([] if this torchrun world has
    another size)."""
    return pool_run(n, run_cells, cells, timeout_s, where) or []


def run_matrix(
    cells: list[Cell],
    runs: list[dict] = (),
    *,
    timeout_s: float = 900,
    say: Callable[..., None] = print,
    invariance_sizes: list[int] | None = None,
    where: Where | None = None,
) -> dict:
    """Run cells (batched per world size) and the invariance runs on ranks of `where`'s kind;
    returns the report dict (verify/checks/report.py) with "cells", "injected",
    "world_size_invariance", "errors" (the invariance table's failing row if it raised as a
    whole) and "timing"."""
    report = {"cells": [], "injected": [], "world_size_invariance": [], "errors": []}
    timing, started = {}, time.time()
    if cells:
        say(CONSOLE_HEADER)
    for n in sorted({c.world_size for c in cells}):
        mine = [c for c in cells if c.world_size == n]
        t0 = time.time()
        rows = world_rows(n, mine, timeout_s, where)
        if rows is None:
            say(f"(world size {n} skipped: this torchrun world has another size)")
            continue
        timing[f"cells_n{n}_s"] = round(time.time() - t0, 1)
        for cell, row in zip(mine, rows, strict=True):
            report["injected" if cell.injected else "cells"].append(row)
            say(console_row(row))
    if runs:
        t0 = time.time()
        report["world_size_invariance"] = section(
            report,
            "world_size_invariance",
            lambda: invariance_table(
                list(runs), timeout_s=timeout_s, say=say, sizes=invariance_sizes, where=where
            ),
            empty=[],
        )
        timing["invariance_s"] = round(time.time() - t0, 1)
    timing["total_s"] = round(time.time() - started, 1)
    report["timing"] = timing
    return report


def world_rows(n: int, cells: list[Cell], timeout_s: float, where: Where | None):
    """The rows of world size n's cells (None if this torchrun world has another size): one
    pool call, then one row per cell from every rank's verdict. A world that dies fails all
    its cells with the reason; a row that cannot be made fails that cell (guarded)."""
    return guarded(
        f"world N={n}",
        lambda: merged_rows(cells, run_world(n, cells, timeout_s, where)),
        wrap=lambda failed: failed_rows(cells, f"world N={n} failed: {failed['error']}"),
    )


def merged_rows(cells: list[Cell], per_rank: list[list[dict]]) -> list[dict] | None:
    """One row per cell from every rank's verdicts (None when no rank ran: another world)."""
    if not per_rank:
        return None
    return [
        guarded(
            cell_name(c),
            lambda i=i, c=c: merge(c, [r[i] for r in per_rank]),
            failed=lambda error, c=c: failed_rows([c], error)[0],
        )
        for i, c in enumerate(cells)
    ]


def invariance_table(
    runs: list[dict],
    *,
    timeout_s: float,
    say=print,
    sizes: list[int] | None = None,
    where: Where | None = None,
) -> list[dict]:
    """The world-size-invariance rows: every run at each power-of-two N dividing M, each N
    on a pool of `where`'s kind (so the digests compared are all of one device)."""
    from zero.ranks import launch

    if launch.under_torchrun():
        say("(world-size invariance skipped: it needs several worlds; run without torchrun)")
        return []
    every = invariance.world_sizes_for(runs)
    sizes = [n for n in every if sizes is None or n in sizes]
    if not sizes:
        return []
    per_n, died = {}, {}
    for n in sizes:
        per_n[n] = guarded(
            f"world_size_invariance N={n}",
            lambda n=n: pool_run(n, invariance.run_digests, runs, timeout_s, where),
            wrap=lambda failed, n=n: failed_digests(runs, n, failed, died, say),
        )
        died.setdefault(n, {})
    rows = [{**r, **died[r["world_size"]]} for r in invariance.table(runs, per_n)]
    say(f"world-size invariance (full-state digests after every step, against N={sizes[0]}):")
    for r in rows:
        if r["passed"]:
            mark = "PASS"
        elif r["first_difference"] is not None:
            mark = f"FAIL first difference at step {r['first_difference']}"
        else:
            mark = "FAIL " + ("ranks disagree" if not r["ranks_agree"] else "differs from stage 0")
        say(
            f"  stage {r['stage']} {r['precision']:>4} {r['optimizer']:>5} N={r['world_size']} "
            f"steps={r['steps']} digest {r['digest'][:12]}  {mark}"
        )
    return rows


def failed_digests(runs: list[dict], n: int, failed: dict, died: dict, say) -> list:
    """World size n's digests when it died (`failed`: guarded's row): "failed" for every step,
    so that its rows fail; died[n] gets the name and the error those rows carry."""
    died[n] = {"name": failed["name"], "error": f"world N={n} failed: {failed['error']}"}
    say(f"invariance at N={n} failed: {failed['error']}")
    return [[["failed"] * invariance.run_config(r)["steps"] for r in runs]]
