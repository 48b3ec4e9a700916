"""The command line of `python -m zero.workloads.train`: TrainConfig (every field an option of
the same name, through zero/common/cli.py), the model sizes it offers, and `parse`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from reference.optim import Hyper

from ..common import cli
from ..config import STAGES, TORCH_DTYPES, ZeroConfig, decay_matrices_only
from ..optim.plain import TORCH_OPTIMIZERS
from ..ranks.launch import check_timeout
from .data import VOCAB_SIZE
from .models import GPTConfig

# ---------------------------------------------------------------------------------------------
# The CLI's configuration

MODELS = {
    # ~0.11M parameters: seconds, for tests
    "tiny": (GPTConfig(vocab_size=VOCAB_SIZE, block_size=64, n_layer=2, n_head=2, n_embd=64), 8),
    # ~0.82M: the default; the loss falls visibly within a minute or two on 2 CPU cores
    "small": (GPTConfig(vocab_size=VOCAB_SIZE, block_size=128, n_layer=4, n_head=4, n_embd=128), 8),
    # ~4.8M: minutes per hundred steps on CPU
    "medium": (
        GPTConfig(vocab_size=VOCAB_SIZE, block_size=256, n_layer=6, n_head=4, n_embd=256),
        8,
    ),
    # ~85M, GPT-2-small-like widths: for GPUs
    "large": (
        GPTConfig(vocab_size=VOCAB_SIZE, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        8,
    ),
}
"""name -> (model, B sequences per micro-batch)."""


ZERO_DEFAULT = ZeroConfig(stage=2, optimizer="adamw", clip_norm=1.0)
"""The engine options of a run unless the command line says otherwise."""
ZERO_DERIVED = (
    "zero.groups",
    "zero.group_of",
    "zero.units",
    "zero.micro_batches",
    "zero.scaler",
    "zero.dropout_seed",
)
"""ZeroConfig fields a run derives (from --lr, --weight-decay, --model, --micro-batches,
--seed); the others are options of the command line under their own names."""
ZERO_CHOICES = {
    "zero.stage": STAGES,
    "zero.precision": TORCH_DTYPES,
    "zero.reduce_dtype": TORCH_DTYPES,
    "zero.optimizer": TORCH_OPTIMIZERS,
    "zero.nonfinite": ("raise", "skip"),
}
"""The known values of ZeroConfig's string and stage fields, as command-line choices."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run of `python -m zero.workloads.train`; every field is a CLI option of the same
    name."""

    nproc: int | None = None
    """N: local ranks to spawn (None: 2), or, under torchrun, the launched world (None: any)."""
    mp: int = 1
    """N_m: tensor-parallel degree (zero/mp/, docs/design.md §6), dividing N and the model's
    heads; ZeRO then runs in each slice's data-parallel group of N_d = N/N_m ranks."""
    model: str = "small"
    """The GPT (MODELS): tiny ~0.11M parameters (tests), small ~0.82M, medium ~4.8M, large ~85M."""
    steps: int = 200
    """Total optimizer steps of the run (a resumed run continues up to this number)."""
    micro_batches: int | None = None
    """M per step, a multiple of N_d = N/mp (None: N_d, one micro-batch per data-parallel
    rank; the N_m ranks of a slice group share each micro-batch)."""
    lr: float = 2e-3
    """Learning rate (constant), every parameter."""
    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW) on matrices; none on biases and norms."""
    seed: int = 0
    """Seed of the initial parameters, the data sampling and the randomness in forward."""
    data: str | None = None
    """A text file or folder; None: the Python standard library's source."""
    val_fraction: float = 0.05
    """Share of documents (by name hash) held out for validation."""
    out: str = "runs/train"
    """Output folder: train_log.json, loss_curve.png, ckpt/."""
    eval_every: int = 50
    """Evaluate the validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation (the same ones every time), spread over ranks."""
    ckpt_every: int = 100
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    log_every: int = 10
    """Gather the per-rank memory and print a plain log line every this many steps."""
    resume: bool = False
    """Continue from OUT/ckpt/latest; without a valid checkpoint there, refused (nothing runs)."""
    resume_if_present: bool = False
    """As resume when OUT/ckpt holds anything, else a fresh start (absent or empty OUT/ckpt)."""
    timeout_s: float = 600.0
    """How long one collective may wait for the other ranks before it raises, naming the rank
    to blame (zero/ranks/watchdog.py). It does not bound the run's length."""
    zero: ZeroConfig = ZERO_DEFAULT
    """How the engine trains; groups, units and micro-batches are filled in per run."""

    def __post_init__(self):
        def need(ok: bool, name: str, allowed: str):
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")

        def integer(name: str, low: int) -> bool:
            v = getattr(self, name)
            return not isinstance(v, bool) and isinstance(v, int) and v >= low

        need(self.nproc is None or integer("nproc", 1), "nproc", "an integer >= 1")
        need(self.model in MODELS, "model", f"one of {tuple(MODELS)}")
        heads = MODELS[self.model][0].n_head
        need(
            integer("mp", 1) and heads % self.mp == 0 and VOCAB_SIZE % self.mp == 0,
            "mp",
            f"an integer >= 1 dividing the model's {heads} heads and {VOCAB_SIZE} tokens",
        )
        need(
            self.nproc is None or self.nproc % self.mp == 0,
            "nproc",
            f"a multiple of mp={self.mp} (N = N_d·N_m)",
        )
        for name, low in (("steps", 1), ("eval_batches", 1), ("seed", 0), ("log_every", 1)):
            need(integer(name, low), name, f"an integer >= {low}")
        for name in ("eval_every", "ckpt_every"):
            need(integer(name, 0), name, "an integer >= 0 (0: only at the end)")
        n = (self.nproc or self.mp) // self.mp
        need(
            self.micro_batches is None
            or (integer("micro_batches", 1) and self.micro_batches % n == 0),
            "micro_batches",
            f"a positive multiple of N_d = nproc/mp = {n}",
        )

        def real(name: str) -> bool:  # finite: lr=inf would surface as a non-finite gradient
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        need(real("lr") and self.lr > 0, "lr", "a finite learning rate > 0")
        need(real("weight_decay") and self.weight_decay >= 0, "weight_decay", "a finite value >= 0")
        need(
            real("val_fraction") and 0.0 < self.val_fraction < 1.0,
            "val_fraction",
            "a fraction in (0, 1)",
        )
        check_timeout(self.timeout_s)
        need(isinstance(self.out, str) and self.out != "", "out", "a folder path")
        need(isinstance(self.resume, bool), "resume", "True or False")
        need(isinstance(self.zero, ZeroConfig), "zero", "a ZeroConfig")
        need(
            not (self.resume and self.resume_if_present),
            "resume_if_present",
            "False together with resume=True (choose one)",
        )

    def zero_config(self, world_size: int) -> ZeroConfig:
        gpt, _ = MODELS[self.model]
        return replace(
            self.zero,
            groups=(Hyper(lr=self.lr, weight_decay=self.weight_decay), Hyper(lr=self.lr)),
            group_of=decay_matrices_only,
            micro_batches=self.micro_batches or world_size // self.mp,
            dropout_seed=self.seed,
            units=tuple(f"transformer.h.{i}" for i in range(gpt.n_layer)),
        )


def parse(argv=None) -> TrainConfig:
    p = cli.new_parser("python -m zero.workloads.train", __doc__.split("\n\n")[0])
    p.add_argument(
        "--fast", dest="zero.deterministic", action="store_false", default=argparse.SUPPRESS,
        help="the same as --no-deterministic",
    )  # fmt: skip
    cfg, _ = cli.parse(
        TrainConfig, argv, parser=p, exclude=ZERO_DERIVED, aliases={"timeout_s": ("--timeout",)},
        choices={"model": MODELS, **ZERO_CHOICES},
    )  # fmt: skip
    return cfg
