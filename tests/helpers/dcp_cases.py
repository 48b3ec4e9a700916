"""The engines of tests/distributed/test_dcp.py: a case (N and stage at save and at load, model,
precision, optimizer), its model, config and data, and the state a resume must keep, as bits.
Self-contained (no verify/ import), with the verify matrix's numerics: two parameter groups
(matrices decayed, then biases and norms), clipping at 1.0, chunks of 128, M = 4.
"""

import dataclasses

import torch

from reference.optim import Hyper
from verify.checkpoints.resume import compare_states  # noqa: F401  (the tests import it here)
from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine
from zero.workloads.models import (
    GPT,
    MLP,
    GPTConfig,
    MLPConfig,
    gpt_microbatches,
    init_parameters,
    mlp_microbatches,
)

HYPERS = {  # group 0: matrices (decayed), group 1: biases and norms
    "sgd": (
        Hyper(lr=0.05, momentum=0.9, weight_decay=0.01),
        Hyper(lr=0.1, momentum=0.5, nesterov=True),
    ),
    "adam": (Hyper(lr=1e-2, weight_decay=0.01), Hyper(lr=2e-2)),
    "adamw": (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=2e-2, betas=(0.8, 0.99))),
}


class NormMLP(MLP):
    """The MLP with a BatchNorm1d (affine=False: buffers only) after each hidden layer: a model
    with persistent buffers, floating (running statistics) and integer (batches tracked)."""

    def __init__(self, cfg: MLPConfig):
        super().__init__(cfg)
        self.norms = torch.nn.ModuleList(
            torch.nn.BatchNorm1d(cfg.d_hidden, affine=False) for _ in range(cfg.n_layer - 1)
        )

    def forward(self, x, targets=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(self.norms[i](x))
        loss = None if targets is None else torch.nn.functional.mse_loss(x, targets)
        return x, loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """Train steps_before at (n1, s1), save; load at (n2, s2), train steps_after."""

    n1: int
    s1: int
    n2: int
    s2: int
    model: str = "mlp"  # "mlp", "mlp-uneven" (no numel divisible by N > 1), "mlp-bn", "gpt"
    precision: str = "bf16"
    optimizer: str = "adamw"
    frozen: bool = False  # the MLP's middle layer requires_grad=False
    steps_before: int = 2
    steps_after: int = 2

    @property
    def label(self) -> str:
        extra = " frozen" if self.frozen else ""
        return (
            f"N={self.n1} stage {self.s1} -> N={self.n2} stage {self.s2} {self.precision} "
            f"{self.optimizer} {self.model}{extra}"
        )

    def make_model(self):
        if self.model == "gpt":
            return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
        d = (13, 37, 5) if self.model == "mlp-uneven" else (16, 48, 4)
        cfg = MLPConfig(d_in=d[0], d_hidden=d[1], d_out=d[2], n_layer=3)
        model = NormMLP(cfg) if self.model == "mlp-bn" else MLP(cfg)
        if self.frozen:
            model.layers[1].requires_grad_(False)
        return model

    def engine_config(self, stage: int, units) -> ZeroConfig:
        return ZeroConfig(
            stage=stage,
            precision=self.precision,
            deterministic=True,
            optimizer=self.optimizer,
            groups=HYPERS[self.optimizer],
            group_of=decay_matrices_only,
            micro_batches=4,
            clip_norm=1.0,
            units=tuple(units),
            chunk=128,
        )

    def microbatches(self, model):
        """microbatch(step, j): a function of (seed 0, step, j) only, as train_steps wants."""
        data = gpt_microbatches if self.model == "gpt" else mlp_microbatches

        def microbatch(step: int, j: int):
            return data(model.cfg, seed=0, data_step=step, count=j + 1, batch_size=4)[j]

        return microbatch


def build(case: Case, stage: int, *, seed: int = 0):
    """(model, engine) of a case at a stage; seed only sets the initial values."""
    model = case.make_model()
    if seed:
        init_parameters(model, seed)
    return model, ZeroEngine(model, case.engine_config(stage, model.unit_names()))


def state_of(engine) -> dict:
    """What a resume must keep, as NumPy arrays (gathered: call on every rank): masters,
    optimizer states, t, the data step, the scaler, and rank 0's persistent buffers."""
    master, opt = engine.gather_state()
    out = {f"master/{k}": v.cpu().numpy() for k, v in master.items()}
    out.update({f"{x}/{k}": v.cpu().numpy() for k, d in opt.items() for x, v in d.items()})
    sd = engine.module.state_dict(keep_vars=True)
    for k, b in engine.module.named_buffers():
        if k in sd:
            out[f"buffer/{k}"] = b.detach().cpu().float().numpy()
    out["t"], out["data_step"] = engine.t, engine.data_step
    out["scaler"] = None if engine.scaler is None else dataclasses.asdict(engine.scaler)
    return out
