"""python -m verify: run the engine against the reference over a matrix of cells.

    python -m verify --quick                                  # the CI preset (verify/matrix.py)
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
summary and the reports are still written (verify.report.guarded). Deterministic cells must be
bitwise equal on every rank. Fast cells run in lock-step (verify/lockstep.py): each
step starts from the reference's state and the reduced gradient, master, optimizer states and
working copy must each lie within their derived bound; the row prints the worst check's measured
error beside its bound (a cell passes at ratio <= 1).

Sections of the report (verify/report.py): "cells" (gradients from backward), "injected" (gradients
fed in by verify/inject.py), "world_size_invariance" (verify/invariance.py) and, with --resume,
"resume" (checkpoint resume and resharding, from verify/resume.py when present); the presets and
--parity add "parity" and "parity_invariance" (the engine against plain PyTorch on several model
families, verify/parity.py); the presets and --mp add "mp" and "mp_invariance" (ZeRO inside the DP
group of each tensor-parallel slice against reference/mp.py, verify/mp_cells.py; --no-mp leaves it
out of a preset). The presets end with "watchdog" (verify/watchdog_cells.py) and "refusals" (bad
input and damaged checkpoints refused by name, verify/refusals.py). On a GPU (--device cuda) the
cells and the invariance table run there; the parity, model-parallel, watchdog, refusals and resume
sections compute on the CPU and each says in one line that it is skipped. The report names the
backend and the device (provenance.backend, provenance.device). """

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from zero.common import cli
from zero.common.results import (
    ISA_LADDER,
    cpu_kernels,
    kernel_caps,
    provenance,
    write_atomic,
    write_json,
)
from zero.ranks import launch
from zero.ranks.launch import check_timeout

from . import invariance, matrix
from .cell import Cell
from .report import SECTIONS, console_row, guarded, markdown, sanitize, section
from .run import Where, run_matrix

MODES = ("deterministic", "fast")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verify", description=__doc__.split("\n\n")[0])
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick", action="store_true", help="the CI preset: pairwise covering + teeth cells"
    )
    preset.add_argument(
        "--complete", action="store_true", help="the release preset: 3-wise covering + slices"
    )
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=None,
        help="default 1 2 4; with a preset: run only its cells of these world sizes",
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "bf16", "fp16"],
        choices=["fp32", "bf16", "fp16"],
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=["sgd", "adam", "adamw"],
        choices=["sgd", "adam", "adamw"],
    )
    p.add_argument("--mode", default="deterministic", choices=["deterministic", "fast", "both"])
    p.add_argument(
        "--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "mlp-uneven", "gpt"]
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulation", type=int, default=2, help="M/N micro-steps per step")
    p.add_argument(
        "--invariance",
        action="store_true",
        help="also run the world-size-invariance table (presets always do)",
    )
    p.add_argument(
        "--no-invariance", action="store_true", help="skip the invariance table of a preset"
    )
    p.add_argument(
        "--resume", action="store_true", help="add the resume/reshard table (verify/resume.py)"
    )
    p.add_argument(
        "--parity",
        action="store_true",
        help="only the parity-with-plain-PyTorch section (verify/parity.py): its quick cells, "
        "or every cell with --complete (the presets include it)",
    )
    p.add_argument(
        "--mp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the model-parallel section (verify/mp_cells.py): ZeRO in the DP group of each "
        "tensor-parallel slice against reference/mp.py; its quick cells, or every cell with "
        "--complete, and nothing else (as --parity); the presets include it, --no-mp leaves it out",
    )
    p.add_argument("--json", default=None, help="write the JSON report here")
    p.add_argument("--markdown", default=None, help="write the Markdown report here")
    p.add_argument(
        "--baseline",
        default=None,
        help="a JSON report of an earlier run: every cell run by both must end in the same "
        "state digest (a refactoring check)",
    )
    p.add_argument(
        "--digests",
        default=None,
        help="write only each cell's configuration and end-state digest, with the provenance "
        "(the CPU kernels included): a small file for a later --baseline",
    )
    p.add_argument("--list", action="store_true", help="print the cells per world size, run none")
    p.add_argument(
        "--coverage",
        action="store_true",
        help="run under coverage.py and print the library's line coverage against "
        "verify/uncovered.toml (python -m verify.linecoverage)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per world size")
    p.add_argument(
        "--backend",
        choices=launch.BACKENDS,
        default=None,
        help="the ranks' process group: default gloo, or nccl under torchrun where CUDA is "
        "available; nccl needs one GPU per rank",
    )
    p.add_argument(
        "--device",
        choices=launch.DEVICES,
        default=None,
        help="where each rank computes: default cpu, or cuda under torchrun where CUDA is "
        "available; cuda launched plainly runs gloo ranks that share the GPUs, so N > 1 runs "
        "on one GPU",
    )
    args = p.parse_args(argv)
    if args.world_sizes is not None and any(n < 1 for n in args.world_sizes):
        p.error(f"--world-sizes {args.world_sizes}: each must be >= 1")
    if args.steps < 1 or args.accumulation < 1:
        p.error(f"--steps {args.steps} --accumulation {args.accumulation}: each must be >= 1")
    try:
        check_timeout(args.timeout, "timeout")
        for name in ("json", "markdown", "digests"):
            if getattr(args, name) is not None:
                cli.check_writable(name, getattr(args, name), file=True)
    except ValueError as exc:
        p.error(cli.error_line(exc))
    try:
        args.backend, args.device = choose_where(args.backend, args.device)
        if args.device != "cpu" and (args.parity or mp_alone(args)):
            alone = "--parity" if args.parity else "--mp"
            raise ValueError(
                f"{alone} with --device {args.device}: that section computes on the CPU; "
                "allowed is --device cpu"
            )
    except ValueError as exc:
        p.error(str(exc))
    if args.baseline is not None and not Path(args.baseline).is_file():
        p.error(f"--baseline {args.baseline!r}: no such file; allowed is a JSON report")
    if args.baseline is not None:
        try:
            check_kernels(args.baseline)
            check_baseline_device(args.baseline, args.device)
        except ValueError as exc:
            p.error(str(exc))
    return args


def choose_where(backend: str | None, device: str | None) -> tuple[str, str]:
    """(backend, device) of --backend and --device with the defaults filled in
    (zero.ranks.launch.choose_where): gloo on the CPU, or under torchrun NCCL on the GPUs where
    there are some; --device cuda alone means gloo ranks sharing the GPUs when launched plainly.
    Refused by name: NCCL on the CPU, and cuda where this torch has no CUDA or sees no GPU
    (counted through NVML: the launcher must not initialise CUDA before it forks ranks,
    [Note: fork] in zero/ranks/launch.py)."""
    if backend == "nccl" and device == "cpu":
        raise ValueError(
            "--backend nccl --device cpu: NCCL carries GPU tensors only; allowed are "
            "--backend nccl --device cuda, or --backend gloo on either device"
        )
    asked = "--device cuda" if device == "cuda" else "--backend nccl (on --device cuda)"
    backend, device = launch.choose_where(backend, device, torchrun=launch.under_torchrun())
    if device == "cuda" and launch.visible_gpus() == 0:
        import torch

        why = (
            "this torch is built without CUDA (torch.version.cuda is None)"
            if torch.version.cuda is None
            else "no CUDA device is visible (torch.cuda.device_count() is 0)"
        )
        raise ValueError(f"{asked}: {why}; allowed here is --device cpu")
    return backend, device


def check_local_nccl(backend: str, sizes: list[int]) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): launched plainly, every
    world size of the run must have a GPU per rank. Refused by name before any rank starts."""
    if backend != "nccl" or launch.under_torchrun() or not sizes:
        return
    gpus = launch.visible_gpus()
    if max(sizes) > gpus:
        raise ValueError(
            f"--backend nccl: world size {max(sizes)} needs {max(sizes)} GPUs (NCCL refuses two "
            f"ranks on one GPU) and {gpus} are visible; allowed are world sizes up to {gpus} "
            "(--world-sizes), --backend gloo --device cuda (gloo ranks sharing the GPUs), or "
            "torchrun --nproc-per-node N on a machine with N GPUs"
        )


def check_baseline_device(path: str, device: str) -> None:
    """Refuse a digest baseline taken on another device: a GPU's kernels give other bits than
    a CPU's, so every backward cell would differ. A report that records no device (older
    than --device) is compared as it is."""
    then = (json.loads(Path(path).read_text()).get("provenance") or {}).get("device")
    if then is not None and then != device:
        raise ValueError(
            f"--baseline {path!r}: provenance.device={then!r} but this run's is {device!r}; "
            f"digests depend on the device's kernels; allowed is a baseline taken with "
            f"--device {device}"
        )


def cpu_only(args, name: str, say) -> bool:
    """Whether a section that computes on the CPU is skipped in this run (on a GPU); if so,
    says it in one line."""
    if args.device == "cpu":
        return False
    say(f"({name} skipped on device {args.device}: it computes on the CPU; --device cpu runs it)")
    return True


def check_kernels(path: str) -> None:
    """Refuse a digest baseline taken under other CPU kernels than this run's, before any cell
    runs: its GPT cells would differ in every bit that torch's kernels choose, not by any change of
    ours ([Note: CPU kernels and digests] in zero/common/results.py). A report that records no
    kernels is compared as it is (compare_baseline says so)."""
    try:
        then = (json.loads(Path(path).read_text()).get("provenance") or {}).get("cpu_kernels")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"--baseline {path!r}: not a JSON report ({exc})") from None
    now = cpu_kernels()
    if then is None or then == now:
        return
    if not isinstance(then, dict):
        raise ValueError(f"--baseline {path!r}: provenance.cpu_kernels={then!r} is not a dict")
    stronger = all(
        ISA_LADDER.index(then[k]) <= ISA_LADDER.index(now[k])
        for k in ("aten", "onednn")
        if then.get(k) in ISA_LADDER and now.get(k) in ISA_LADDER
    )
    fix = (
        f"rerun as `{kernel_caps(then)} python -m verify ...` to use its kernels here"
        if stronger
        else "this CPU cannot run its kernels; take a baseline on this machine"
    )
    raise ValueError(
        f"--baseline {path!r}: provenance.cpu_kernels={then} but this run's are {now}; end-state "
        f"digests depend on torch's CPU kernels, so the two cannot be compared; {fix}"
    )


def cells_for(args) -> list[Cell]:
    """The explicit grid of the selection options (no preset)."""
    return matrix.cells(
        world_size=args.world_sizes or [1, 2, 4],
        stage=args.stages,
        precision=args.precisions,
        optimizer=args.optimizers,
        mode=MODES if args.mode == "both" else args.mode,
        model=args.models,
        steps=args.steps,
        accumulation=args.accumulation,
    )


def plan(args) -> tuple[list[Cell], list[dict]]:
    """(cells, invariance runs) that this invocation runs."""
    if args.parity or mp_alone(args):  # one section alone (parity_section, mp_section)
        return [], []
    if args.quick or args.complete:
        cells, runs = matrix.quick() if args.quick else matrix.complete()
        if args.world_sizes is not None:
            has = sorted({c.world_size for c in cells})
            cells = [c for c in cells if c.world_size in args.world_sizes]
            if not cells:  # else "0/0 cells" and exit 1 without a reason
                preset = "--quick" if args.quick else "--complete"
                raise ValueError(
                    f"world_sizes={args.world_sizes}: the {preset} preset has cells of world "
                    f"sizes {has} only; allowed are some of those"
                )
    else:
        cells = cells_for(args)
        runs = matrix.invariance_runs(full=False) if args.invariance else []
        runs = [r for r in runs if r["stage"] in args.stages]
    if args.no_invariance:
        runs = []
    if not cells and not runs:
        raise ValueError("the selection options give no cells: allowed is a non-empty selection")
    return cells, runs


def list_plans(args) -> dict[str, list]:
    """The plans besides the cells that `--list` reports feature pairs over (verify/
    interactions.py): the resume cases and model-parallel rows with --resume, the model-parallel
    cells and the watchdog cells with a preset, the GPU tests that exist in this checkout."""
    from . import interactions, mp_cells, mp_resume, resume, watchdog_cells

    plans: dict[str, list] = {}
    if args.resume:
        plans["resume"] = resume.resume_cases(quick=not args.complete)
    if args.quick or args.complete:
        mp = mp_cells.complete_cells() if args.complete else mp_cells.quick_cells()
        plans["mp"] = list(mp) + (list(mp_resume.row_names()) if args.resume else [])
        plans["watchdog"] = list(watchdog_cells.CELLS)
    root = Path(__file__).resolve().parent.parent
    plans["gpu"] = [t for t in interactions.GPU_TESTS if (root / t).is_file()]
    return plans


def resume_section(args, say) -> list[dict] | None:
    """The optional checkpoint resume/reshard table (verify/resume.py): rows with `passed`,
    or None without --resume. The quick cases, or every case with --complete."""
    if not args.resume or cpu_only(args, "resume", say):
        return None
    if importlib.util.find_spec("verify.resume") is None:
        say("--resume: verify/resume.py is not in this checkout; no resume table")
        return []
    module = importlib.import_module("verify.resume")
    kwargs = {"timeout_s": args.timeout, "quick": not args.complete}
    if args.world_sizes is not None:
        kwargs["world_sizes"] = tuple(args.world_sizes)
    rows = module.run_table(**kwargs)
    say("resume (train k steps, save, load at another N and stage, train on; bitwise;")
    say("        consolidated = engine bitwise, torch.optim's next step within its bound):")
    for r in rows:
        where = f"N={r['from_world_size']} stage {r['from_stage']} -> "
        where += f"N={r['to_world_size']} stage {r['to_stage']}"
        verdict = "PASS" if r["passed"] else "FAIL " + r.get("first_mismatch", "")
        ratio = (r.get("consolidated") or {}).get("torch_ratio")
        torch_step = "" if ratio is None else f"  torch.optim {ratio:.2f} of its bound"
        say(f"  {where} {r.get('precision', '')} {r.get('optimizer', '')}  {verdict}{torch_step}")
    return rows


def parity_section(args, say) -> tuple[list[dict], list[dict]] | None:
    """The parity section (verify/parity.py): (rows, invariance rows), or None when this
    invocation has none. --quick and --parity run the quick cells, --complete every cell."""
    if not (args.parity or args.quick or args.complete) or (mp_alone(args) and not args.parity):
        return None
    if cpu_only(args, "parity", say):
        return None
    from . import parity

    cells = parity.complete_cells() if args.complete else parity.quick_cells()
    if args.world_sizes is not None:
        cells = [c for c in cells if c.world_size in args.world_sizes]
    if args.list:
        say(f"parity: {len(cells)} cells over {len(parity.FAMILIES)} families")
        return None
    return parity.run_section(cells, timeout_s=args.timeout, say=say)


def mp_alone(args) -> bool:
    """--mp (as --parity): the model-parallel section alone, its quick cells or with --complete
    every cell; the presets run it by default and --no-mp leaves it out."""
    return args.mp is True


def mp_section(args, say) -> tuple[list[dict], list[dict], list[dict]] | None:
    """The model-parallel section: (rows, invariance rows) of verify/mp_cells.py and the rows
    of verify/mp_lockstep.py (N_m > 1 against N_m = 1), or None when this invocation has none
    (--no-mp, --parity alone, or no preset without --mp)."""
    preset = args.mp is None and (args.quick or args.complete) and not args.parity
    if not (args.mp is True or preset) or cpu_only(args, "mp", say):
        return None
    from . import mp_cells, mp_lockstep

    cells = mp_cells.complete_cells() if args.complete else mp_cells.quick_cells()
    ops = mp_lockstep.complete_cells() if args.complete else mp_lockstep.quick_cells()
    if args.world_sizes is not None:
        cells = [c for c in cells if c.world_size in args.world_sizes]
        ops = [c for c in ops if c.world_size in args.world_sizes]
    if args.list:
        say(f"mp: {len(cells)} cells, {len(ops)} operator cells against N_m = 1")
        return None
    rows, inv = mp_cells.run_section(cells, timeout_s=args.timeout, say=say)
    return rows, inv, mp_lockstep.run_section(ops, timeout_s=args.timeout, say=say)


def watchdog_section(args, say) -> list[dict] | None:
    """The watchdog section (verify/watchdog_cells.py) with --quick and --complete: a diverging
    rank must be named, the right one, on every rank."""
    if not (args.quick or args.complete) or args.parity or mp_alone(args):
        return None
    if cpu_only(args, "watchdog", say):
        return None
    from . import watchdog_cells

    cells = watchdog_cells.CELLS
    if args.world_sizes is not None:
        cells = [c for c in cells if c.world_size in args.world_sizes]
    say("watchdog (some ranks diverge; every rank must name them, or all ranks at a tie):")
    if launch.under_torchrun():  # the section says in one line why it skips
        return watchdog_cells.run_section(timeout_s=args.timeout, say=say, cells=cells)
    return [row for cell in cells for row in watchdog_cell(cell, args.timeout, say)]


def refusals_section(args, say) -> list[dict] | None:
    """The refusals section (verify/refusals.py) with --quick and --complete: each row's bad
    input or damaged checkpoint must raise its named error saying its named text (with --list
    its count line, and None)."""
    preset = (args.quick or args.complete) and not (args.parity or mp_alone(args))
    if not preset or cpu_only(args, "refusals", say):
        return None
    from . import refusals

    if args.list:
        return say(refusals.count_line())
    return refusals.run_section(timeout_s=args.timeout, say=say, world_sizes=args.world_sizes)


def watchdog_cell(cell, timeout_s: float, say) -> list[dict]:
    """One watchdog cell's row; a failing row naming it when its world raised (guarded)."""
    from . import watchdog_cells

    def failed(row: dict) -> list[dict]:
        say(f"  {cell.label:<56} FAIL raised {row['error']}")
        return [{"cell": cell.label, "message": f"raised {row['error']}", **row}]

    run = functools.partial(watchdog_cells.run_section, timeout_s=timeout_s, say=say, cells=[cell])
    return guarded(cell.label, run, wrap=failed)


def compare_baseline(path: str, rows: list[dict], say) -> list[dict]:
    """Rows whose final state digest differs from the same cell's in the report at `path`.
    Cells are matched by their full configuration. A Cell field added since that report counts
    as the same cell while it holds its default (the older code had no other value for it);
    cells in only one report are counted, never compared."""
    defaults = {f.name: f.default for f in dataclasses.fields(Cell)}
    old = json.loads(Path(path).read_text())
    if (old.get("provenance") or {}).get("cpu_kernels") is None:
        say(
            f"baseline {path}: records no CPU kernels; its GPT cells' digests match only a run "
            "under the kernels it was taken with ([Note: CPU kernels and digests])"
        )
    before_rows = [r for s in ("cells", "injected") for r in old.get(s) or []]
    known = set(before_rows[0]["config"]) if before_rows else set()
    key = lambda config: json.dumps({k: config[k] for k in sorted(known)}, sort_keys=True)
    before = {key(r["config"]): r.get("digest") for r in before_rows}

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


def no_matrix(failed: dict, started: float) -> dict:
    """The report of a run whose cells raised as a whole (run_matrix): no rows, the failing row
    in "errors", so that the sections after it still run and the report is still written."""
    empty = {"cells": [], "injected": [], "world_size_invariance": []}
    return {**empty, "errors": [failed], "timing": {"total_s": round(time.time() - started, 1)}}


def say_raised(errors: list[dict], say) -> None:
    """The summary's lines for the sections that raised as a whole ([Note: a row that raised])."""
    if errors:
        say(f"errors: {len(errors)} section(s) raised, each a failing row:")
    for r in errors:
        say(f"  {r['name']}: {r['error']}")


def main(argv=None) -> int:
    args = parse(argv)
    if args.coverage:  # this command again, in a fresh interpreter under coverage: verify's
        # own imports have already run the library's module-level lines unmeasured
        rest = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--coverage"]
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "verify.linecoverage", *rest]
        return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}).returncode
    # under torchrun every rank computes; rank 0 alone prints and writes
    lead = os.environ.get("RANK", "0") == "0"

    def say(*a):
        if lead:
            print(*a, flush=True)

    cells, runs = plan(args)
    sizes = sorted({c.world_size for c in cells})
    started = set(sizes)  # the worlds this run starts: the cells', the invariance table's
    if runs:
        wanted = args.world_sizes
        started |= {n for n in invariance.world_sizes_for(runs) if not wanted or n in wanted}
    check_local_nccl(args.backend, sorted(started))
    torchrun = launch.under_torchrun()
    where = Where(args.backend, args.device)
    say(f"ranks: {where.label(torchrun)}")
    if args.list:
        for n in sizes:
            say(f"N={n}: {sum(c.world_size == n for c in cells)} cells")
        say(f"{len(cells)} cells, {len(runs)} invariance runs")
        for line in matrix.coverage(cells, list_plans(args)):
            say(line)
        parity_section(args, say)
        mp_section(args, say)
        refusals_section(args, say)
        return 0
    if args.device == "cuda":  # deterministic cuBLAS (docs/design.md §2), before any rank starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torchrun:  # join the launched world as asked; every section then uses it
        launch.init_from_env(backend=args.backend, device=args.device)
    t0 = time.time()
    report = guarded(
        "cells",
        lambda: run_matrix(
            cells, runs, timeout_s=args.timeout, say=say, invariance_sizes=args.world_sizes,
            where=where,
        ),
        wrap=lambda failed: no_matrix(failed, t0),
    )  # fmt: skip
    resume = section(report, "resume", lambda: resume_section(args, say))
    if resume is not None:
        report["resume"] = resume
    t0 = time.time()
    par = section(report, "parity", lambda: parity_section(args, say))
    if par is not None:  # the parity section (verify/parity.py)
        report["parity"], report["parity_invariance"] = par
        report["timing"]["parity_s"] = round(time.time() - t0, 1)
        say(f"parity: {sum(r['passed'] for r in par[0])}/{len(par[0])} cells passed, "
            f"{sum(r['passed'] for r in par[1])}/{len(par[1])} digest groups, "
            f"{report['timing']['parity_s']} s")  # fmt: skip
    t0 = time.time()
    mp = section(report, "mp", lambda: mp_section(args, say))
    if mp is not None:  # the model-parallel section (verify/mp_cells.py)
        report["mp"], report["mp_invariance"], report["mp_operators"] = mp
        report["timing"]["mp_s"] = round(time.time() - t0, 1)
        say(f"mp: {sum(r['passed'] for r in mp[0])}/{len(mp[0])} cells passed, "
            f"{sum(r['passed'] for r in mp[1])}/{len(mp[1])} digest groups, "
            f"{sum(r['passed'] for r in mp[2])}/{len(mp[2])} operator cells against N_m = 1, "
            f"{report['timing']['mp_s']} s")  # fmt: skip
    watch = section(report, "watchdog", lambda: watchdog_section(args, say))
    if watch is not None:  # the watchdog section (verify/watchdog_cells.py)
        report["watchdog"] = watch
        say(f"watchdog: {sum(r['passed'] for r in watch)}/{len(watch)} cells passed")
    t0 = time.time()
    refused = section(report, "refusals", lambda: refusals_section(args, say))
    if refused is not None:  # the refusals section (verify/refusals.py)
        report["refusals"] = refused
        report["timing"]["refusals_s"] = round(time.time() - t0, 1)
        say(f"refusals: {sum(r['passed'] for r in refused)}/{len(refused)} rows passed, "
            f"{report['timing']['refusals_s']} s")  # fmt: skip
    launcher = "torchrun" if torchrun else "local"
    report["provenance"] = {
        **provenance(), "backend": args.backend, "device": args.device, "launcher": launcher
    }  # fmt: skip
    timing = report["timing"]
    cell_rows = report["cells"] + report["injected"]
    ok = sum(r["passed"] for r in cell_rows)
    if not (args.parity or mp_alone(args)):  # --parity, --mp alone run no matrix cells
        say(f"{ok}/{len(cell_rows)} cells passed in {timing['total_s']:.1f} s")
    for name in SECTIONS[2:]:
        if report.get(name) and name != "errors":
            ok = sum(r["passed"] for r in report[name])
            say(f"{name}: {ok}/{len(report[name])} passed")
    changed = []
    if args.baseline:
        compare = functools.partial(compare_baseline, args.baseline, cell_rows, say)
        changed = section(report, "baseline", compare, empty=[])
    say_raised(report["errors"], say)
    every = [r for name in SECTIONS for r in report.get(name) or []]
    every += [
        r
        for name in (
            "parity",
            "parity_invariance",
            "mp",
            "mp_invariance",
            "mp_operators",
            "watchdog",
            "refusals",
        )  # fmt: skip
        for r in report.get(name) or []
    ]
    failed = [r for r in every if not r["passed"]]
    if lead and args.json:
        write_json(args.json, sanitize(report))
    if lead and args.digests:
        write_digests(args.digests, report)
    if lead and args.markdown:
        text = markdown(report)
        if par is not None:
            from .parity import markdown as parity_markdown

            text += parity_markdown(*par)
        if mp is not None:
            from .mp_cells import markdown as mp_markdown
            from .mp_lockstep import markdown as operators_markdown

            text += mp_markdown(*mp[:2]) + operators_markdown(mp[2])
        write_atomic(args.markdown, text)
    if torchrun:  # leave the world together: a rank exiting with its group alive may abort
        launch.leave_world()
    return 1 if failed or changed or not every else 0


if __name__ == "__main__":
    cli.run(main, "python -m verify")
