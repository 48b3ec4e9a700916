"""The command line of python -m verify: its options, grouped (the presets, the matrix's
selection, the sections' own from the table in verify/command/sections.py, the reports, where
the ranks run), and the checks that refuse bad input by name before anything starts
(docs/design.md §5, "Bad input"): each a function raising ValueError, which parse turns into
argparse's one error line and exit status 2."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zero.common import cli
from zero.common.results import ISA_LADDER, cpu_kernels, kernel_caps
from zero.ranks import launch
from zero.ranks.launch import check_timeout

from ..features import FEATURES
from . import sections

DESCRIPTION = "python -m verify: run the engine against the reference over a matrix of cells."
"""The first line of verify/__main__.py's docstring: the description --help shows."""


def add_presets(p: argparse.ArgumentParser) -> None:
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick", action="store_true", help="the CI preset: pairwise covering + teeth cells"
    )
    preset.add_argument(
        "--complete", action="store_true", help="the release preset: 3-wise covering + slices"
    )


def add_selection(p: argparse.ArgumentParser) -> None:
    """The matrix's explicit grid (without a preset), and --world-sizes (with one too)."""
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=None,
        help="default 1 2 4; with a preset: run only its cells of these world sizes",
    )
    precisions, optimizers = ["fp32", "bf16", "fp16"], ["sgd", "adam", "adamw"]
    p.add_argument("--precisions", nargs="+", default=list(precisions), choices=precisions)
    p.add_argument("--optimizers", nargs="+", default=list(optimizers), choices=optimizers)
    p.add_argument("--mode", default="deterministic", choices=["deterministic", "fast", "both"])
    p.add_argument(
        "--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "mlp-uneven", "gpt"]
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulation", type=int, default=2, help="M/N micro-steps per step")
    p.add_argument(
        "--features",
        nargs="+",
        default=None,
        metavar="FEATURE",
        help="options of the feature registry (verify/features/: "
        + ", ".join(n for n, f in FEATURES.items() if not f.section)
        + "): with a preset, only its cells that use every one named; without, the explicit "
        "grid with these features (a value as bucket_elements=256)",
    )


def add_reports(p: argparse.ArgumentParser) -> None:
    """What the run writes and prints."""
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


def add_ranks(p: argparse.ArgumentParser) -> None:
    """Where and how long the ranks run."""
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verify", description=DESCRIPTION)
    add_presets(p)
    add_selection(p)
    sections.add_options(p)
    add_reports(p)
    add_ranks(p)
    return p


def parse(argv=None) -> argparse.Namespace:
    """The options, checked (CHECKS, in order); where the ranks run with its defaults filled in."""
    p = parser()
    args = p.parse_args(argv)
    for check in CHECKS:
        try:
            check(args)
        except ValueError as exc:
            p.error(str(exc))
    return args


def check_counts(args) -> None:
    if args.world_sizes is not None and any(n < 1 for n in args.world_sizes):
        raise ValueError(f"--world-sizes {args.world_sizes}: each must be >= 1")
    if args.steps < 1 or args.accumulation < 1:
        raise ValueError(
            f"--steps {args.steps} --accumulation {args.accumulation}: each must be >= 1"
        )


def check_outputs(args) -> None:
    """The timeout, and every file the run writes (before any work)."""
    try:
        check_timeout(args.timeout, "timeout")
        for name in ("json", "markdown", "digests"):
            if getattr(args, name) is not None:
                cli.check_writable(name, getattr(args, name), file=True)
    except ValueError as exc:
        raise ValueError(cli.error_line(exc)) from None


def check_where(args) -> None:
    """Fills in --backend and --device (choose_where); a section that runs alone and computes
    on the CPU only is refused on a GPU."""
    args.backend, args.device = choose_where(args.backend, args.device)
    alone = sections.alone_on_cpu(args)
    if args.device != "cpu" and alone is not None:
        raise ValueError(
            f"{alone} with --device {args.device}: that section computes on the CPU; "
            "allowed is --device cpu"
        )


def check_baseline(args) -> None:
    if args.baseline is None:
        return
    if not Path(args.baseline).is_file():
        raise ValueError(f"--baseline {args.baseline!r}: no such file; allowed is a JSON report")
    check_kernels(args.baseline)
    check_baseline_device(args.baseline, args.device)


CHECKS = (check_counts, check_outputs, check_where, check_baseline)
"""parse's checks of the parsed options, in order: the first to refuse is the error line."""


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
