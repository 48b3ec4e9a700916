"""Table 2: the largest model whose model states fit in 32 GB, by stage and model-parallel degree.

Ours is :func:`zero.common.memory.max_model_params` with 32 GB per device, N_d = 64 and
MP ∈ {1, 2, 4, 8, 16}, printed under the paper's rule (the MP = 1 value rounded to 0.1B, times
MP; T-valued cells as ours/1000 to the paper's decimals; docs/paper.md §1.3). The paper's
measured columns are shown beside ours for reference; we have nothing of our own to put there
yet.

Legend: Ψ = num_params (the table's entries), N_d = world_size = 64, MP = N_m = mp, K = 12
(mixed-precision Adam), GPUs = N_d · MP."""

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
from zero.common.memory import STAGE_LABELS, max_model_params
from zero.common.results import make_record, provenance, write_atomic

NAME = "table2_max_model"


def rank_fits_here() -> tuple[bool, str]:
    """Whether one Table 2 rank could be measured here: each cell's rank holds 32 GB of model
    states at the cell's Ψ (and more at its peak), so it fits only a machine (CPU memory, or a
    GPU) with that much free (measure.fake_rank.fits_here on the model states alone)."""
    from measure.fake_rank import fits_here
    from paper_figures.model_states.simulated_ranks import _device

    return fits_here({"peak": paper.TABLE2_DEVICE_BYTES}, device=_device())


def compute(profile: str) -> dict:
    """The analytic records: one per (MP, stage). The profile does not matter to arithmetic.
    Each says whether its rank could be measured here (`measured_here`, the reason either
    way); none is measured: on a machine where one fits, measuring it is left to do (a rank of
    MP column m is `python -m measure.fake_rank --mp m --world-size 64` at the cell's Ψ)."""
    del profile
    prov = provenance()
    _, reason = rank_fits_here()
    records = []
    for mp in paper.TABLE2_MP:
        for stage in range(4):
            config = {
                "memory_bytes": paper.TABLE2_DEVICE_BYTES,
                "world_size": paper.TABLE2_WORLD_SIZE,
                "stage": stage,
                "k": paper.TABLE2_K,
                "mp": mp,
            }
            result = {"max_params": max_model_params(**config), "measured_here": reason}
            records.append(
                make_record(
                    config=config, result=result, kind="max_model.analytic", provenance=prov
                )
            )
    return {"section": NAME, "records": records}


def _styled(text: str, printed: paper.Printed) -> str:
    if printed.italic:
        text = f"*{text}*"
    return f"**{text}**" if printed.bold else text


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    """Write the Markdown table from the records; returns its path and the match count."""
    ours = {}
    gpus = {}
    for record in payload["records"]:
        if record["kind"] != "max_model.analytic":
            continue
        c = record["config"]
        ours[(c["mp"], c["stage"])] = record["result"]["max_params"] / 1e9  # billions
        gpus[c["mp"]] = c["world_size"] * c["mp"]

    matched = 0
    rows = []
    for mp in paper.TABLE2_MP:
        row = [str(mp), str(gpus.get(mp, "–"))]
        for stage, theirs in enumerate(paper.TABLE2_THEORETICAL[mp]):
            if (mp, stage) not in ours:
                row.append(f"– ({theirs.text})")
                continue
            rounded = paper.table2_round(ours[(mp, stage)], mp)
            text = paper.format_size(rounded, theirs.unit, theirs.decimals)
            matched += text == theirs.text
            cell = f"{text} ({_styled(theirs.text, theirs)})"
            row.append(cell if text == theirs.text else cell + " ≠")
        row += [_styled(m.text, m) for m in paper.TABLE2_MEASURED[mp]]
        rows.append(row)

    reason = next((r["result"].get("measured_here") for r in payload["records"]), None)
    total = len(paper.TABLE2_MP) * 4
    match_line = count_line(matched, total, "theoretical cells equal the paper's printed value")
    unrounded = ", ".join(
        f"{STAGE_LABELS[s]} {ours[(1, s)]:.2f}B" for s in range(4) if (1, s) in ours
    )
    header = ["MP", "GPUs", *(f"{label}: ours (paper)" for label in STAGE_LABELS)]
    header += ["paper measured Baseline", "paper measured ZeRO-DP (P_os)"]
    prov = payload["records"][0]["provenance"] if payload["records"] else {}
    lines = [
        "# Table 2: max model size, theoretical vs measured",
        "",
        "Theoretical cells are *ours (paper)*: `zero.common.memory.max_model_params` with 32 GB",
        "per device, N_d = 64 and K = 12, under the paper's rule (the MP = 1 value rounded half",
        "up to 0.1B, then times MP; T-valued cells are ours/1000 to the paper's decimals). The",
        "paper's measured columns are its own (we have no measurement to set beside them yet).",
        "Bold and italics are the paper's. ≠ marks a cell that differs.",
        "",
        *markdown_table(header, rows),
        "",
        match_line + ".",
        "",
        "Every cell is estimated (the memory model): a rank of any MP column holds 32 GB of model",
        f"states, and none was measured on this machine ({reason or 'not checked'}).",
        "",
        f"Ours before rounding, MP = 1: {unrounded}.",
        "",
        f"Drawn from `results/{NAME}.json` (git commit {prov.get('git_commit', 'unknown')}, "
        f"{prov.get('date_utc', 'date unknown')}).",
        "",
    ]
    path = write_atomic(out.table(NAME), "\n".join(lines))
    return path, f"{matched}/{total} cells"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)
