"""``python -m paper_figures``: run the registered sections and print a summary.

Legend: Ψ = num_params, N_d = world_size, K = the optimizer-state multiplier.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from paper_figures.common import PROFILES, Outputs, SummaryRow
from paper_figures.sections import SECTIONS


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
        default=Path(__file__).resolve().parent,
        help="output root for results/, figures/ and tables/ (default: this package's directory)",
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Outputs(root=args.out.resolve())
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
    sys.exit(main())
