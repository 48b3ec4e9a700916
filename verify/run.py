"""Running a verification plan: cells batched per world size, then the invariance table.

`run_matrix(cells, runs)` is what `python -m verify` and notebooks/05_verification.ipynb call. Each
world size's cells go to one long-lived worker pool in one call (zero.ranks.local.get_pool), so a
world starts once per run; under torchrun only the launched world's cells run. A world that dies (a
rank raising outside a cell, or a hang that the pool's timeout ends) fails all its cells with the
reason, and the run goes on with the next world. `where` (a Where: backend and device) says what
kind of pool runs them, e.g. gloo ranks sharing one GPU; None: gloo on the CPU, or torchrun's
default world."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from . import invariance
from .cell import Cell
from .harness import run_cells
from .report import CONSOLE_HEADER, console_row, failed_rows, merge


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
        try:
            per_rank = pool(n, run_cells, [cells[i] for i in mine], timeout_s)
        except Exception as exc:  # a world that died fails its cells
            per_rank = [[{"error": f"world N={n} failed: {str(exc).splitlines()[0]}"}] * len(mine)]
        if per_rank is None:
            say(f"({name} at N={n} skipped: this torchrun world has another size)")
            continue
        for k, i in enumerate(mine):
            rows[i] = row(cells[i], [r[k] for r in per_rank])
            show(rows[i])
    return rows


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
    returns the report dict (verify/report.py) with "cells", "injected",
    "world_size_invariance" and "timing"."""
    report = {"cells": [], "injected": [], "world_size_invariance": []}
    timing, started = {}, time.time()
    if cells:
        say(CONSOLE_HEADER)
    for n in sorted({c.world_size for c in cells}):
        mine = [c for c in cells if c.world_size == n]
        t0 = time.time()
        try:
            per_rank = run_world(n, mine, timeout_s, where)
        except Exception as exc:  # a world that died fails all its cells
            rows = failed_rows(mine, f"world N={n} failed: {str(exc).splitlines()[0]}")
        else:
            if not per_rank:
                say(f"(world size {n} skipped: this torchrun world has another size)")
                continue
            rows = [merge(c, [r[i] for r in per_rank]) for i, c in enumerate(mine)]
        timing[f"cells_n{n}_s"] = round(time.time() - t0, 1)
        for cell, row in zip(mine, rows, strict=True):
            report["injected" if cell.injected else "cells"].append(row)
            say(console_row(row))
    if runs:
        t0 = time.time()
        report["world_size_invariance"] = invariance_table(
            list(runs), timeout_s=timeout_s, say=say, sizes=invariance_sizes, where=where
        )
        timing["invariance_s"] = round(time.time() - t0, 1)
    timing["total_s"] = round(time.time() - started, 1)
    report["timing"] = timing
    return report


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
    per_n = {}
    for n in sizes:
        try:
            per_n[n] = pool_run(n, invariance.run_digests, runs, timeout_s, where)
        except Exception as exc:  # reported as failing rows
            say(f"invariance at N={n} failed: {str(exc).splitlines()[0]}")
            per_n[n] = [[["failed"] * invariance.run_config(r)["steps"] for r in runs]]
    rows = invariance.table(runs, per_n)
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
