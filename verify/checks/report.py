"""Reports of a verification run: rows from per-rank verdicts, Markdown, JSON and a heatmap.

The JSON report (python -m verify --json) is
    {"cells": [row], "injected": [row], "world_size_invariance": [row], "resume": [row]?,
     "timing": {...}, "provenance": {...}}
(python -m verify adds to the provenance where the ranks ran: "backend", "device", "launcher")
Every row has `passed`; cell rows (backward gradients in "cells", injected ones in "injected")
keep the format of the first CLI (stage, world_size, precision, optimizer, mode, steps, bitwise,
max_abs_diff, max_ulp, tolerance, bound_ratio, passed, first_mismatch, skipped_steps) plus the
full configuration in `config`, for fast cells each check's measured error beside its bound in
`errors`, and `reported`, `traffic` and `memory` ({"passed", "first"}; memory also the engine's
and the expected bytes by category): the step's reported quantities, its counted collectives and
the resident bytes against verify/checks/expect.py. Non-finite floats are written as strings
(standard JSON has no inf or NaN). A row whose work raised ([Note: a row that raised] at guarded)
also has `name` and `error`; a whole section that raised is one such row in "errors".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

SECTIONS = ("cells", "injected", "world_size_invariance", "resume", "errors")


def merge(cell, per_rank: list[dict]) -> dict:
    """One row from every rank's verdict: a cell passes only if it passed on every rank."""
    fast = cell.mode == "fast"
    ratios = {k: max(r["ratios"].get(k, 0.0) for r in per_rank) for k in per_rank[0]["ratios"]}
    errors = {}
    for key in ratios:  # the measured error and bound at the worst element over all ranks
        worst = max((r for r in per_rank if key in r["errors"]), key=lambda r: r["ratios"][key])
        err, bound = worst["errors"][key]
        errors[key] = {"error": err, "bound": bound, "ratio": worst["ratios"][key]}
    return {
        "stage": cell.stage,
        "world_size": cell.world_size,
        "precision": cell.precision,
        "optimizer": cell.optimizer,
        "mode": cell.mode,
        "steps": cell.steps,
        "model": cell.model,
        "gradients": cell.gradients,
        "micro_batches": cell.micro_batches,
        # fast cells are checked against bounds, not bits
        "bitwise": None if fast else all(r["bitwise"] for r in per_rank),
        "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
        "max_ulp": max(r["max_ulp"] for r in per_rank),
        "tolerance": "derived bound (verify/checks/lockstep.py)" if fast else 0,
        "bound_ratio": ratios,
        "errors": errors,
        "passed": all(r["passed"] for r in per_rank),
        "first_mismatch": next(
            (f"rank {r['rank']}: {r['first']}" for r in per_rank if r["first"]), ""
        ),
        # what the engine reported (loss, norm, skip, loss scale, step counts), sent (counted
        # collectives per op and phase) and holds (memory_report), against verify/checks/expect.py
        "reported": _checked(per_rank, "reported"),
        "traffic": _checked(per_rank, "traffic"),
        "memory": {
            **_checked(per_rank, "memory"),
            **per_rank[0].get("memory_bytes", {}),
        },
        "skipped_steps": per_rank[0]["skipped_steps"],
        "clipped_steps": per_rank[0].get("clipped_steps", 0),
        # collective launches that Cell.delays slowed down, over all ranks
        "delayed_launches": sum(r.get("delayed_launches", 0) for r in per_rank),
        # every rank gathers the full state, so one digest means the ranks agree
        "digest": ",".join(sorted({str(r.get("digest")) for r in per_rank})),
        # the named checks that failed on any rank (verify.features.CHECKS)
        "checks": sorted({c for r in per_rank for c in r.get("checks", ())}),
        "config": cell.as_dict(),
        **_raised(cell, per_rank),
    }


def _raised(cell, per_rank: list[dict]) -> dict:
    """{"name", "error"} of a cell that raised on some rank (its first such rank), else {}."""
    r = next((r for r in per_rank if r.get("error")), None)
    if r is None:
        return {}
    return {"name": cell_name(cell), "error": f"{r['error']} (rank {r['rank']})"}


def _checked(per_rank: list[dict], key: str) -> dict:
    """{"passed", "first"} of one comparison over every rank (first: rank and both values)."""
    first = next((f"rank {r['rank']}: {r[key]}" for r in per_rank if r.get(key)), "")
    ran = all(key in r for r in per_rank)
    return {"passed": ran and not first, "first": first if ran else "not run"}


def failed_rows(cells, reason: str) -> list[dict]:
    """Rows for cells whose world never reported (a rank raised outside a cell, or hung)."""
    per_rank = {
        "rank": 0,
        "bitwise": False,
        "max_abs_diff": 0.0,
        "max_ulp": 0,
        "first": reason,
        "skipped_steps": 0,
        "ratios": {},
        "errors": {},
        "passed": False,
        "checks": ["raised"],  # the world raised outside a cell, or hung
    }
    return [{**merge(c, [per_rank]), "name": cell_name(c), "error": reason} for c in cells]


# -- rows of work that raised ---------------------------------------------------------------------

ERROR_CHARS = 300
"""The longest error text a row keeps."""


def guarded(
    name: str,
    work: Callable[[], Any],
    *,
    failed: Callable[[str], dict] | None = None,
    wrap: Callable[[dict], Any] | None = None,
) -> Any:
    """[Note: a row that raised] work() for one row (a cell, a resume case, a world, a whole
    section); when it raises an Exception, a failing row instead: failed(error) (the row in
    its section's own shape; {} when None) with "name": name, "passed": False and "error":
    error_text, or wrap(that row) where the work returns more than one row (a world's cells,
    a section). KeyboardInterrupt and SystemExit (zero.ranks' Interrupted too) pass through.
    So one broken row fails that row only: the rows after it run, and python -m verify still
    prints its summary and writes its reports, exiting 1."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - reported as the row's failure
        error = error_text(exc)
        row = {**(failed(error) if failed is not None else {}), "name": name}
        row |= {"passed": False, "error": error}
        return row if wrap is None else wrap(row)


def section(report: dict, name: str, work: Callable[[], Any], *, empty: Any = None) -> Any:
    """A whole section's work (guarded): what it returns, or when it raises, `empty` (what the
    section holds then), its failing row named `name` appended to report["errors"]."""

    def failed(row: dict) -> Any:
        report.setdefault("errors", []).append(row)
        return empty

    return guarded(name, work, wrap=failed)


def error_text(exc: BaseException) -> str:
    """'<ExceptionType>: <the first line of its message>'; for a rank's exception reported by
    a pool or spawn (zero.ranks.launch.RankError) the rank's own exception and the rank:
    '<ExceptionType>: <message> (rank r)'."""
    rank, child = getattr(exc, "rank", None), getattr(exc, "child_traceback", None)
    if isinstance(rank, int) and isinstance(child, str):
        return f"{exception_line(child)[:ERROR_CHARS]} (rank {rank})"
    lines = str(exc).strip().splitlines()
    return (f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)[:ERROR_CHARS]


def exception_line(text: str) -> str:
    """The exception line of a formatted traceback ('<Type>: <message>', its first line, the
    type without its module); the text's first line when it is no traceback."""
    lines = text.strip().splitlines() or [""]
    heads = [i for i, x in enumerate(lines) if x.startswith("Traceback (most recent call last)")]
    if not heads:
        return lines[0]
    line = next((x for x in lines[heads[-1] + 1 :] if x and not x[0].isspace()), lines[-1])
    kind, sep, rest = line.partition(":")
    return kind.rpartition(".")[2] + sep + rest if " " not in kind else line


_NAMED = (
    ("family", "{}"), ("stage", "stage {}"), ("world_size", "N={}"), ("precision", "{}"),
    ("optimizer", "{}"), ("mode", "{}"), ("model", "{}"), ("gradients", "{}"),
    ("micro_batches", "M={}"),
)  # fmt: skip


def cell_name(cell) -> str:
    """A cell's name in a failing row: its label where it has one, else its main fields."""
    label = getattr(cell, "label", None)
    if isinstance(label, str):
        return label
    return " ".join(f.format(getattr(cell, k)) for k, f in _NAMED if hasattr(cell, k))


def sanitize(obj):
    """obj with every non-finite float replaced by its string ('inf', 'nan'), for JSON."""
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [sanitize(v) for v in obj]
    if isinstance(obj, float | np.floating) and not math.isfinite(obj):
        return str(float(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def worst_check(row: dict) -> tuple[str, dict] | None:
    """The fast check with the largest observed/bound ratio, or None."""
    if not row.get("errors"):
        return None
    key = max(row["errors"], key=lambda k: row["errors"][k]["ratio"])
    return key, row["errors"][key]


def console_row(row: dict) -> str:
    """One printed line per cell; fast cells print the worst check's error beside its bound."""
    cfg = row["config"]
    bitwise = "-" if row["bitwise"] is None else str(row["bitwise"])
    worst = worst_check(row)
    measured = (
        f"{worst[0]} {worst[1]['error']:.2e}/{worst[1]['bound']:.2e}={worst[1]['ratio']:.3f}"
        if worst
        else "-"
    )
    overlap = "delays" if cfg.get("delays") else ("on" if cfg.get("overlap") else "off")
    clip = "clip" if cfg.get("clip_norm") is not None else "-"
    result = "PASS" if row["passed"] else "FAIL " + row["first_mismatch"]
    return (
        f"{row['stage']:>1} {row['world_size']:>2} {row['precision']:>4} {row['optimizer']:>5} "
        f"{row['mode'][:5]:>5} {row['gradients'][:9]:>9} {cfg.get('model', ''):>13} "
        f"M={row['micro_batches']:<3} {clip:>4} {cfg.get('units', ''):>4} {overlap:>6} "
        f"{bitwise:>5} {row['max_ulp']:>6} {row['skipped_steps']:>2} {measured:>36}  {result}"
    )


CONSOLE_HEADER = (
    f"{'s':>1} {'N':>2} {'prec':>4} {'optim':>5} {'mode':>5} {'gradients':>9} {'model':>13} "
    f"{'M':<5} {'clip':>4} {'unit':>4} {'ovlap':>6} {'bits':>5} {'ulp':>6} {'sk':>2} "
    f"{'worst fast check: error/bound=ratio':>36}  result"
)


def _md_table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return out


def _cell_table(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        cfg = r["config"]
        worst = worst_check(r)
        body.append(
            [
                r["stage"],
                r["world_size"],
                r["precision"],
                r["optimizer"],
                r["mode"],
                r["gradients"],
                cfg.get("model", ""),
                r["micro_batches"],
                "on" if cfg.get("clip_norm") is not None else "off",
                cfg.get("units", ""),
                "delays" if cfg.get("delays") else ("on" if cfg.get("overlap") else "off"),
                "-" if r["bitwise"] is None else r["bitwise"],
                f"{worst[1]['error']:.2e} / {worst[1]['bound']:.2e} ({worst[0]})" if worst else "",
                "pass" if r["passed"] else f"**FAIL** {r['first_mismatch']}",
            ]
        )
    header = ["stage", "N", "precision", "optimizer", "mode", "gradients", "model", "M", "clip"]
    header += ["units", "overlap", "bitwise", "fast: error / bound", "result"]
    return _md_table(header, body)


def _raised_table(report: dict) -> list[str]:
    """Every row of the report whose work raised (guarded): section, name, error."""
    raised = [
        [key, r.get("name", ""), r["error"]]
        for key, rows in report.items()
        if isinstance(rows, list)
        for r in rows
        if isinstance(r, dict) and r.get("error")
    ]
    if not raised:
        return []
    return ["", "## Rows that raised", ""] + _md_table(["section", "row", "error"], raised)


def markdown(report: dict) -> str:
    """The whole report as Markdown: a summary, then one table per section."""
    lines = ["# Verification report", ""]
    for name in SECTIONS:
        rows = report.get(name)
        if rows is None:
            continue
        ok = sum(r["passed"] for r in rows)
        lines.append(f"- {name}: {ok}/{len(rows)} passed")
    timing = report.get("timing", {})
    if timing:
        lines.append(f"- wall time: {timing.get('total_s', 0):.0f} s")
    prov = report.get("provenance", {})
    if prov:
        lines.append(f"- commit {prov.get('git_commit', '?')}, torch {prov.get('torch', '?')}")
    if prov.get("device"):
        gpu = f" ({prov['gpu']})" if prov["device"] == "cuda" and prov.get("gpu") else ""
        lines.append(
            f"- ranks: backend {prov.get('backend', '?')}, device {prov['device']}{gpu}, "
            f"{prov.get('launcher', '?')} launch"
        )
    lines += _raised_table(report)
    for name, title in (("cells", "Cells (backward)"), ("injected", "Injected gradients")):
        if report.get(name):
            lines += ["", f"## {title}", ""] + _cell_table(report[name])
    inv = report.get("world_size_invariance")
    if inv:
        lines += ["", "## World-size invariance", ""]
        lines.append(
            "The same run (same data, seed and M) at each N; ✓: every step's full state has the"
            " bits of the first N and of stage 0, on every rank."
        )
        lines.append("")
        sizes = sorted({r["world_size"] for r in inv})
        keys = []
        for r in inv:
            k = (r["stage"], r["precision"], r["optimizer"])
            if k not in keys:
                keys.append(k)
        body = []
        for k in keys:
            cells = {
                r["world_size"]: r for r in inv if (r["stage"], r["precision"], r["optimizer"]) == k
            }
            marks = []
            for n in sizes:
                r = cells.get(n)
                if r is None:
                    marks.append("")
                elif r["passed"]:
                    marks.append("✓")
                else:
                    marks.append(f"✗ (step {r['first_difference']})")
            steps = next(iter(cells.values()))["steps"]
            body.append([*k, steps, *marks])
        lines += _md_table(
            ["stage", "precision", "optimizer", "steps", *[f"N={n}" for n in sizes]], body
        )
    if report.get("resume"):
        lines += ["", "## Checkpoint resume and resharding", ""]
        rows = report["resume"]
        every = dict.fromkeys(k for r in rows for k in r)  # a failing row has fewer or more
        keys = [k for k in every if k not in ("config", "passed")]
        lines += _md_table(
            [*keys, "passed"], [[r.get(k, "") for k in keys] + [r["passed"]] for r in rows]
        )
    return "\n".join(lines) + "\n"


def heatmap(rows: list[dict], *, title: str = "python -m verify: cells passed"):
    """A Figure with one panel per precision: stage (rows) × N (columns), coloured by the
    fraction of cells that passed, each square labelled passed/total."""
    import matplotlib.pyplot as plt

    precisions = [p for p in ("fp32", "bf16", "fp16") if any(r["precision"] == p for r in rows)]
    stages = sorted({r["stage"] for r in rows})
    sizes = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(
        1,
        len(precisions),
        figsize=(3.2 * len(precisions) + 1.2, 3.6),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, p in zip(axes[0], precisions):
        frac = np.full((len(stages), len(sizes)), np.nan)
        for i, s in enumerate(stages):
            for j, n in enumerate(sizes):
                mine = [
                    r for r in rows if (r["precision"], r["stage"], r["world_size"]) == (p, s, n)
                ]
                if mine:
                    ok = sum(r["passed"] for r in mine)
                    frac[i, j] = ok / len(mine)
                    ax.text(j, i, f"{ok}/{len(mine)}", ha="center", va="center", fontsize=8)
        image = ax.imshow(frac, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
        ax.set_yticks(range(len(stages)), [str(s) for s in stages])
        ax.set_xlabel("world size N")
        if ax is axes[0][0]:
            ax.set_ylabel("ZeRO stage")
        ax.set_title(p)
    fig.colorbar(image, ax=list(axes[0]), label="fraction passed", shrink=0.8)
    fig.suptitle(title)
    return fig


def ratio_chart(rows: list[dict], *, title: str = "fast mode: worst error / derived bound"):
    """A Figure: for each lock-step check, the worst measured error / bound over the fast rows
    (a cell fails above the line at 1)."""
    import matplotlib.pyplot as plt

    checks = ("reduced", "master", "optimizer", "working")
    worst = [max((r["bound_ratio"].get(k, 0.0) for r in rows), default=0.0) for k in checks]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    bars = ax.bar(checks, worst, color=["tab:red" if w > 1 else "tab:green" for w in worst])
    ax.bar_label(bars, fmt="%.3f")
    ax.axhline(1.0, color="black", linestyle="--", label="bound")
    ax.set_ylim(0, max(1.2, max(worst, default=0) * 1.1))
    ax.set_xlabel("lock-step check")
    ax.set_ylabel("worst error / bound")
    ax.set_title(f"{title} ({len(rows)} cells)")
    ax.legend()
    return fig
