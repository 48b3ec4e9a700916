"""python -m verify: run the engine against the reference over a matrix of cells.

    python -m verify --quick                                  # the CI preset
    (verify/cells/matrix.py)
    python -m verify --complete --json v.json --markdown v.md # the release covering run
    python -m verify --quick --resume --coverage              # line coverage of the library
    python -m verify --stages 0 1 2 --world-sizes 1 2 4 --precisions fp32 bf16 fp16 \\
                     --optimizers sgd adam adamw --mode deterministic --steps 3 --json out.json
    python -m verify --quick --device cuda --world-sizes 1 2 4  # gloo ranks sharing one GPU

Launched plainly, it starts one long-lived pool of local gloo ranks per world size and runs all
of that world size's cells on it, on the CPU, or with --device cuda on the GPUs (rank r on
cuda:(r % GPUs), so N = 2 and 4 run on one GPU; --backend nccl needs a GPU per rank). Under
torchrun (`torchrun --nproc-per-node 8 -m verify ...`) it uses the world it was given, NCCL on
the GPUs where CUDA is available (else gloo on the CPU; --backend and --device choose), and runs
the cells of that world size only (the world-size invariance table needs several worlds and is
skipped there). One row per cell; the exit status is non-zero if any row fails. What raises (in a
rank, a cell, a resume case, a whole section) is a failing row naming it and the error, and the
summary and the reports are still written (verify.checks.report.guarded). Deterministic cells must
be
bitwise equal on every rank. Fast cells run in lock-step (verify/checks/lockstep.py): each
step starts from the reference's state and the reduced gradient, master, optimizer states and
working copy must each lie within their derived bound; the row prints the worst check's measured
error beside its bound (a cell passes at ratio <= 1).

Sections of the report (verify/checks/report.py): "cells" (gradients from backward), "injected"
(gradients
fed in by verify/cells/inject.py), "world_size_invariance" (verify/cells/invariance.py) and, with
--resume,
"resume" (checkpoint resume and resharding, from verify/checkpoints/resume.py when present); the
presets and
--parity add "parity" and "parity_invariance" (the engine against plain PyTorch on several model
families, verify/parity/section.py); the presets and --mp add "mp" and "mp_invariance" (ZeRO inside
the DP
group of each tensor-parallel slice against reference/mp.py, verify/mp/cells.py; --no-mp leaves it
out of a preset). The presets end with "watchdog" (verify/faults/watchdog_cells.py) and "refusals"
(bad
input and damaged checkpoints refused by name, verify/refusals/section.py). On a GPU (--device
cuda) the
cells and the invariance table run there; the parity, model-parallel, watchdog, refusals and resume
sections compute on the CPU and each says in one line that it is skipped. The report names the
backend and the device (provenance.backend, provenance.device).

The sections are one table, verify/command/sections.py (what chooses each; what each runs and
reports is verify/command/section_runs.py), and main a loop over it; the options and their
checks are verify/command/options.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from zero.common import cli
from zero.common.results import provenance, write_atomic, write_json
from zero.ranks import launch

from .cells import invariance
from .cells.cell import Cell, legacy
from .checks.report import console_row, markdown, sanitize, section
from .command import sections
from .command.options import check_local_nccl, parse
from .command.section_runs import Invocation


def main(argv=None) -> int:
    args = parse(argv)
    if args.coverage:
        return under_coverage(argv)
    # under torchrun every rank computes; rank 0 alone prints and writes
    lead = os.environ.get("RANK", "0") == "0"

    def say(*a):
        if lead:
            print(*a, flush=True)

    inv = start(args, say)
    if args.list:  # each section's --list lines, none run
        for s in sections.TABLE:
            sections.run(s, inv, {})
        return 0
    torchrun = join(args)
    report: dict = {}
    got = {s.name: sections.run(s, inv, report) for s in sections.TABLE}
    launcher = "torchrun" if torchrun else "local"
    report["provenance"] = {
        **provenance(), "backend": args.backend, "device": args.device, "launcher": launcher
    }  # fmt: skip
    changed = summary(inv, report)
    every = [r for name in sections.row_keys() for r in report.get(name) or []]
    failed = [r for r in every if not r["passed"]]
    if lead:
        write_reports(args, report, got)
    if torchrun:  # leave the world together: a rank exiting with its group alive may abort
        launch.leave_world()
    return 1 if failed or changed or not every else 0


def under_coverage(argv) -> int:
    """This command again, in a fresh interpreter under coverage (python -m verify.linecoverage):
    verify's own imports have already run the library's module-level lines unmeasured."""
    rest = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--coverage"]
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "verify.linecoverage", *rest]
    return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}).returncode


def start(args, say) -> Invocation:
    """This invocation with the matrix's plan, once the worlds it starts are known to fit the
    backend (check_local_nccl); says where the ranks run."""
    inv = sections.invocation(args, say)
    started = {c.world_size for c in inv.cells}  # the worlds this run starts: the cells', the
    if inv.runs:  # invariance table's
        wanted = args.world_sizes
        started |= {n for n in invariance.world_sizes_for(inv.runs) if not wanted or n in wanted}
    check_local_nccl(args.backend, sorted(started))
    say(f"ranks: {inv.where.label(launch.under_torchrun())}")
    return inv


def join(args) -> bool:
    """Whether this runs under torchrun; if so, joins the launched world as asked (every
    section then uses it). On a GPU, deterministic cuBLAS (docs/design.md §2), before any rank
    starts."""
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torchrun = launch.under_torchrun()
    if torchrun:
        launch.init_from_env(backend=args.backend, device=args.device)
    return torchrun


def summary(inv: Invocation, report: dict) -> list[dict]:
    """The closing lines: each section's, the --baseline comparison, the sections that raised.
    Returns the cells whose end state differs from the baseline's."""
    args, say = inv.args, inv.say
    for s in sections.TABLE:
        for line in s.closing(inv, report) if s.closing is not None else ():
            say(line)
    changed = []
    if args.baseline:
        cell_rows = report["cells"] + report["injected"]
        compare = functools.partial(compare_baseline, args.baseline, cell_rows, say)
        changed = section(report, "baseline", compare, empty=[])
    say_raised(report["errors"], say)
    return changed


def write_reports(args, report: dict, got: dict) -> None:
    """--json, --digests and --markdown (each section's Markdown part after the report's)."""
    if args.json:
        write_json(args.json, sanitize(report))
    if args.digests:
        write_digests(args.digests, report)
    if args.markdown:
        parts = [
            s.markdown(got[s.name])
            for s in sections.TABLE
            if s.markdown is not None and got[s.name] is not None
        ]
        write_atomic(args.markdown, markdown(report) + "".join(parts))


def _current(config: dict) -> dict:
    """A record's config in today's fields (features as a JSON list, as Cell.as_dict writes)."""
    out = legacy(dict(config))
    return {**out, "features": list(out.get("features") or ())}


def compare_baseline(path: str, rows: list[dict], say) -> list[dict]:
    """Rows whose final state digest differs from the same cell's in the report at `path`.
    Cells are matched by their full configuration, an older report's read as today's cells
    (verify.cells.cell.legacy: its option fields as features). A Cell field added since that
    report counts as the same cell while it holds its default (the older code had no other
    value for it); cells in only one report are counted, never compared."""
    defaults = {f.name: f.default for f in dataclasses.fields(Cell)}
    old = json.loads(Path(path).read_text())
    if (old.get("provenance") or {}).get("cpu_kernels") is None:
        say(
            f"baseline {path}: records no CPU kernels; its GPT cells' digests match only a run "
            "under the kernels it was taken with ([Note: CPU kernels and digests])"
        )
    before_rows = [r for s in ("cells", "injected") for r in old.get(s) or []]
    configs = [_current(r["config"]) for r in before_rows]
    known = set(configs[0]) if configs else set()
    key = lambda config: json.dumps({k: config[k] for k in sorted(known)}, sort_keys=True)
    before = {key(c): r.get("digest") for c, r in zip(configs, before_rows)}

    def match(r):
        config = r["config"]
        newer = set(config) - known
        if any(config[k] != defaults.get(k) for k in newer) or not known <= set(config):
            return None
        return before.get(key(config))

    common = [(r, d) for r in rows if (d := match(r)) is not None]
    changed = [r for r, d in common if r.get("digest") != d]
    say(
        f"baseline {path}: {len(common) - len(changed)}/{len(common)} common cells end in the "
        f"same digest ({len(rows) - len(common)} cells only here)"
    )
    for r in changed[:20]:
        say(f"  changed: {console_row(r)}")
    return changed


DIGESTS_ABOUT = (
    "End-state digests of python -m verify (one per cell, by full configuration): the baseline "
    "for python -m verify --baseline THIS_FILE after a change that must not move any bit. "
    "Comparable only under the CPU kernels in provenance.cpu_kernels, on provenance.device."
)


def write_digests(path: str, report: dict) -> None:
    """The --digests file: per cell its configuration and digest, and the run's provenance."""
    slim = {
        name: [{"config": r["config"], "digest": r.get("digest")} for r in report[name]]
        for name in ("cells", "injected")
    }
    write_json(path, {"about": DIGESTS_ABOUT, **slim, "provenance": report["provenance"]})


def say_raised(errors: list[dict], say) -> None:
    """The summary's lines for the sections that raised as a whole ([Note: a row that raised])."""
    if errors:
        say(f"errors: {len(errors)} section(s) raised, each a failing row:")
    for r in errors:
        say(f"  {r['name']}: {r['error']}")


if __name__ == "__main__":
    cli.run(main, "python -m verify")
