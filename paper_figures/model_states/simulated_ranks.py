"""Measured memory of one simulated rank: Figure 1's bars and Table 1's cells, where a rank fits.

Each measurement is one fresh process acting as rank 0 of an N-rank job on a fake process group
(``measure.fake_rank.measure_rank``): it builds only its shards of the GPT of
``zero.workloads.models.gpt_config_for(Ψ)``, runs one real step, and is measured from outside the
engine (``measure.resident.MemoryProbe``: RSS after gc + malloc_trim on CPU, allocator bytes on
CUDA), the baseline taken before the model is built. The paper's configuration: bf16 working copy
and gradients reduced in bf16, Adam (K = 12), M = N.

- The *quiescent* value after construction holds nothing but model states, so it is what is set
  beside the analytic model and the paper.
- After a step the process also holds what the first step leaves behind whatever the model
  (kernel workspaces, autograd's thread): the *runtime baseline*. It is measured on a control
  rank (a 30M-parameter model, same N) and subtracted; both numbers are in the records.
- Peaks (construction, step) are reported apart; they are bounded by
  ``measure.fake_rank.estimate_peak_bytes``, which also decides whether a rank fits the machine now.

Profiles: ``smoke`` (tests) measures the control and one small rank; ``quick`` measures small
ranks (a 30M-parameter GPT at N ∈ {2, 64, 1024}) and carries
the large ranks' records forward from the existing results file; ``full`` also measures every
large cell (Figure 1: 7.5B at N_d = 64, stages 0-3; Table 1: 7.5B / 128B / 1T at every N_d and
stages 1-3) that fits: on CPU when MemAvailable covers its estimated peak plus headroom and the
peak is under ``PAPER_FIGURES_MAX_RANK_GB`` (environment, default: no cap); on a GPU when the
device's free memory covers it (then the rank is measured on CUDA). Every skip is recorded with
its reason.

Legend: Ψ = num_params, N = N_d = world_size, GB = 1e9 bytes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from paper_figures import paper
from paper_figures.common import (
    MEASURED,
    Outputs,
    SummaryRow,
    compute_then_render,
    count_line,
    markdown_table,
)
from zero.common.memory import GB, STAGE_LABELS
from zero.common.results import make_record, provenance, read_json, write_atomic, write_json

NAME = "simulated_ranks"
SMALL_PARAMS = 3e7
"""The quick profile's model and the control rank's: 30M parameters, vocabulary 256."""
SMALL_VOCAB = 256
SEQ = 64


def large_cells() -> list[tuple[float, int, int]]:
    """(Ψ, N, stage) of Figure 1 and Table 1, Figure 1 first, smallest estimated peak first."""
    cells = [(paper.FIG1_NUM_PARAMS, paper.FIG1_WORLD_SIZE, s) for s in (3, 2, 1, 0)]
    for psi in paper.TABLE1_MODELS:
        for n in paper.TABLE1_DP:
            for s in paper.TABLE1_STAGES:
                if (psi, n, s) not in cells:
                    cells.append((psi, n, s))
    return cells


def small_cells(profile: str) -> list[tuple[float, int, int]]:
    """The 30M-parameter ranks: stage 3 at N ∈ {2, 64, 1024}, stages 0-2 at N = 2."""
    if profile == "smoke":
        return [(SMALL_PARAMS, 1024, 3)]
    return [(SMALL_PARAMS, n, 3) for n in (2, 64, 1024)] + [(SMALL_PARAMS, 2, s) for s in (0, 1, 2)]


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _cap_bytes() -> float | None:
    raw = os.environ.get("PAPER_FIGURES_MAX_RANK_GB")
    if raw is None or raw == "":
        return None
    try:
        return float(raw) * GB
    except ValueError:
        raise ValueError(
            f"PAPER_FIGURES_MAX_RANK_GB={raw!r} is not allowed: expected a number of GB"
        ) from None


def _rank_timeout_s() -> float:
    """PAPER_FIGURES_RANK_TIMEOUT_S: seconds one large rank may take (default 1800). A rank that
    fits the memory may still be far too slow for one core: 128B at N_d = 1024, stage 3, runs
    the whole 128B model's forward and backward, which took over 30 min on the 2-core machine."""
    raw = os.environ.get("PAPER_FIGURES_RANK_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else 1800.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"PAPER_FIGURES_RANK_TIMEOUT_S={raw!r} is not allowed: expected seconds > 0"
        )
    return value


def measure_cell(psi: float, n: int, stage: int, *, device: str, vocab: int, prov) -> dict:
    """One record: measured (kind memory.measured) or skipped (kind memory.skipped)."""
    from measure.fake_rank import estimate_peak_bytes, fits_here, measure_rank

    config = {
        "num_params": psi,
        "world_size": n,
        "stage": stage,
        "vocab_size": vocab,
        "seq": SEQ,
        "device": device,
    }
    est = estimate_peak_bytes(params=psi, world_size=n, stage=stage, seq=SEQ, vocab_size=vocab)
    ok, reason = fits_here(est, device=device)
    cap = _cap_bytes()
    if ok and cap is not None and est["peak"] > cap:
        ok, reason = False, f"{reason}; over PAPER_FIGURES_MAX_RANK_GB={cap / GB:g}"
    if not ok:
        result = {"reason": reason, "estimate": est}
        return make_record(config=config, result=result, kind="memory.skipped", provenance=prov)
    timeout = _rank_timeout_s()
    try:
        got = measure_rank(
            params=psi,
            world_size=n,
            stage=stage,
            steps=1,
            seq=SEQ,
            vocab_size=vocab,
            device=device,
            check_fits=False,
            timeout_s=timeout,
        )["result"]
    except subprocess.TimeoutExpired:  # recorded like a rank that does not fit, with its reason
        reason = f"{reason}, but the rank did not finish within {timeout:g} s here"
        result = {"reason": reason, "estimate": est}
        return make_record(config=config, result=result, kind="memory.skipped", provenance=prov)
    got["estimate"] = est
    return make_record(config=config, result=got, kind="memory.measured", provenance=prov)


def _key(record: dict) -> tuple:
    c = record["config"]
    return (c["num_params"], c["world_size"], c["stage"], c["device"])


def _large_records(payload: dict | None) -> dict[tuple, dict]:
    """(Ψ, N, stage) -> an earlier run's large-cell record (measured or skipped)."""
    large = set(large_cells())
    out = {}
    for record in (payload or {}).get("records", []):
        c = record["config"]
        cell = (c["num_params"], c["world_size"], c["stage"])
        if record["kind"] in ("memory.measured", "memory.skipped") and cell in large:
            out[cell] = {**record, "carried": True}
    return out


def compute(profile: str, *, previous: dict | None = None, archive: Path | None = None) -> dict:
    """Measure the small ranks and the control; in the full profile, every large cell that
    fits. The quick profile carries large records forward from ``previous`` (the old file).

    archive: in the full profile, where the large records are rewritten after every cell
    ([Note: archived large ranks]): this run's cells so far, and ``previous``'s for the cells it
    has not reached yet, so a run stopped part-way keeps what it measured."""
    prov = provenance()
    device = _device()
    records = []
    control = measure_cell(SMALL_PARAMS, 64, 3, device=device, vocab=SMALL_VOCAB, prov=prov)
    if control["kind"] == "memory.measured":  # a control that did not fit stays a skipped cell:
        control["kind"] = "memory.control"  # no runtime baseline is subtracted then
    records.append(control)
    for psi, n, s in small_cells(profile):
        records.append(measure_cell(psi, n, s, device=device, vocab=SMALL_VOCAB, prov=prov))
    earlier = _large_records(previous)
    if profile == "full":
        done = {}
        for cell in large_cells():
            psi, n, s = cell
            print(f"  [{NAME}] Ψ = {psi:g}, N = {n}, stage {s} ...", flush=True)
            done[cell] = measure_cell(psi, n, s, device=device, vocab=50257, prov=prov)
            if archive is not None:
                kept = [
                    done.get(c) or earlier[c] for c in large_cells() if c in done or c in earlier
                ]
                write_json(archive, {"section": NAME, "records": kept})
        records += done.values()
    else:  # an earlier full run's large ranks, measured or skipped, kept
        records += earlier.values()
    return {"section": NAME, "records": records}


def runtime_baseline(payload: dict) -> dict[str, int]:
    """Bytes a step leaves behind whatever the model, per device: the control rank's RSS after
    its step minus after its construction."""
    out = {}
    for record in payload["records"]:
        if record["kind"] == "memory.control":
            r = record["result"]
            out[record["config"]["device"]] = r["rss_after_steps"][-1] - r["rss_after_construction"]
    return out


def measured_cells(payload: dict) -> dict[tuple, dict]:
    """(Ψ, N, stage) -> the measured record's numbers, the runtime baseline subtracted."""
    base = runtime_baseline(payload)
    cells = {}
    for record in payload["records"]:
        if record["kind"] != "memory.measured":
            continue
        c, r = record["config"], record["result"]
        overhead = base.get(c["device"], 0)
        cells[(c["num_params"], c["world_size"], c["stage"])] = {
            "measured": r["rss_after_construction"],
            "after_step": r["rss_after_steps"][-1] - overhead,
            "runtime_baseline": overhead,
            "analytic": r["analytic_model_states"],
            "engine": r["engine_model_states"],
            "num_params": r["config"]["num_params"],
            "peak": r["rss_peak"],
            "estimated_peak": r["estimate"]["peak"],
            "device": c["device"],
            "machine": machine(record["provenance"], c["device"]),
            "date": record["provenance"].get("date_utc", "?"),
            "carried": bool(record.get("carried")),
        }
    return cells


def machine(prov: dict, device: str) -> str:
    """A short description of where a record was measured."""
    if device.startswith("cuda") and prov.get("gpu"):
        return f"{prov['gpu']} (CUDA allocator)"
    return f"CPU, {prov.get('cpu_count', '?')} cores, {prov.get('cpu', '?')} (RSS)"


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    cells = measured_cells(payload)
    base = runtime_baseline(payload)
    rows = []
    within = 0
    for (psi, n, stage), v in sorted(cells.items()):
        ratio = v["measured"] / v["analytic"]
        # Slack: one page per buffer is negligible here; what is stated is 8 MiB of the
        # interpreter's own growth while building an engine (see tests/distributed/test_measure.py).
        ok = abs(v["measured"] - v["engine"]) <= 8 * 2**20 + 0.01 * v["engine"]
        within += ok
        rows.append(
            [
                f"{psi / 1e9:g}B ({v['num_params'] / 1e9:.4g}B)",
                str(n),
                STAGE_LABELS[stage],
                f"{v['analytic'] / GB:.4g}",
                f"{v['engine'] / GB:.4g}",
                f"{v['measured'] / GB:.4g}",
                f"{ratio:.3f}",
                f"{v['after_step'] / GB:.4g}",
                f"{v['peak'] / GB:.3g} (≤ {v['estimated_peak'] / GB:.3g})",
                v["machine"] + (f", carried from {v['date']}" if v["carried"] else ""),
            ]
        )
    skipped = [
        f"- Ψ = {r['config']['num_params']:g}, N = {r['config']['world_size']}, "
        f"{STAGE_LABELS[r['config']['stage']]}: {r['result']['reason']}"
        for r in payload["records"]
        if r["kind"] == "memory.skipped"
    ]
    header = [
        "Ψ requested (built)",
        "N",
        "stage",
        "analytic GB",
        "engine GB",
        "measured GB",
        "measured/analytic",
        "after a step GB",
        "peak GB (estimate)",
        "measured on",
    ]
    lines = [
        "# Memory of one simulated rank, measured outside the engine",
        "",
        "Rank 0 of an N-rank fake world builds only its shards and runs one step (paper",
        "configuration: bf16, gradients reduced in bf16, Adam, M = N). *analytic*:",
        "`zero.common.memory.model_state_breakdown` at the padded Ψ; *engine*: `memory_report()`;",
        "*measured*: the quiescent resident set after construction minus the baseline taken",
        "before the model was built (RSS after gc + malloc_trim on CPU; allocator bytes on",
        "CUDA). *after a step*: the same after one step, minus the runtime baseline that a",
        "step leaves behind whatever the model ("
        + ", ".join(f"{d}: {b / 1e6:.1f} MB" for d, b in base.items())
        + ", measured on a 30M-parameter control rank). Peaks are apart, beside the estimate",
        "that decides whether a rank fits.",
        "",
        *markdown_table(header, rows),
        "",
        count_line(within, len(rows), "ranks measured within 8 MiB + 1% of the engine's bytes")
        + ".",
        "",
    ]
    if skipped:
        lines += ["Not measured (recorded reason):", "", *skipped, ""]
    path = write_atomic(out.table(NAME), "\n".join(lines))
    return path, f"{within}/{len(rows)} ranks, {len(skipped)} skipped"


ARCHIVE = Path("measured") / f"{NAME}_large.json"
"""[Note: archived large ranks] results/ is not kept in git, but a large rank takes minutes and
more memory than most machines have. So a full run also writes its large ranks' records to
``measured/simulated_ranks_large.json`` under the output root (tracked in git for the package's
own directory), after every cell, atomically: a run stopped part-way (an interrupted job, the
machine's memory) keeps the cells it finished and the earlier records of those it did not
reach. A quick run carries them from there (the output root's archive, else the package's;
its own earlier results only when neither exists). Their provenance (machine, commit, date)
travels with them."""


def _previous(profile: str, out: Outputs) -> dict | None:
    if profile == "smoke":
        return None
    # the archives first: a results file only holds what an archive had when it was written,
    # and goes stale when a newer full run (or a pull) replaces the archive
    here = MEASURED.parent / ARCHIVE  # the package's own archive, tracked in git
    for path in (out.root / ARCHIVE, here, out.result(NAME)):
        if path.exists():
            return read_json(path)
    return None


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    previous = _previous(profile, out)
    return compute_then_render(
        NAME,
        lambda p: compute(p, previous=previous, archive=out.root / ARCHIVE),
        render,
        profile=profile,
        out=out,
    )
