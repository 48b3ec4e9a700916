"""A torchrun entry point whose last collectives are asynchronous all-gathers, only the last one
waited (as a pipelined step's may be), ending through zero.common.cli.run like every CLI of the
project.

`torchrun --standalone --nproc-per-node 4 -m tests.helpers.async_exit`: on code that exits with
the process group alive, about half of such launches end with a rank killed by SIGABRT during
interpreter finalization (tests/distributed/test_shutdown.py).
"""

import torch
import torch.distributed as dist

from zero.common import cli
from zero.ranks import launch


def main(argv=None) -> int:
    rank, world, _ = launch.init_from_env(timeout_s=60)
    for _ in range(3):
        x = torch.full((1 << 16,), float(rank))
        outs = [[torch.empty_like(x) for _ in range(world)] for _ in range(8)]
        works = [dist.all_gather(o, x, async_op=True) for o in outs]
        works[-1].wait()
    return 0


if __name__ == "__main__":
    cli.run(main, "python -m tests.helpers.async_exit")
