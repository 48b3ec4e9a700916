"""Verification cells on one CUDA device in a real single-rank NCCL group (tests/gpu).

    python tests/gpu/cuda_cells.py OUT.json

Runs injected-gradient cells (verify/cells/inject.py) at every stage and precision, with and without
ZeRO-Offload and contiguous buffers, on an engine built on cuda:0, and writes the merged rows.
Injected cells feed the same gradients to the engine and to the reference, so the comparison is
bitwise on any device: the reduction tree, the casts and the op-ordered optimizer must give the
reference's bits on the GPU too (docs/design.md §2, the reciprocal rule for scalar divisions).
Cells with the model's own backward are not run here: their reference gradients are computed
on the CPU, whose matmuls give other bits than the GPU's.
"""

import json
import sys

import torch
import torch.distributed as dist

from verify.cells.cell import Cell
from verify.checks.harness import run_cells
from verify.checks.report import merge


def cells() -> list[Cell]:
    out = []
    for stage in (0, 1, 2, 3):
        for precision, optimizer in (("fp32", "adamw"), ("bf16", "adam"), ("fp16", "sgd")):
            for gradients in ("random", "extreme"):
                out.append(
                    Cell(
                        stage=stage,
                        world_size=1,
                        precision=precision,
                        optimizer=optimizer,
                        mode="deterministic",
                        model="params-uneven",
                        gradients=gradients,
                    )
                )
        for offload, contiguous in ((True, False), (False, True), (True, True)):
            out.append(
                Cell(
                    stage=stage,
                    world_size=1,
                    precision="bf16",
                    optimizer="adamw",
                    mode="deterministic",
                    model="params-uneven",
                    gradients="random",
                    features=tuple(
                        name
                        for name, on in (("offload", offload), ("contiguous", contiguous))
                        if on
                    ),
                )
            )
    return out


def main(path: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    plan = cells()
    rows = [merge(c, [r]) for c, r in zip(plan, run_cells(0, 1, plan))]
    out = {"rows": rows, "max_allocated": torch.cuda.max_memory_allocated()}
    with open(path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
