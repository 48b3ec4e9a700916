"""The command line: `python -m zero.checkpoint consolidate DIR OUT` and `... verify DIR`.

Legend: DIR a checkpoint root (its `latest` is followed) or a step directory; OUT a file that
torch.save writes (through a temp file beside it). Exit status 0 on success; 2 with one line on
stderr for an OUT that cannot be written (a directory, a missing or read-only folder), checked
before any work; 1 with the error on stderr (CheckpointError or ValueError: a corrupt, incomplete
or mismatched checkpoint, naming the file). Both commands read every file the manifest lists.
"""

from __future__ import annotations

import argparse
import sys

from .consolidate import check_out, consolidate_to
from .format import CheckpointError, resolve, verify


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zero.checkpoint",
        description="Checkpoints: consolidate one to plain PyTorch, or verify its checksums.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one plain PyTorch state dict")
    c.add_argument("directory", help="a checkpoint root (follows `latest`) or a step directory")
    c.add_argument("out", help="output file (torch.save)")
    v = sub.add_parser("verify", help="check the manifest and every file's sha256")
    v.add_argument("directory")
    args = p.parse_args(argv)
    if args.command == "consolidate":
        try:  # before the work: a bad OUT would otherwise be found after reading every shard
            check_out(args.out)
        except ValueError as exc:
            print(f"{p.prog}: error: {exc}", file=sys.stderr)
            return 2
    try:
        if args.command == "consolidate":
            out = consolidate_to(args.directory, args.out)
            print(f"wrote {out} from {resolve(args.directory)}")
        else:
            m = verify(args.directory)
            print(
                f"{resolve(args.directory)}: {len(m['files'])} files verified; step "
                f"{m['data_step']}, t {m['t']}, N {m['world_size']}, stage {m['stage']}"
            )
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
