"""``python -m paper_figures``: run the registered sections and print a summary.

Legend: Ψ = num_params, N_d = world_size, K = the optimizer-state multiplier.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from paper_figures.common import PROFILES, Outputs, SummaryRow
from paper_figures.sections import SECTIONS

DEFAULT_OUT = Path("runs/paper_figures")
"""The default output root, under the working directory (runs/ is not in git)."""


def _parser() -> argparse.ArgumentParser:
    names = [s.name for s in SECTIONS]
    parser = argparse.ArgumentParser(
        prog="python -m paper_figures",
        description="Regenerate the ZeRO paper's figures and tables from JSON records.",
        epilog="sections: " + "; ".join(f"{s.name}: {s.about}" for s in SECTIONS),
    )
    parser.add_argument("--profile", choices=PROFILES, default="quick", help="default: quick")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output root for results/, figures/, tables/ and INDEX.md (default: {DEFAULT_OUT}, "
        "with INDEX.md written to the committed paper_figures/INDEX.md)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=names, metavar="NAME", help="run only these sections"
    )
    return parser


def _print_summary(rows: list[tuple[SummaryRow, float]], out: Outputs) -> None:
    table = [("section", "wrote", "matches the paper", "seconds")]
    for row, seconds in rows:
        table.append((row.section, ", ".join(row.wrote), row.matches or "–", f"{seconds:.1f}"))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    print(f"\npaper_figures: wrote under {out.root}")
    for i, r in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def outputs(root: Path | None) -> Outputs:
    """Where a run writes: under `root`, or by default under DEFAULT_OUT with the index written
    to the committed paper_figures/INDEX.md."""
    if root is not None:
        return Outputs(root=root.resolve())
    return Outputs(root=DEFAULT_OUT.resolve(), index=Path(__file__).resolve().parent / "INDEX.md")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.out is not None:
        from zero.common import cli

        cli.check_writable("out", args.out)  # before any section runs
    out = outputs(args.out)
    selected = [s for s in SECTIONS if args.only is None or s.name in args.only]
    rows = []
    for section in selected:
        start = time.perf_counter()
        print(f"[{section.name}] {section.about} ...", flush=True)
        for row in section.run(profile=args.profile, out=out):
            rows.append((row, time.perf_counter() - start))
    _print_summary(rows, out)
    return 0


if __name__ == "__main__":
    from zero.common import cli

    cli.run(main, "python -m paper_figures")
