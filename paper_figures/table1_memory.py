"""Table 1: per-device model-state memory (GB) for 7.5B, 128B and 1T models vs the DP degree.

Each of the 54 cells is ours under the paper's rounding rule beside the paper's printed value
(PAPER.md §1.2). Ours come from :func:`zero.memory.model_state_bytes`; every cell is analytic for
now. Cells measured on the simulation of a large world (records of kind ``memory.measured``) will
replace the analytic ones in the table, marked as measured, where the results file holds them.

Legend: Ψ = num_params (7.5e9, 128e9, 1e12), N_d = world_size (the DP column), K = 12
(mixed-precision Adam), GB = 1e9 bytes.
"""

from __future__ import annotations

from pathlib import Path

from paper_figures import paper
from paper_figures.common import (
    Outputs,
    SummaryRow,
    compute_then_render,
    count_line,
    markdown_table,
)
from zero.memory import GB, STAGE_LABELS, model_state_bytes
from zero.results import make_record, provenance, write_atomic

NAME = "table1_memory"
PREFERENCE = ("memory.measured", "memory.analytic")
"""Where both exist for a cell, the measured record is shown."""


def compute(profile: str) -> dict:
    """The analytic records: one per cell. The profile does not matter to arithmetic."""
    del profile
    prov = provenance()
    records = []
    for num_params in paper.TABLE1_MODELS:
        for stage in paper.TABLE1_STAGES:
            for world_size in paper.TABLE1_DP:
                config = {
                    "num_params": num_params,
                    "world_size": world_size,
                    "stage": stage,
                    "k": paper.FIG1_K,
                }
                total = model_state_bytes(num_params, world_size, stage, k=config["k"])
                records.append(
                    make_record(
                        config=config,
                        result={"bytes": total},
                        kind="memory.analytic",
                        provenance=prov,
                    )
                )
    return {"section": NAME, "records": records}


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    """Write the Markdown table from the records; returns its path and the match line."""
    cells: dict[tuple[float, int, int], dict] = {}
    for record in payload["records"]:
        if record["kind"] not in PREFERENCE:
            continue
        c = record["config"]
        key = (c["num_params"], c["world_size"], c["stage"])
        held = cells.get(key)
        if held is None or PREFERENCE.index(record["kind"]) < PREFERENCE.index(held["kind"]):
            cells[key] = record

    columns = [(m, s) for m in paper.TABLE1_MODELS for s in paper.TABLE1_STAGES]
    # Bold as the paper does: the smallest DP degree at which a column fits in a 32 GB V100.
    bold = set()
    for j, (num_params, stage) in enumerate(columns):
        for dp in paper.TABLE1_DP:
            key = (num_params, dp, stage)
            if key in cells and cells[key]["result"]["bytes"] <= paper.TABLE1_DEVICE_GB * GB:
                bold.add((dp, j))
                break

    matched = 0
    rows = []
    for dp in paper.TABLE1_DP:
        row = [str(dp)]
        sources = set()
        for j, (num_params, stage) in enumerate(columns):
            theirs = paper.table1_cell(dp, num_params, stage)
            record = cells.get((num_params, dp, stage))
            if record is None:
                row.append(f"– ({paper.format_number(theirs)})")
                continue
            ours = paper.paper_round(record["result"]["bytes"] / GB)
            matched += ours == theirs
            text = f"{paper.format_number(ours)} ({paper.format_number(theirs)})"
            if ours != theirs:
                text += " ≠"
            row.append(f"**{text}**" if (dp, j) in bold else text)
            sources.add(record["kind"].removeprefix("memory."))
        row.append(", ".join(sorted(sources)) or "–")
        rows.append(row)

    total_cells = len(paper.TABLE1_DP) * len(columns)
    match_line = count_line(matched, total_cells, "cells equal the paper's printed value")
    match_line += " under its rounding"
    bold_line = count_line(
        len(bold & paper.TABLE1_BOLD), len(paper.TABLE1_BOLD), "bold cells where the paper has them"
    )
    if bold != paper.TABLE1_BOLD:
        bold_line += f" (ours: {sorted(bold)}, paper: {sorted(paper.TABLE1_BOLD)})"

    header = ["DP"] + [
        f"{label} {STAGE_LABELS[s]}"
        for label in paper.TABLE1_MODEL_LABELS
        for s in paper.TABLE1_STAGES
    ]
    header.append("source")
    prov = payload["records"][0]["provenance"] if payload["records"] else {}
    lines = [
        "# Table 1: per-device model-state memory (GB) vs DP degree",
        "",
        "Each cell is *ours (paper)*. Ours: `zero.memory.model_state_bytes` with K = 12 and",
        "GB = 1e9 bytes, under the paper's rounding rule (values under 100 rounded half up to 1",
        "decimal, 2 under 2; values of 100 or more truncated). Paper: Table 1 as printed.",
        "Bold, as in the paper, marks the smallest DP degree at which a column fits in a 32 GB",
        "V100.",
        "≠ marks a cell that differs. The source column says whether a row's cells are analytic or",
        "measured: every cell is analytic for now.",
        "",
        *markdown_table(header, rows),
        "",
        match_line + ".",
        bold_line + ".",
        "",
        f"Drawn from `results/{NAME}.json` (git commit {prov.get('git_commit', 'unknown')}, "
        f"{prov.get('date_utc', 'date unknown')}).",
        "",
    ]
    path = write_atomic(out.table(NAME), "\n".join(lines))
    bold_count = len(bold & paper.TABLE1_BOLD)
    return path, f"{matched}/{total_cells} cells, {bold_count}/{len(paper.TABLE1_BOLD)} bold"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)
