"""`python -m zero.workloads.digits`: a small ResNet with BatchNorm (zero/workloads/resnet.py)
trained with ZeRO stages 0-3 on scikit-learn's handwritten digits, reporting the test accuracy.

The data ship inside scikit-learn (`sklearn.datasets.load_digits`, no download): 1797 8×8 images
with grey levels 0-16, 10 classes. The split is fixed by index: the last `test_fraction` of the
images are the test set. Images are scaled to [0, 1] and standardised with the training set's
mean and standard deviation. Micro-batch j of step s draws `batch_size` training images without
replacement from a generator seeded by (seed, s, j), so the data depend on (s, j) alone and the
run is the same at every world size (zero/loop.py's train_steps). BatchNorm's running
statistics follow DDP(broadcast_buffers=True): rank 0's are broadcast before every forward.

At the end every rank evaluates the whole test set in eval mode (running statistics); rank 0
prints the accuracy, writes OUT/digits_log.json (a zero.common.results record: configuration, loss
per step, accuracy, provenance) and OUT/model.pt (the working parameters and buffers as a
state dict of zero.workloads.resnet.ResNet), and main() returns the record.

scikit-learn is an optional dependency: pip install -e '.[models]'.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from reference.optim import Hyper

from ..common import cli
from ..common.results import make_record, write_json
from ..config import STAGES, TORCH_DTYPES, ZeroConfig, decay_matrices_only
from ..engine import ZeroEngine
from ..loop import train_steps
from ..optim.plain import TORCH_OPTIMIZERS
from ..ranks.launch import check_timeout
from ..ranks.local import spawn
from .resnet import ResNet, ResNetConfig
from .train import master_sha256

KIND = "digits.run"
"""The results-record kind of a digits run's log."""


def load_digits_split(test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): float32 images (n, 1, 8, 8), standardised with the
    training images' mean and std, and int64 labels; the last `test_fraction` are the test set."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "python -m zero.workloads.digits needs scikit-learn (the digits data ship inside it): "
            "pip install -e '.[models]'  (or pip install scikit-learn)"
        ) from e
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    n_test = round(len(y) * test_fraction)
    n_train = len(y) - n_test
    mean, std = x[:n_train].mean(), x[:n_train].std()
    x = (x - mean) / std
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


@torch.no_grad()
def accuracy(model, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[int, int]:
    """(correct, total) of argmax(model(x)[0]) against y; model may be a ZeroEngine (then every
    rank must call it: stage 3 gathers). Leaves the model in eval mode."""
    model.eval()
    correct = 0
    for i in range(0, len(y), batch_size):
        logits, _ = model(x[i : i + batch_size])
        correct += int((logits.float().argmax(dim=1) == y[i : i + batch_size]).sum())
    return correct, len(y)


@dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """One run of `python -m zero.workloads.digits`; every field is a CLI option of the same
    name."""

    nproc: int = 2
    """N: local ranks to spawn (forked gloo ranks)."""
    steps: int = 300
    """Optimizer steps."""
    micro_batches: int | None = None
    """M per step over all ranks, a multiple of N (None: N, one micro-batch per rank)."""
    batch_size: int = 32
    """Images per micro-batch (BatchNorm's batch statistics are over one micro-batch)."""
    depth: int = 1
    """Basic blocks per ResNet stage (3 stages, widths 16/32/64)."""
    lr: float = 3e-3
    """Learning rate (constant)."""
    weight_decay: float = 5e-4
    """Weight decay (decoupled for AdamW) on conv and linear weights; none on biases and norms."""
    seed: int = 0
    """Seed of the initial parameters and of the data sampling."""
    test_fraction: float = 0.2
    """The last this share of the 1797 images is the test set."""
    out: str = "runs/digits"
    """Output folder: digits_log.json, model.pt."""
    timeout_s: float = 600.0
    """How long one collective may wait for the other ranks before it raises
    (zero/ranks/watchdog.py); it does not bound the run's length."""
    zero: ZeroConfig = ZeroConfig(stage=3, optimizer="adamw", units="auto")
    """How the engine trains; groups and micro-batches are filled in per run."""

    def __post_init__(self):
        def need(ok: bool, name: str, allowed: str):
            if not ok:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not allowed: expected {allowed}"
                )

        for name in ("nproc", "steps", "batch_size", "depth"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, "an integer >= 1")
        need(isinstance(self.seed, int) and self.seed >= 0, "seed", "an integer >= 0")
        m = self.micro_batches
        need(m is None or (isinstance(m, int) and m >= 1 and m % self.nproc == 0), "micro_batches",
             f"a positive multiple of nproc={self.nproc}")  # fmt: skip
        real = cli.is_real
        need(real(self.lr) and self.lr > 0, "lr", "a finite learning rate > 0")
        need(
            real(self.weight_decay) and self.weight_decay >= 0,
            "weight_decay",
            "a finite value >= 0",
        )
        need(
            real(self.test_fraction) and 0.0 < self.test_fraction < 1.0,
            "test_fraction",
            "a fraction in (0, 1)",
        )
        check_timeout(self.timeout_s)
        need(isinstance(self.out, str) and self.out != "", "out", "a folder path")

    def zero_config(self) -> ZeroConfig:
        return replace(
            self.zero,
            groups=(Hyper(lr=self.lr, weight_decay=self.weight_decay), Hyper(lr=self.lr)),
            group_of=decay_matrices_only,
            micro_batches=self.micro_batches or self.nproc,
        )


def run_rank(rank: int, world_size: int, cfg: DigitsConfig, data):
    """One rank's run; rank 0 returns the log record (the others None)."""
    x_train, y_train, x_test, y_test = data
    model = ResNet(ResNetConfig(depth=cfg.depth), seed=cfg.seed)
    engine = ZeroEngine(model, cfg.zero_config())
    lead = rank == 0
    if lead:
        print(
            f"ResNet (depth {cfg.depth}): Ψ = {model.num_params():,}; stage {cfg.zero.stage}, "
            f"N = {world_size}, M = {engine.config.micro_batches}, {cfg.zero.precision}; units "
            f"{len(engine.config.units)}; digits: {len(y_train)} train, {len(y_test)} test",
            flush=True,
        )

    def microbatch(step: int, j: int):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + j)
        idx = torch.randperm(len(y_train), generator=g)[: cfg.batch_size]
        return x_train[idx], y_train[idx]

    losses: list[float] = []
    start = time.perf_counter()

    def on_step(step, res):
        losses.append(res.loss)
        if lead and ((step + 1) % 50 == 0 or step + 1 == cfg.steps):
            print(f"step {step + 1}: loss {res.loss:.4f}", flush=True)

    train_steps(engine, microbatch, cfg.steps, on_step=on_step)
    seconds = time.perf_counter() - start
    correct, total = accuracy(engine, x_test, y_test)
    digest = master_sha256(engine)
    with engine.gathered_params():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not lead:
        return None
    acc = correct / total
    print(f"test accuracy {acc:.4f} ({correct}/{total}) after {cfg.steps} steps, {seconds:.1f}s")
    config = {
        **asdict(cfg),
        "world_size": world_size,
        "micro_batches": engine.config.micro_batches,
        "units": list(engine.config.units),
        "num_params": model.num_params(),
        "resnet": asdict(model.cfg),
    }
    result = {
        "losses": losses,
        "test_correct": correct,
        "test_total": total,
        "test_accuracy": acc,
        "train_seconds": seconds,
        "final_master_sha256": digest,
    }
    record = make_record(config=config, result=result, kind=KIND)
    out = Path(cfg.out)
    write_json(out / "digits_log.json", record)
    torch.save(state, out / "model.pt")
    return record


def parse(argv=None) -> DigitsConfig:
    p = cli.new_parser("python -m zero.workloads.digits", __doc__.split("\n\n")[0])
    cfg, _ = cli.parse(
        DigitsConfig, argv, parser=p, aliases={"timeout_s": ("--timeout",)},
        exclude=("zero.groups", "zero.group_of", "zero.micro_batches", "zero.scaler",
                 "zero.units"),
        choices={"zero.stage": STAGES, "zero.precision": TORCH_DTYPES,
                 "zero.reduce_dtype": TORCH_DTYPES, "zero.optimizer": TORCH_OPTIMIZERS,
                 "zero.nonfinite": ("raise", "skip")},
    )  # fmt: skip
    return cfg


def main(argv=None) -> dict:
    """Run the CLI; returns rank 0's log record (the model is in OUT/model.pt)."""
    cfg = parse(argv)
    cli.check_writable("out", cfg.out)  # before the run, not after it
    data = load_digits_split(cfg.test_fraction)  # once; the forked ranks share it
    (Path(cfg.out)).mkdir(parents=True, exist_ok=True)
    return spawn(run_rank, cfg.nproc, cfg, data, timeout_s=cfg.timeout_s, deadline_s=None)[0]


if __name__ == "__main__":
    cli.run(main, "python -m zero.workloads.digits", refuse=(ValueError, ImportError))
