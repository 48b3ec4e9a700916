r"""Continue training with plain PyTorch FSDP2 from a DCP checkpoint, then save one.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_continue.py \
        --load out/engine-2 --save out/fsdp2-3 --steps 1

Nothing here is the ZeRO engine's: FSDP2 (fully_shard), torch.distributed.checkpoint and
torch.optim.AdamW, as torch documents them. The checkpoint it loads may come from the engine
(zero.checkpoint.save_dcp; examples/engine_continue.py) or from FSDP2 itself, and the engine
loads what this saves. The one thing shared is the model's definition (zero.workloads.models'
GPT: copy it, or use your own model with the same parameter names). Runs on CPUs (gloo).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from zero.workloads.models import GPT, GPTConfig

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # the keys torchtitan saves


def make_model() -> GPT:
    """The model both scripts train: a small GPT-2-style decoder (0.12M parameters)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64))


def batch(model: GPT, step: int, index: int, size: int = 4):
    """Batch `index` of data step `step`, a function of those alone: sequences counting
    modulo the vocabulary from a random start by a random stride; targets shifted by one."""
    vocab, length = model.cfg.vocab_size, model.cfg.block_size
    g = torch.Generator().manual_seed(1_000_003 * step + index)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 9, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(length + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def load(model, opt, folder: str) -> None:
    """dcp.load into get_state_dict's dicts, then set_state_dict: each rank reads its shards."""
    msd, osd = get_state_dict(model, opt, options=FLAT)
    sd = {**msd, **osd}
    dcp.load(sd, checkpoint_id=folder)  # fills tensors in place, replaces plain values
    set_state_dict(
        model,
        opt,
        model_state_dict={k: sd[k] for k in msd},
        optim_state_dict={k: sd[k] for k in osd},
        options=FLAT,
    )


def save(model, opt, folder: str) -> None:
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save({**msd, **osd}, checkpoint_id=folder)


def digest(model, opt) -> dict[str, str]:
    """sha256 of every parameter's and optimizer state's fp32 bytes, by DCP key (call on every
    rank: FSDP2 gathers the full tensors to rank 0; the other ranks get {})."""
    full = StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
    )
    msd, osd = get_state_dict(model, opt, options=full)
    names = {name for name, _ in model.named_parameters()}  # a tied weight once
    values = {k: v for k, v in msd.items() if k in names}
    values.update({k: v for k, v in osd.items() if k.startswith("state.")})
    return {k: sha256(v) for k, v in sorted(values.items())}


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the DCP checkpoint folder to start from")
    p.add_argument("--save", required=True, help="the DCP checkpoint folder to write")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps to take")
    p.add_argument("--digest", help="write the loaded and saved state's sha256 here (JSON)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
        lr=1e-3,
    )

    load(model, opt, args.load)
    digests = {"loaded": digest(model, opt)}
    # torch.optim counts steps per parameter; the next data step is that count
    start = int(max(float(s["step"]) for s in opt.state.values()))
    if rank == 0:
        print(f"loaded {args.load}: step {start}")
    for step in range(start, start + args.steps):
        _, loss = model(*batch(model, step, rank))  # one batch per rank, gradients averaged
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: rank 0 loss {loss.item():.4f}")
    save(model, opt, args.save)
    digests["saved"] = digest(model, opt)
    if rank == 0:
        print(f"saved {args.save}: step {start + args.steps}")
        if args.digest:
            with open(args.digest, "w") as f:
                json.dump(digests, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
