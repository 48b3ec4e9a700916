"""The disk tier's small engine (tests/distributed/test_disk_tier.py, test_disk_exits.py), and
a process holding one, for the tests of how its folder goes.

`python -m tests.helpers.disk_child OFFLOAD_DIR STORE RANK WORLD ACTION`: joins a gloo world
through the file STORE, builds engine(1, OFFLOAD_DIR), trains one step, prints `ready ROOT`
(ROOT: its folder), then:
    wait      sleeps until a signal ends it
    raise     raises an exception
    exit      returns with the engine still referenced (at interpreter exit)
    tamper    removes one of its state files and trains on: the disk tier's refusal ends it
    barrier   waits in a collective its peer never joins (a C call the main thread stays in)
    fsize     (before the engine) a file size limit (RLIMIT_FSIZE) too small for a state file
It runs through zero.common.cli.run, as every command line of the project does: a ValueError
is one line and exit status 2. The signals' actions are set to Python's defaults first, so
that a test does not depend on what its own parent ignores.
"""

import resource
import signal
import sys
import time

import torch.distributed as dist

from verify.cells.cell import GROUPS
from zero.common import cli
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.workloads.models import MLP, MLPConfig, mlp_microbatches

CFG = MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)


def engine(stage, directory, *, offload_dir=True, precision="bf16"):
    model = MLP(CFG, seed=5)
    return ZeroEngine(
        model,
        ZeroConfig(
            stage=stage, precision=precision, optimizer="adamw", groups=GROUPS["adamw"][:1],
            micro_batches=2 * dist.get_world_size(), units=tuple(model.unit_names()), chunk=128,
            offload_optimizer=True, offload_dir=str(directory) if offload_dir else None,
        ),
    )  # fmt: skip


def train(eng, steps=3):
    n, r = eng.world_size, eng.rank
    for s in range(steps):
        batches = mlp_microbatches(CFG, seed=0, data_step=s, count=2 * n, batch_size=4)
        for k in range(2):
            _, loss = eng(*batches[k * n + r])
            eng.backward(loss)
        eng.step()


FSIZE = 4096
"""Bytes a file may reach with `fsize`: the owner's record fits, the first state file not."""

KEEP = []
"""Engines referenced until the process ends."""


def main(argv) -> int:
    directory, store, rank, world, action = argv
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, int(world)), rank=int(rank), world_size=int(world)
    )
    if action == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a signal that ends it
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))
    eng = engine(1, directory)
    train(eng, 1)
    offload = eng.placement.offload
    print("ready", offload.root, flush=True)
    if action == "raise":
        raise RuntimeError("an error in the middle of the run")
    if action == "exit":
        KEEP.append(eng)
        return 0
    if action == "tamper":
        offload.files[eng.units[0].index][1].path.unlink()
        train(eng, 1)
    if action == "barrier":
        dist.barrier()
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    cli.run(main, "disk_child", sys.argv[1:])
