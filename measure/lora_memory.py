"""What a LoRA fine-tune holds per rank: a ~99%-frozen GPT at stage 3, against the analytic model.

    python -m measure.lora_memory --world-size 2 64 --chunk 128   # one line per N, as JSON

Each N runs in its own process as rank 0 of a fake world (torch's FakeStore, as in
measure/fake_rank.py): the project's GPT is built on the meta device, zero/workloads/lora.py freezes
it and adds rank-r adapters, and the engine materialises only this rank's shards. The engine's
memory_report() is set beside zero.common.memory.model_state_breakdown over the same elements and
padding (the two must be equal) and beside the formula without padding:
    frozen 2Ψ_f/N + trainable (2 + 2 + 12)Ψ_t/N    (bf16 working copy and gradients, Adam)
Legend: Ψ_f frozen and Ψ_t trainable parameters, N = N_d. The paper's configuration: bf16, the
gradients reduced in bf16, M = N. A count of bytes, not a timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 512, "block_size": 64}
"""The GPT of the measurement: 3.3M parameters, of which LoRA at rank 2 trains 1.0%."""


def lora_memory(
    world_size: int, *, stage: int = 3, rank: int = 2, chunk: int = 4096, shape=None
) -> dict:
    """Rank 0 of a fake world of `world_size` ranks (this process joins it): the LoRA GPT's
    memory_report() and the analytic model's categories, in bytes. chunk: the clipping chunk
    C; every shard is a multiple of it, so small units (the adapters) pay up to N·C of padding.
    Without a fake world already joined, this process joins one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zero.common.memory import model_state_breakdown
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.workloads.lora import add_lora
    from zero.workloads.models import GPT, GPTConfig

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    model = GPT(GPTConfig(**(shape or SHAPE)), device="meta")
    add_lora(model, rank)
    cfg = ZeroConfig(
        stage=stage,
        precision="bf16",
        reduce_dtype="bf16",
        micro_batches=world_size,
        units=tuple(model.unit_names()),
        chunk=chunk,
    )
    eng = ZeroEngine(model, cfg, device="cpu", init_seed=None)
    report = {k: v for k, v in eng.memory_report().items() if k != "comm_buffers"}

    psi_t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    psi_f = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    padded_t = sum(u.part.padded_numel for u in eng.units)
    padded_f = sum(u.part.padded_numel for u in eng.frozen_units)
    exact = model_state_breakdown(
        num_params=psi_t,
        padding=padded_t - psi_t,
        frozen_params=psi_f,
        frozen_padding=padded_f - psi_f,
        world_size=world_size,
        stage=stage,
    ).to_dict()
    bare = model_state_breakdown(
        num_params=psi_t, frozen_params=psi_f, world_size=world_size, stage=stage
    ).to_dict()
    dist.destroy_process_group()
    return {
        "world_size": world_size,
        "stage": stage,
        "lora_rank": rank,
        "chunk": chunk,
        "psi_trainable": psi_t,
        "psi_frozen": psi_f,
        "frozen_fraction": psi_f / (psi_t + psi_f),
        "engine": {**report, "total": sum(report.values())},
        "analytic_with_padding": exact,
        "analytic": bare,
    }


def measure(world_sizes, *, stage: int = 3, chunk: int = 4096) -> list[dict]:
    """lora_memory for each N, each in a fresh process (a fake world per process)."""
    out = []
    for n in world_sizes:
        code = (
            "import json, sys; from measure.lora_memory import lora_memory; "
            f"print(json.dumps(lora_memory({int(n)}, stage={int(stage)}, chunk={int(chunk)})))"
        )
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2, 64])
    ap.add_argument("--stage", type=int, default=3, choices=range(4))
    ap.add_argument("--chunk", type=int, default=4096, help="clipping chunk C (default 4096)")
    args = ap.parse_args(argv)
    for rec in measure(args.world_size, stage=args.stage, chunk=args.chunk):
        print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
