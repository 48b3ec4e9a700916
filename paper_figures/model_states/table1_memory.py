"""Table 1: per-device model-state memory (GB) for 7.5B, 128B and 1T models vs the DP degree.

Each of the 54 cells is ours under the paper's rounding rule beside the paper's printed value
(docs/paper.md §1.2). Ours come from :func:`zero.common.memory.model_state_bytes`. Where one
simulated rank of that cell fitted the machine (``results/simulated_ranks.json``,
paper_figures/model_states/simulated_ranks.py) the cell shows the measured value instead, marked
†; a measured rank is the GPT of ``gpt_config_for(Ψ)``, whose exact Ψ differs from the paper's
round one by up to 0.3%, so a measured cell is compared with the analytic value at its own Ψ, and
the match count is over the analytic values.

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
from zero.common.memory import GB, STAGE_LABELS, model_state_bytes
from zero.common.results import make_record, provenance, read_json, write_atomic

NAME = "table1_memory"


def compute(profile: str, *, ranks: dict | None = None) -> dict:
    """The analytic records, one per cell, and the measured ranks of Table 1's cells found in
    ``ranks`` (the simulated_ranks results)."""
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
    cells = {
        (m, n, s) for m in paper.TABLE1_MODELS for n in paper.TABLE1_DP for s in paper.TABLE1_STAGES
    }
    for record in (ranks or {}).get("records", []):
        c = record["config"]
        if (
            record["kind"] == "memory.measured"
            and (
                c["num_params"],
                c["world_size"],
                c["stage"],
            )
            in cells
        ):
            r = record["result"]
            result = {
                "bytes": r["rss_after_construction"],
                "analytic_bytes": r["analytic_model_states"],
                "built_params": r["config"]["num_params"],
            }
            records.append(
                make_record(
                    config={**{k: c[k] for k in ("num_params", "world_size", "stage")}, "k": 12},
                    result={**result, "device": c["device"]},
                    kind="memory.measured",
                    provenance=record["provenance"],
                )
            )
    return {"section": NAME, "records": records}


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    """Write the Markdown table from the records; returns its path and the match line."""
    cells: dict[tuple[float, int, int], dict] = {}
    measured: dict[tuple[float, int, int], dict] = {}
    for record in payload["records"]:
        c = record["config"]
        key = (c["num_params"], c["world_size"], c["stage"])
        if record["kind"] == "memory.analytic":
            cells[key] = record
        elif record["kind"] == "memory.measured":
            measured[key] = record

    columns = [(m, s) for m in paper.TABLE1_MODELS for s in paper.TABLE1_STAGES]
    bold = _bold(cells, columns)
    rows, matched = _rows(cells, measured, columns, bold)

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
    notes = _notes(measured)
    prov = payload["records"][0]["provenance"] if payload["records"] else {}
    lines = [
        "# Table 1: per-device model-state memory (GB) vs DP degree",
        "",
        "Each cell is *ours (paper)*. Ours: `zero.common.memory.model_state_bytes` with K = 12 and",
        "GB = 1e9 bytes, under the paper's rounding rule (values under 100 rounded half up to 1",
        "decimal, 2 under 2; values of 100 or more truncated). Paper: Table 1 as printed.",
        "Bold, as in the paper, marks the smallest DP degree at which a column fits in a 32 GB",
        "V100.",
        "≠ marks a cell whose analytic value differs. † marks a cell measured on one simulated",
        "rank (the notes below give the measured bytes, the analytic value at the built model's Ψ",
        "and the ratios); the other cells are analytic. The source column says which a row has.",
        "",
        *markdown_table(header, rows),
        "",
        *(notes + [""] if notes else ["No cell measured in this run.", ""]),
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


def _bold(cells: dict, columns: list) -> set[tuple[int, int]]:
    """(DP, column) cells bold as the paper has them: the smallest DP degree at which a column
    fits in a 32 GB V100."""
    bold = set()
    for j, (num_params, stage) in enumerate(columns):
        for dp in paper.TABLE1_DP:
            key = (num_params, dp, stage)
            if key in cells and cells[key]["result"]["bytes"] <= paper.TABLE1_DEVICE_GB * GB:
                bold.add((dp, j))
                break
    return bold


def _rows(cells: dict, measured: dict, columns: list, bold: set) -> tuple[list[list[str]], int]:
    """The table's rows, each cell *ours (paper)* (measured where a record has it, marked †),
    with the row's sources; and how many cells equal the paper's under its rounding."""
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
            key = (num_params, dp, stage)
            if key in measured:
                got = paper.paper_round(measured[key]["result"]["bytes"] / GB)
                text = f"{paper.format_number(got)}† ({paper.format_number(theirs)})"
                sources.add("measured")
            else:
                text = f"{paper.format_number(ours)} ({paper.format_number(theirs)})"
                sources.add("analytic")
            if ours != theirs:
                text += " ≠"
            row.append(f"**{text}**" if (dp, j) in bold else text)
        row.append(", ".join(sorted(sources)) or "–")
        rows.append(row)
    return rows, matched


def _notes(measured: dict) -> list[str]:
    """One note per measured cell: the measured, analytic and printed bytes, and the ratios."""
    notes = []
    for (num_params, dp, stage), record in sorted(measured.items()):
        r = record["result"]
        prov_m = record["provenance"]
        notes.append(
            f"- † {paper.format_number(num_params / 1e9)}B, N_d = {dp}, {STAGE_LABELS[stage]}: "
            f"measured {r['bytes'] / GB:.4g} GB on one simulated rank of a "
            f"{r['built_params'] / 1e9:.4g}B GPT ({r['device']}, {prov_m.get('cpu_count', '?')} "
            f"cores, {prov_m.get('date_utc', '?')}); analytic at that Ψ "
            f"{r['analytic_bytes'] / GB:.4g} GB "
            f"(measured/analytic {r['bytes'] / r['analytic_bytes']:.3f}); paper "
            f"{paper.format_number(paper.table1_cell(dp, num_params, stage))} GB "
            f"(measured/paper {r['bytes'] / GB / paper.table1_cell(dp, num_params, stage):.3f})."
        )
    return notes


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    from paper_figures.model_states.simulated_ranks import NAME as RANKS

    path = out.result(RANKS)
    ranks = read_json(path) if path.exists() else None
    return compute_then_render(
        NAME, lambda p: compute(p, ranks=ranks), render, profile=profile, out=out
    )
