r"""Train with the ZeRO engine from a DCP checkpoint (this engine's or FSDP2's), then save one.

    torchrun --standalone --nproc-per-node 2 examples/engine_continue.py \
        --save out/engine-2 --steps 2                      # from the start: steps 0-1
    torchrun --standalone --nproc-per-node 2 examples/engine_continue.py \
        --load out/fsdp2-3 --save out/engine-5 --steps 2   # continue FSDP2's checkpoint

Each rank reads only the ranges of the checkpoint it holds (load_dcp) and writes only its own
shard (save_dcp), at any number of ranks and any stage: FSDP2 (examples/fsdp2_continue.py)
reads what this writes and writes what this reads. The model, data and optimizer are those of
fsdp2_continue.py. Runs on CPUs (gloo); every rank runs this file.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from reference.optim import Hyper
from zero import ZeroConfig, ZeroEngine, train_steps
from zero.checkpoint import load_dcp, save_dcp
from zero.config import decay_matrices_only
from zero.ranks.launch import init_from_env, leave_world
from zero.workloads.models import GPT, GPTConfig


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


def engine_config(model: GPT, stage: int, world: int) -> ZeroConfig:
    """AdamW, weight decay on matrices only, one micro-batch per rank per step (as FSDP2 takes
    one batch per rank): the hyper-parameters of fsdp2_continue.py's torch.optim.AdamW. Each
    block is a unit (gathered alone at stage 3), as each block is one fully_shard there."""
    return ZeroConfig(
        stage=stage,
        units=tuple(model.unit_names()),
        optimizer="adamw",
        groups=(Hyper(lr=1e-3, weight_decay=0.1), Hyper(lr=1e-3, weight_decay=0.0)),
        group_of=decay_matrices_only,  # group 0 for matrices, group 1 for the rest
        micro_batches=world,
    )


def digest(engine) -> dict[str, str]:
    """sha256 of every parameter's and optimizer state's fp32 bytes, by DCP key (call on every
    rank: the state is gathered): what fsdp2_continue.py's --digest writes for its own state."""
    master, opt = engine.gather_state()
    out = {}
    for name, value in master.items():
        out[name] = value
        for kind, state in opt.get(name, {}).items():
            out[f"state.{name}.{kind}"] = state
    for name, t in engine.param_steps().items():
        out[f"state.{name}.step"] = torch.tensor(float(t))
    return {k: sha256(v) for k, v in sorted(out.items())}


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", help="a DCP checkpoint folder to start from (default: fresh)")
    p.add_argument("--save", required=True, help="the DCP checkpoint folder to write (new)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps to take")
    p.add_argument("--stage", type=int, default=3, choices=range(4), help="ZeRO stage")
    p.add_argument("--digest", help="write the loaded and saved state's sha256 here (JSON)")
    args = p.parse_args()

    rank, world, _ = init_from_env(backend="gloo", device="cpu")
    torch.set_num_threads(1)
    model = make_model()
    engine = ZeroEngine(model, engine_config(model, args.stage, world))
    digests = {}
    if args.load:
        info = load_dcp(engine, args.load)
        digests["loaded"] = digest(engine)
        if rank == 0:
            print(f"loaded {args.load}: step {info.t}, next data step {info.data_step}")
    results = train_steps(
        engine, lambda step, j: batch(model, step, j), args.steps, start_step=engine.data_step
    )
    if rank == 0:
        print("losses", " ".join(f"{r.loss:.4f}" for r in results))
    save_dcp(engine, args.save)
    digests["saved"] = digest(engine)
    if rank == 0:
        print(f"saved {args.save}: step {engine.t}")
        if args.digest:
            with open(args.digest, "w") as f:
                json.dump(digests, f, indent=1)
    leave_world()


if __name__ == "__main__":
    main()
