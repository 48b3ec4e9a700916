"""`python -m verify.faults [--fast | --release] [--only NAME ...] [--json PATH] [--list]`.

Runs the fault cases (verify/faults/__init__.py), one table row per case, then the figures. Exit
status 1 if any case hung, gave a silent wrong result, lost a committed checkpoint's bytes, left an
orphan, a temp dir or a leftover that its next run did not remove, or gave an unclear error (a bad
input included); 2 for bad options."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from zero.common import cli

from . import all_cases
from .core import Ctx, Figures, Result
from .runs import Shared


def run_cases(cases, *, seed: int = 0, work: Path | None = None, echo=print) -> tuple:
    """Run `cases` in order; (Figures, [(case, Result)])."""
    figures, rows = Figures(), []
    keep = os.environ.get("FAULTS_KEEP")  # keep every case's files, for debugging
    with tempfile.TemporaryDirectory(prefix="faults-", dir=work) as tmp:
        root = Path(tempfile.mkdtemp(prefix="faults-kept-")) if keep else Path(tmp)
        shared = Shared(root, seed)
        for case in cases:
            ctx = Ctx(root, case, shared)
            started = time.monotonic()
            try:
                result = case.run(ctx)
            except Exception as exc:  # noqa: BLE001 - the suite's own failure, shown per case
                result = Result("unclear", f"the case itself failed: {type(exc).__name__}: {exc}")
            except BaseException:  # interrupted: leave nothing of the case running
                for job in ctx.jobs:
                    job.kill()
                raise
            result = ctx.finish(result)
            result.seconds = time.monotonic() - started
            figures.add(case.name, result)
            rows.append((case, result))
            echo(row(case, result))
    return figures, rows


def row(case, r: Result) -> str:
    verdict = r.verdict
    if r.bad_inputs:
        verdict = f"{r.clear}/{r.bad_inputs} clear"
    flag = "FAIL" if r.failed or r.clear != r.bad_inputs else "ok"
    return f"| {case.name} | {case.family} | {verdict} | {flag} | {r.seconds:.1f} | {r.detail} |"


HEADER = "| case | family | outcome | | s | detail |\n|---|---|---|---|---|---|"


def summary(f: Figures) -> str:
    return "\n".join([
        f"faults injected: {f.faults}",
        f"  survived (bitwise, or resumed bitwise): {f.survived}",
        f"  refused with a clear error: {f.refused}",
        f"  hangs: {f.hangs}",
        f"  silent wrong results: {f.silent_wrong}",
        f"  unclear errors: {f.unclear}",
        f"bytes lost (committed checkpoints that no longer verify): {f.bytes_lost}",
        f"orphan processes: {f.orphans}; temp dirs left: {f.temp_left}",
        f"leftovers (files a crash left that the next run did not remove): {f.leftovers}",
        f"bad inputs tried: {f.bad_inputs}; clear one-line errors: {f.clear_errors}",
        "failing cases: " + (", ".join(f.failed_cases) or "none"),
    ])  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m verify.faults", description=__doc__.split("\n")[0])
    tier = p.add_mutually_exclusive_group()
    tier.add_argument("--fast", action="store_true", help="the cheapest case of each family")
    tier.add_argument("--release", action="store_true", help="every case (the default)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these cases")
    p.add_argument("--seed", type=int, default=0, help="seed of the random fault points")
    p.add_argument("--json", help="write the figures and every row here")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)
    if args.seed < 0:
        raise ValueError(f"seed={args.seed} is not allowed: expected an integer >= 0")
    if args.json:
        cli.check_writable("json", args.json, file=True)
    cases = all_cases(release=not args.fast)
    if args.fast:
        cases = [c for c in cases if c.fast]
    if args.only:
        known = {c.name for c in all_cases(release=True)}
        unknown = sorted(set(args.only) - known)
        if unknown:
            raise ValueError(f"only={unknown} is not allowed: expected case names ({len(known)})")
        cases = [c for c in all_cases(release=True) if c.name in args.only]
    if args.list:
        for c in cases:
            print(f"{c.name} [{c.family}{', fast' if c.fast else ''}]: {c.fault} -> {c.right}")
        return 0
    print(HEADER, flush=True)
    figures, rows = run_cases(cases, seed=args.seed, echo=lambda s: print(s, flush=True))
    print()
    print(summary(figures))
    if args.json:
        record = {
            "figures": asdict(figures),
            "rows": [
                {
                    "name": c.name,
                    "family": c.family,
                    "fault": c.fault,
                    "right": c.right,
                    **asdict(r),
                }
                for c, r in rows
            ],  # fmt: skip
        }
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0 if figures.ok else 1


if __name__ == "__main__":
    cli.run(main, "python -m verify.faults")
