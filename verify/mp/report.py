"""The model-parallel section's results: a cell's report row from its ranks' results (row),
the world-size invariance over N_d, stages and P_a (invariance), and the Markdown tables
(markdown). verify/mp/cells.py runs the cells and prints the rows as they come.
"""

from __future__ import annotations

from dataclasses import asdict

from .plan import MPCell


def row(cell: MPCell, per_rank: list[dict]) -> dict:
    """One cell's report row; passed only if every rank passed and the ranks of one MP index
    hold one digest per step (the DP group's ranks gather one full state)."""
    config = asdict(cell)
    err = next((r["error"] for r in per_rank if "error" in r), "")
    if err:
        return {"config": config, "label": cell.label, "passed": False, "first_failure": err}
    first = next((f"rank {i}: {r['first']}" for i, r in enumerate(per_rank) if r["first"]), "")
    digests: dict[int, list] = {}
    for r in per_rank:
        mine = [s["digest"] for s in r["steps"]]
        if digests.setdefault(r["m"], mine) != mine:
            first = first or f"the DP ranks of m={r['m']} end in different digests"
    lead = per_rank[0]["steps"]
    return {"config": config, "label": cell.label, "passed": not first, "first_failure": first,
            "digests": [digests[m] for m in sorted(digests)],
            "clipped": [s["clipped"] for s in lead],
            "norms": [s["norm"] for s in lead]}  # fmt: skip


def invariance(rows: list[dict]) -> list[dict]:
    """Cells of one (N_m, precision, steps) without a plant must hold one digest per MP index
    and step over N_d, stages and P_a on/off."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        c = r["config"]
        if c["plant"] is None and "digests" in r:
            groups.setdefault((c["mp"], c["precision"], c["steps"]), []).append(r)
    out = []
    for (mp, precision, _), rs in groups.items():
        passed = len({str(r["digests"]) for r in rs}) == 1
        out.append({"mp": mp, "precision": precision, "cells": len(rs), "passed": passed,
                    "dp": sorted({r["config"]["dp"] for r in rs}),
                    "stages": sorted({r["config"]["stage"] for r in rs})})  # fmt: skip
    return out


def markdown(rows: list[dict], inv: list[dict]) -> str:
    lines = ["", "## Model-parallel cells", "", "| cell | clipped | passed | first failure |"]
    lines.append("|---|---|---|---|")
    for r in rows:
        clip = "".join("c" if x else "." for x in r.get("clipped", []))
        lines.append(f"| {r['label']} | {clip} | {r['passed']} | {r['first_failure']} |")
    lines += [
        "",
        "| N_m | precision | N_d | stages | cells | one digest per m |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['mp']} | {r['precision']} | {r['dp']} | {r['stages']} | {r['cells']} | "
              f"{r['passed']} |" for r in inv]  # fmt: skip
    return "\n".join(lines) + "\n"
