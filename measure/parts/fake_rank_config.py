"""measure.fake_rank's configuration and its checks, made before a process group or a model
exists: SimulateConfig (every field an option of `python -m measure.fake_rank`), the ZeroConfig
of a simulated rank (zero_config: the paper's configuration and further `options`), and the
checks that name a bad option or device in one line (check_options, check_device).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

FIXED_OPTIONS = ("stage", "precision", "reduce_dtype", "optimizer", "micro_batches", "units",
                 "nonfinite", "groups", "group_of", "scaler")  # fmt: skip
"""ZeroConfig fields a simulated rank sets itself (the paper's configuration: bf16, Adam; the
stage its own option; units the model's blocks) or that JSON cannot give: not in `options`."""


def _shown(value) -> str:
    """A value as the command line gave it (JSON), else its repr."""
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    except (TypeError, ValueError):
        return repr(value)


def zero_config(*, stage: int, world_size: int, options: dict | None, units=()):
    """The ZeroConfig of a simulated rank: the paper's configuration and `options`."""
    from zero.config import ZeroConfig

    return ZeroConfig(
        stage=stage,
        precision="bf16",
        reduce_dtype="bf16",
        optimizer="adam",
        micro_batches=world_size,
        units=units,
        nonfinite="skip",
        # the gradient buffers exist from construction on every device, so that the resident
        # set after construction is the paper's model states (release_grads would allocate them
        # in the first step only, on CUDA by default)
        **{"release_grads": False, **(options or {})},
    )


def check_options(options, *, stage: int, world_size: int, mp: int) -> None:
    """`options` is None or a dict of further ZeroConfig fields that make a valid config of
    this rank (checked before anything is built); else a ValueError naming options."""
    if options is None:
        return
    from zero import build
    from zero.config import ZeroConfig

    allowed = [f for f in ZeroConfig.__dataclass_fields__ if f not in FIXED_OPTIONS]
    head = f"options={_shown(options)}"
    if not isinstance(options, dict):
        raise ValueError(
            f"{head}: not a JSON object; allowed is an object of further ZeroConfig fields, "
            f"of {', '.join(allowed)}"
        )
    for key in options:
        if key not in allowed:
            why = (
                f"{key!r} is set by the simulated rank" + (f" (--{key})" if key == "stage" else "")
                if key in FIXED_OPTIONS
                else f"{key!r} is not a ZeroConfig field"
            )
            raise ValueError(f"{head}: {why}; allowed keys are {', '.join(allowed)}")
    try:
        zcfg = zero_config(stage=stage, world_size=world_size, options=options)
        build.check_config(zcfg, world_size)
    except ValueError as exc:
        raise ValueError(f"{head}: {' '.join(str(exc).split())}") from None
    if zcfg.partition_activations and mp == 1:
        raise ValueError(f"{head}: partition_activations=True needs model parallelism (mp > 1)")


DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def check_device(device) -> None:
    """'cpu', or 'cuda[:i]' where this process has CUDA device i; else a ValueError naming
    device (checked before anything is built: torch would fail in its first CUDA call)."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise ValueError(f"device={device!r}: allowed are 'cpu' and 'cuda[:i]'")
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
        raise ValueError(
            f"device={device!r}: this process has no CUDA device (torch {torch.__version__}, "
            f"built {built}); allowed here is 'cpu'"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(
            f"device={device!r}: this process has {count} CUDA device(s); allowed are 'cpu' "
            f"and 'cuda:0' .. 'cuda:{count - 1}'"
        )


@dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    """One simulated rank; every field is an option of `python -m measure.fake_rank` and an
    argument of simulate_rank and measure_rank."""

    params: float = 7.5e9
    """Ψ requested: the GPT is zero.workloads.models.gpt_config_for(params) unless `shape` is
    given."""
    world_size: int = 64
    """N: the fake world's size."""
    rank: int = 0
    """Which rank of the N this process is."""
    stage: int = 3
    """ZeRO stage 0-3."""
    steps: int = 1
    """Real optimizer steps after construction."""
    seq: int = 64
    """Tokens per sequence."""
    batch: int = 1
    """Sequences per micro-batch."""
    vocab_size: int = 50257
    """Vocabulary of the GPT."""
    device: str = "cpu"
    """'cpu', or 'cuda[:i]' (allocator bytes instead of RSS)."""
    shape: dict | None = None
    """JSON {"n_layer", "n_embd", "n_head"} replacing gpt_config_for(params)."""
    options: dict | None = None
    """JSON of further ZeroConfig fields (e.g. {"activation_checkpointing": true})."""
    mp: int = 1
    """N_m: model-parallel degree. Above 1 the fake world has world_size·mp ranks, `rank` is a
    global rank of that mesh (zero.mp.Mesh: rank = d·N_m + m) and the rank builds its TPGPT
    slice; ZeRO runs in its DP group of N_d = world_size ranks ([Note: simulated MP rank])."""

    def __post_init__(self):
        for name in ("world_size", "steps", "seq", "batch", "vocab_size", "rank", "stage", "mp"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: allowed are integers")
        for name in ("world_size", "steps", "seq", "batch", "vocab_size", "mp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: allowed are integers >= 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size * self.mp):
            raise ValueError(f"rank={self.rank!r}: allowed are 0 .. world_size·mp - 1")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r}: allowed are 0, 1, 2, 3")
        if self.shape is None and not 0 < self.params < float("inf"):  # a shape makes it unused
            raise ValueError(
                f"params={self.params!r}: allowed are finite counts > 0 (or give shape)"
            )
        if self.shape is not None and (
            set(self.shape) != {"n_layer", "n_embd", "n_head"}
            or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1
                for v in self.shape.values()
            )
        ):
            raise ValueError(
                f"shape={self.shape!r}: allowed is {{'n_layer', 'n_embd', 'n_head'}}, integers >= 1"
            )
        check_device(self.device)
        check_options(self.options, stage=self.stage, world_size=self.world_size, mp=self.mp)
