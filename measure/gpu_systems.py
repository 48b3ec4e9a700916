"""The systems python -m measure.gpu_bench times, each on one rank: forward_backward(x, y) runs
a step's forward and backward and returns the loss, update() the rest of the step.

    system = build("zero-s3", GPTConfig(...), torch.device("cuda"), meshes={})

Plain: a bf16 working copy, an fp32 master, torch's AdamW (fused on CUDA) on the master. DDP: the
fp32 model under bf16 autocast. FSDP2: fully_shard per block, then the root, bf16 parameters, fp32
reduction, with or without resharding after forward. Ours: ZeroEngine, bf16, a unit per block. Every
system: AdamW lr LR, weight decay WEIGHT_DECAY on matrices (decay_matrices_only), the model built by
zero.workloads.models.GPT with seed SEED. Legend: M micro-batches per step (1 here)."""

from __future__ import annotations

import copy

import torch

from reference.optim import Hyper
from zero.config import ZeroConfig, decay_matrices_only
from zero.workloads.models import GPT, GPTConfig

OURS = ("zero-s0", "zero-s1", "zero-s2", "zero-s3", "zero-s0-det", "zero-s3-det")
SYSTEMS = ("plain", "ddp", "fsdp2", "fsdp2-reshard", *OURS)
LR, WEIGHT_DECAY, SEED = 3e-4, 0.1, 0


def _model(gpt: GPTConfig, device: torch.device) -> GPT:
    return GPT(gpt, device=device, seed=SEED)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """torch.optim's groups for our ZeroConfig's split (decay_matrices_only): decay on matrices."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (decay if decay_matrices_only(name, p) == 0 else plain).append(p)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": plain, "weight_decay": 0}]


def _adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    fused = True if device.type == "cuda" else None  # None: torch's default kernel on a CPU
    return torch.optim.AdamW(param_groups(model), lr=LR, fused=fused)


class Plain:
    """The loop an engine replaces, written out: forward and backward on a bf16 working copy;
    the update copies its gradients into the fp32 master's, steps AdamW on the master and copies
    the master back into the working copy (what engine.step() does too)."""

    def __init__(self, gpt: GPTConfig, device: torch.device):
        self.master = _model(gpt, device)
        self.working = copy.deepcopy(self.master).to(torch.bfloat16)  # ties kept
        self.opt = _adamw(self.master, device)
        self.mp, self.wp = list(self.master.parameters()), list(self.working.parameters())
        for p in self.mp:
            p.grad = torch.zeros_like(p)  # fp32, written by every update

    def forward_backward(self, x, y):
        _, loss = self.working(x, y)
        loss.backward()
        return loss

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_copy_([p.grad for p in self.mp], [p.grad for p in self.wp])
        self.opt.step()
        torch._foreach_copy_(self.wp, self.mp)
        self.working.zero_grad(set_to_none=True)


class TorchPeer:
    """DDP on the fp32 model under bf16 autocast, or FSDP2 (fully_shard per block, then the
    root) with bf16 parameters and fp32 reduction; AdamW on the fp32 parameters either way."""

    def __init__(self, name: str, gpt: GPTConfig, device: torch.device, mesh=None):
        model, self.device = _model(gpt, device), device
        self.autocast = name == "ddp"
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            self.module = DDP(model, device_ids=ids)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            reshard = name == "fsdp2-reshard"
            for module in [*model.transformer.h, model]:
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
            self.module = model
        self.opt = _adamw(model, device)  # after fully_shard: the parameters are its shards

    def forward_backward(self, x, y):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            _, loss = self.module(x, y)
        loss.backward()
        return loss

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def zero_config(stage: int, deterministic: bool, n_layer: int) -> ZeroConfig:
    """Our engine's configuration: bf16, AdamW, M = 1, a unit per transformer block."""
    return ZeroConfig(
        stage=stage,
        precision="bf16",
        deterministic=deterministic,
        optimizer="adamw",
        groups=(Hyper(lr=LR, weight_decay=WEIGHT_DECAY), Hyper(lr=LR)),
        group_of=decay_matrices_only,
        micro_batches=1,
        units=tuple(f"transformer.h.{i}" for i in range(n_layer)),
        overlap=True,
    )


class Ours:
    """ZeroEngine; its update is engine.step(): the control exchange, AdamW on the master, the
    refresh of the working copy."""

    def __init__(self, name: str, gpt: GPTConfig, device: torch.device):
        from zero.engine import ZeroEngine

        config = zero_config(int(name[6]), name.endswith("-det"), gpt.n_layer)
        self.engine = ZeroEngine(_model(gpt, device), config)

    def forward_backward(self, x, y):
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss

    def update(self) -> None:
        self.engine.step()


def build(name: str, gpt: GPTConfig, device: torch.device, meshes: dict):
    if name == "plain":
        return Plain(gpt, device)
    if name in OURS:
        return Ours(name, gpt, device)
    mesh = None
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh

        if "mesh" not in meshes:  # one per run: a new mesh would make a new group per system
            meshes["mesh"] = init_device_mesh(device.type, (1,))
        mesh = meshes["mesh"]
    return TorchPeer(name, gpt, device, mesh)
