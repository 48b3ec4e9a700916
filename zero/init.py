"""Counter-based initialisation: every parameter's first value is a pure function of (seed, name).

[Note: counter-based init] docs/design.md §2 asks that initial values be a pure function of
(seed, parameter name, shape), so that a stage-3 rank can materialise one unit alone, in any
order, and get the same bits as a single-process model built with the same seed. Hence:
- every parameter is drawn from its *own* ``torch.Generator``, seeded by a stable hash of
  f"{seed}:{name}" (blake2b: Python's ``hash()`` of a str changes with PYTHONHASHSEED);
- the draw happens on CPU in float32 whatever the parameter's device and dtype, and is then
  copied (cast) in, because CPU and CUDA generators give different streams;
- constructors never touch the global RNG: modules are built on the meta device and then
  materialised with ``to_empty``, so building a model does not shift anyone's random stream.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

INIT_STD = 0.02
"""nanoGPT's (and GPT-2's) standard deviation for Linear and Embedding weights."""

INIT_KINDS = ("normal", "zeros", "ones")


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, stable across processes, platforms and Python versions.

    The parts are joined as f"{p0}:{p1}:..." and hashed with blake2b; ``stable_seed(seed, name)``
    is the init seed of the parameter ``name``.
    """
    text = ":".join(str(p) for p in parts)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: expected {allowed}")


def positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(name, value, "an integer >= 1")


# ---------------------------------------------------------------------------------------------
# Initialisation


@dataclass(frozen=True, kw_only=True)
class ParamInit:
    """How one parameter is initialised: the ``kind`` and ``std`` arguments of ``init_value``."""

    kind: str
    """One of "normal" (N(0, std²)), "zeros" or "ones"."""
    std: float = INIT_STD
    """Standard deviation of a "normal" draw; ignored by the other kinds."""

    def __post_init__(self):
        if self.kind not in INIT_KINDS:
            raise fail("kind", self.kind, f"one of {INIT_KINDS}")
        if not (isinstance(self.std, (int, float)) and math.isfinite(self.std) and self.std > 0):
            raise fail("std", self.std, "a finite float > 0")


def init_value(
    seed: int, name: str, shape: tuple[int, ...] | torch.Size, kind: str, *, std: float = INIT_STD
) -> torch.Tensor:
    """The initial value of parameter ``name``: a float32 CPU tensor, a pure function of the args.

    "normal" draws N(0, 1) from a generator seeded with ``stable_seed(seed, name)`` and then
    multiplies by float32(std), one rounding, so the std enters the bits the same way everywhere.
    See [Note: counter-based init].
    """
    spec = ParamInit(kind=kind, std=std)  # validates kind and std
    shape = tuple(int(s) for s in shape)
    if spec.kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32)
    if spec.kind == "ones":
        return torch.ones(shape, dtype=torch.float32)
    out = torch.empty(shape, dtype=torch.float32)
    out.normal_(0.0, 1.0, generator=generator(stable_seed(seed, name)))
    return out.mul_(torch.tensor(spec.std, dtype=torch.float32))


def default_param_init(model: nn.Module, name: str) -> ParamInit:
    """The generic rule: biases 0; LayerNorm weights 1; other weights N(0, 0.02²)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf == "bias":
        return ParamInit(kind="zeros")
    if isinstance(module, nn.LayerNorm):
        return ParamInit(kind="ones")
    return ParamInit(kind="normal", std=INIT_STD)


def param_init(model: nn.Module, name: str) -> ParamInit:
    """How ``model`` initialises its parameter ``name``: the model's own rule, or the default.

    A model states its rule with a method ``param_init(name) -> ParamInit``. This works on a
    meta-device model, so a rank can learn a unit's rule without materialising anything else.
    """
    rule = getattr(model, "param_init", None)
    return rule(name) if callable(rule) else default_param_init(model, name)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> None:
    """Set every parameter of ``model`` to ``init_value(seed, name, shape, ...)`` of its rule.

    Tied parameters appear once in ``named_parameters()`` and are set once. Each value is drawn
    on CPU in float32 and copied into the parameter, whatever its device and dtype. A parameter
    on the meta device cannot hold values: materialise first (``materialize``).
    """
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device: call materialize(model, device=...) "
                "(or model.to_empty) before init_parameters"
            )
        spec = param_init(model, name)
        p.copy_(init_value(seed, name, p.shape, spec.kind, std=spec.std))


def materialize(model: nn.Module, *, device: torch.device | str, seed: int | None = 0) -> nn.Module:
    """Give a meta-device ``model`` real (uninitialised) storage on ``device``, re-tie, then init.

    ``seed=None`` skips the initialisation, for a simulation whose values are meaningless.
    Returns ``model``.
    """
    model.to_empty(device=device)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # to_empty unties: see [Note: tied head]
    if seed is not None:
        init_parameters(model, seed)
    return model


def build_on(model: nn.Module, device, seed: int) -> None:
    """Shared constructor tail: the submodules were built on meta; materialise unless meta."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "meta":
        materialize(model, device=device, seed=seed)
