"""A verification cell: one point of the matrix, and the models and optimizer groups it names.

A Cell is (stage, N, precision, optimizer, mode, clipping, M/N, unit size, parameter sizes,
overlap, ZeRO-R options, where the gradients come from); every field ends up in the JSON record's
`config`, and `Cell.from_config` rebuilds it from there. MODELS maps a cell's `model` to
(build(device=None), micro-batches); GROUPS its optimizer to two parameter groups (matrices
decayed, biases and norms not). verify/checks/harness.py runs a cell; verify/cells/matrix.py
chooses them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from reference.optim import Hyper
from reference.precision import ScalerConfig
from zero.config import ZeroConfig, decay_matrices_only
from zero.workloads.models import GPT, MLP, GPTConfig, MLPConfig, gpt_microbatches, mlp_microbatches

from .. import features
from ..features.frozen import frozen_mlp
from .branch import BranchMLP, branch_microbatches, skip_microbatches
from .inject import GradientDraw, ParamModel, draw_for


class NormMLP(MLP):
    """The MLP with a BatchNorm1d (affine=False: buffers only, no parameters) after each hidden
    layer, so that the engine's buffer path runs: buffers kept whole on every rank, rank 0's
    broadcast before every forward ([Note: buffers] in zero/build.py). In training mode a
    BatchNorm normalises with the micro-batch's own statistics, so the gradients are those of
    the reference side's copy whatever its running statistics hold. fp32 cells only: the engine
    keeps buffers in the compute dtype, the reference side's copy in fp32."""

    def __init__(self, cfg: MLPConfig, *, device=None):
        super().__init__(cfg, device=device)
        hidden = cfg.n_layer - 1
        self.norms = torch.nn.ModuleList(
            torch.nn.BatchNorm1d(cfg.d_hidden, affine=False, device=device) for _ in range(hidden)
        )

    def forward(self, x, targets=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(self.norms[i](x))
        loss = None if targets is None else torch.nn.functional.mse_loss(x, targets)
        return x, loss


MODELS = {  # build(device=None): on the CPU, or on the meta device (Cell.meta)
    "mlp": (
        lambda device=None: MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3), device=device),
        mlp_microbatches,
    ),
    # numel 481, 37, 1369, 37, 185, 5: none divisible by any N > 1
    "mlp-uneven": (
        lambda device=None: MLP(MLPConfig(d_in=13, d_hidden=37, d_out=5, n_layer=3), device=device),
        mlp_microbatches,
    ),
    "gpt": (
        lambda device=None: GPT(
            GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), device=device
        ),
        gpt_microbatches,
    ),
    # kept for verify/refusals/ranks.py's engines; a Cell says model="mlp", features=("frozen",)
    "mlp-frozen": (frozen_mlp, mlp_microbatches),
    "mlp-bn": (
        lambda device=None: NormMLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)),
        mlp_microbatches,
    ),
    # a side branch that odd data steps skip: unused parameters (verify/cells/branch.py); used by
    # some ranks only on even steps ("mlp-branch", stages 0-2) or by all ("mlp-skip")
    "mlp-branch": (
        lambda device=None: BranchMLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)),
        branch_microbatches,
    ),
    "mlp-skip": (
        lambda device=None: BranchMLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)),
        skip_microbatches,
    ),
    # no forward: injected gradients only (verify/cells/inject.py)
    "params-even": (lambda: ParamModel("even"), None),
    "params-uneven": (lambda: ParamModel("uneven"), None),
}
GROUPS = {  # group 0: matrices (decayed), group 1: biases and norms
    "sgd": (
        Hyper(lr=0.05, momentum=0.9, weight_decay=0.01),
        Hyper(lr=0.1, momentum=0.5, nesterov=True),
    ),
    "adam": (Hyper(lr=1e-2, weight_decay=0.01), Hyper(lr=2e-2)),
    "adamw": (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=2e-2, betas=(0.8, 0.99))),
}
GRADIENTS = ("backward", "random", "extreme", "nonfinite", "drawn")
UNIT_SIZES = {"tiny": 128, "huge": 4096, "auto": 128}  # clipping chunk C; see Cell.units
DELAY_S = 0.004  # upper end of the random sleep before each collective launch (Cell.delays)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One configuration to verify; every field ends up in the JSON record's `config`."""

    stage: int
    world_size: int
    precision: str
    optimizer: str
    mode: str  # "deterministic" or "fast"
    steps: int = 3
    model: str = "mlp"  # a key of MODELS
    accumulation: int = 2  # M/N micro-steps per step
    clip_norm: float | None = 1.0
    overlap: bool = True
    reduce_dtype: str | None = None
    batch_size: int = 4
    seed: int = 0
    persist_below: int = 0  # stage 3: units this small stay whole
    units: str = "tiny"
    """'tiny': every block its own unit and clipping chunks of 128 elements (many small
    buckets, parameters straddling shards); 'huge': one unit holding everything and chunks of
    4096 (one bucket; at large N most ranks hold only padding); 'auto': units="auto" for the
    engine (zero/build.py), chunks of 128, while the reference side takes the blocks the model
    declares (model.unit_names()), so the engine's detection must find exactly those."""
    gradients: str = "backward"
    """'backward' (the model's own), or injected: 'random', 'extreme', 'nonfinite'
    (verify.cells.inject.draw_for) or 'drawn' (the explicit `draw`)."""
    draw: GradientDraw | None = None
    delays: bool = False
    """Sleep 0-4 ms (seeded per rank) before every collective launch, so that asynchronous
    collectives complete in other orders and interleavings."""
    nonfinite: str = "raise"  # fp32/bf16: 'skip' steps with non-finite gradients instead
    features: tuple[str, ...] = ()
    """The options verified beside the base axes, by name (verify/features/: offload, disk,
    checkpointing, offload_activations, contiguous, release_grads, bucket_elements=<C_B>,
    frozen, dropout): each one's ZeroConfig fields, model and checks come from its record.
    Read one as an attribute: cell.offload, cell.bucket_elements (its `absent` value where the
    cell does not ask for it)."""
    meta: bool = False
    """The engine's model is built on the meta device and materialised unit by unit with the
    models' counter-based initial values (ZeroEngine's init_seed); the reference side starts
    from the same model built on the CPU."""
    init: str = "auto"
    """With meta: ZeroEngine's init rule. "own" runs each unit's reset_parameters under its
    unit seed; the reference side recomputes those values itself (own_init)."""
    groups: str = "two"
    """'two': GROUPS[optimizer], matrices decayed and biases and norms not (group_of); 'one':
    its first group for every parameter (no group_of), so that a run of the optimizer spans
    parameters of a unit that differ in use and step count (unused parameters)."""
    loss_scale: float | None = None
    """fp16: the loss scaler's first scale (and its floor, where below 1); None: the default
    2^16. Below 1/M the engine checks R itself for overflow ([Note: overflow detection])."""

    def __post_init__(self):
        object.__setattr__(self, "features", features.parse_features(self.features))
        if self.model in LEGACY_MODELS:
            base, name = LEGACY_MODELS[self.model]
            raise ValueError(f"model={self.model!r}: say model={base!r}, features=({name!r},)")
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: allowed are {sorted(MODELS)}")
        if self.gradients not in GRADIENTS:
            raise ValueError(f"gradients={self.gradients!r}: allowed are {GRADIENTS}")
        if self.units not in UNIT_SIZES:
            raise ValueError(f"units={self.units!r}: allowed are {sorted(UNIT_SIZES)}")
        if self.mode not in ("deterministic", "fast"):
            raise ValueError(f"mode={self.mode!r}: allowed are 'deterministic', 'fast'")
        if self.gradients == "backward" and MODELS[self.model][1] is None:
            raise ValueError(f"model={self.model!r} has no forward: use injected gradients")
        if self.model == "mlp-bn" and (self.precision != "fp32" or self.meta):
            raise ValueError("model='mlp-bn': fp32 and a CPU-built model only (see NormMLP)")
        if self.init not in ("auto", "own") or (self.init == "own" and not self.meta):
            raise ValueError(f"init={self.init!r}: 'auto', or 'own' with meta=True")
        if self.units == "auto" and self.model != "gpt":
            raise ValueError(f"units='auto' with model={self.model!r}: only the GPT's blocks")
        if self.groups not in ("one", "two"):
            raise ValueError(f"groups={self.groups!r}: allowed are 'one', 'two'")
        if (self.gradients == "drawn") != (self.draw is not None):
            raise ValueError("draw: give a GradientDraw exactly when gradients='drawn'")
        features.check(self)

    def __getattr__(self, name: str):
        """A feature's value (verify/features/), e.g. cell.offload; only names the registry
        holds, so a misspelt field still raises AttributeError."""
        if name.startswith("_") or name not in features.FEATURES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return features.value_of(self.__dict__.get("features", ()), name)

    def builder(self):
        """(build(device=None), micro-batches) of the cell's model under its features."""
        build, data = MODELS[self.model]
        return features.builder(self.model, self.features) or build, data

    @property
    def micro_batches(self) -> int:
        return self.world_size * self.accumulation

    @property
    def injected(self) -> bool:
        return self.gradients != "backward"

    @property
    def optimizer_steps(self) -> int:
        """Steps that reach the optimizer: non-finite draws skip steps 0 and 2
        (verify.cells.inject.draw_for)."""
        skipped = min(2, (self.steps + 1) // 2) if self.gradients == "nonfinite" else 0
        return self.steps - skipped

    def gradient_draw(self) -> GradientDraw:
        if self.draw is not None:
            return self.draw
        return draw_for(
            self.gradients,
            self.precision,
            seed=self.seed,
            world_size=self.world_size,
            micro_batches=self.micro_batches,
        )

    def zero_config(self, units) -> ZeroConfig:
        return ZeroConfig(
            stage=self.stage,
            precision=self.precision,
            reduce_dtype=self.reduce_dtype,
            deterministic=self.mode == "deterministic",
            optimizer=self.optimizer,
            groups=GROUPS[self.optimizer][: 1 if self.groups == "one" else 2],
            group_of=decay_matrices_only if self.groups == "two" else None,
            micro_batches=self.micro_batches,
            clip_norm=self.clip_norm,
            units={"tiny": tuple(units), "huge": (), "auto": "auto"}[self.units],
            overlap=self.overlap,
            chunk=UNIT_SIZES[self.units],
            persist_below=self.persist_below,
            nonfinite=self.nonfinite,
            scaler=self.scaler_config(),
            **features.config_of(self.features),
        )

    def scaler_config(self) -> ScalerConfig:
        if self.loss_scale is None:
            return ScalerConfig()
        floor = min(1.0, self.loss_scale / 16)  # room to back off from a small scale
        return ScalerConfig(init_scale=self.loss_scale, min_scale=floor)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["features"] = list(self.features)
        d["micro_batches"] = self.micro_batches
        return d

    @classmethod
    def from_config(cls, config: dict) -> Cell:
        """The cell of a JSON record's `config` (as_dict's output), e.g. to re-run a failure."""
        d = legacy(dict(config))
        d.pop("micro_batches", None)
        d["features"] = tuple(d.get("features") or ())
        if d.get("draw") is not None:
            g = d["draw"]
            d["draw"] = GradientDraw(
                seed=g["seed"],
                exponents=tuple(g["exponents"]),
                zeros=g["zeros"],
                specials=tuple(tuple(x) for x in g["specials"]),
            )
        return cls(**d)


LEGACY_MODELS = {"mlp-frozen": ("mlp", "frozen"), "gpt-dropout": ("gpt", "dropout")}
LEGACY_FIELDS = {
    "offload": "offload", "disk": "disk", "checkpointing": "checkpointing",
    "contiguous": "contiguous", "release_grads": "release_grads",
    "bucket_elements": "bucket_elements",
}  # fmt: skip
"""A record's config from before the feature registry (reports and digest files of older
runs): its option fields, and models that were a feature of a base model."""


def legacy(config: dict) -> dict:
    """`config` with the fields of older records turned into features: a set flag becomes the
    feature, a value "name=value"; checkpointing with offload was P_a+cpu on one rank."""
    if "features" in config:
        return config
    found = []
    for field_name, name in LEGACY_FIELDS.items():
        value = config.pop(field_name, None)
        if value is True:
            found.append(name)
        elif value not in (None, False):
            found.append(f"{name}={value}")
    if "checkpointing" in found and "offload" in found:
        found.append("offload_activations")
    model = config.get("model")
    if model in LEGACY_MODELS:
        config["model"], name = LEGACY_MODELS[model]
        found.append(name)
    config["features"] = features.parse_features(found)
    return config
