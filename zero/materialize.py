"""Start values of a model built on the meta device, one unit at a time (ZeroEngine's `init=`).

[Note: meta start values] A meta parameter has a shape and no value. Each unit gets its values
when it is built (zero/unit.py's FlatUnit), alone, so the whole model never exists at once. Rules:
- "own": the model's own initialisation. The unit's parameters are put on the device filled
  with NaN, and every module of the unit that has `reset_parameters()` runs it, children before
  parents (the order of `module.apply`), under torch's RNG seeded with
  unit_seed(seed, unit) (zero/hooks.py's seeded_rng): the bits of that unit built alone on
  the device after `torch.manual_seed(unit_seed(seed, unit))`, whatever N or the rank. A
  parameter still all NaN afterwards (no module of it has reset_parameters) gets the
  counter-based value instead; one left partly NaN is refused by name.
- a callable fn: "own", then fn(module) on the same modules in the same order, under the same
  RNG (as `model.apply(fn)` after construction; e.g. Hugging Face's `model._init_weights`).
- "counter": a pure function of (seed, parameter name), below ([Note: counter-based init]).
- "auto" (the default): "counter" for a model that states its rule with a `param_init(name)`
  method (zero.workloads.models' GPT and MLP), "own" otherwise.
Parameters of other units are hidden behind meta stand-ins while a unit runs, so a module's
reset cannot touch them; a tied parameter keeps what the last module in the order wrote.
engine.init_report says, per unit and parameter, which rule gave the value: "reset_parameters",
"hook" (it changed the value), "counter", "zeros" (seed None) or "given" (not on meta).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

INIT_RULES = ("auto", "own", "counter")
log = logging.getLogger("zero.materialize")


def unit_seed(seed: int, unit: str) -> int:
    """The RNG seed under which unit `unit` ("" the root) runs its modules' initialisation."""
    return stable_seed("unit-init", seed, unit)


def check_init(init) -> None:
    if not (callable(init) or (isinstance(init, str) and init in INIT_RULES)):
        raise ValueError(
            f"init={init!r}: allowed are {INIT_RULES} or a callable fn(module) "
            "(docs/models.md, meta-device models)"
        )


def post_order(module: nn.Module):
    """(qualified name, module) in `module.apply`'s order: children first, each module once."""
    seen: set[int] = set()

    def walk(prefix: str, m: nn.Module):
        if id(m) in seen:
            return
        seen.add(id(m))
        for name, child in m.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)
        yield prefix, m

    return list(walk("", module))


class StartValues:
    """For each unit, the values function FlatUnit takes (None: the parameters' own values)."""

    def __init__(self, module: nn.Module, units, *, seed, init, device):
        check_init(init)
        meta = any(p.is_meta for p in module.parameters())
        if init == "auto":
            init = "counter" if callable(getattr(module, "param_init", None)) else "own"
        self.module, self.seed, self.init, self.device, self.meta = module, seed, init, device, meta
        self.units = tuple(units)
        self.order = post_order(module) if meta else []
        self.report: dict[str, dict[str, str]] = {}

    def _region(self, unit: str, name: str) -> bool:
        """Whether module `name` belongs to unit `unit` (the root: outside every named unit)."""
        if unit:
            return name == unit or name.startswith(unit + ".")
        return not any(name == u or name.startswith(u + ".") for u in self.units)

    def unit(self, unit: str, params: list[tuple[str, nn.Parameter]]):
        """values(name, shape) -> fp32 tensor for FlatUnit, or None; fills self.report[unit]."""
        if not self.meta:
            self.report[unit] = dict.fromkeys((n for n, _ in params), "given")
            return None
        if self.seed is None:
            rule, values = "zeros", {n: torch.zeros(p.shape) for n, p in params if p.is_meta}
            how = {n: rule for n, p in params if p.is_meta}
        elif self.init == "counter":
            values = {n: self._counter(n, p) for n, p in params if p.is_meta}
            how = dict.fromkeys(values, "counter")
        else:
            values, how = self._own(unit, params)
        for n, p in params:
            if not p.is_meta:
                values[n], how[n] = p.detach().float(), "given"
        self.report[unit] = {n: how[n] for n, _ in params}
        rules = ", ".join(f"{r} ({c} parameters)" for r, c in sorted(Counter(how.values()).items()))
        log.info("unit %s: start values by %s", unit or "<root>", rules)
        return lambda name, shape: values.pop(name)  # held by FlatUnit alone from then on

    def per_unit(self, every) -> PerUnit:
        """values_of(unit) over `every` ([(unit, params)], frozen parameters included): one
        pass per unit, however its parameters are split (trainable and frozen FlatUnits)."""
        return PerUnit(self, dict(every))

    def _counter(self, name: str, p) -> torch.Tensor:
        rule = param_init(self.module, name)
        return init_value(self.seed, name, tuple(p.shape), rule.kind, std=rule.std)

    @torch.no_grad()
    def _own(self, unit: str, params):
        mine = {id(p): n for n, p in params if p.is_meta}
        temp = {
            i: nn.Parameter(torch.full(p.shape, torch.nan, dtype=p.dtype, device=self.device))
            for i, p in ((id(p), p) for _, p in params if p.is_meta)
        }
        hook = self.init if callable(self.init) else None
        calls = [
            m
            for name, m in self.order
            if self._region(unit, name) or any(id(p) in mine for p in m._parameters.values())
        ]
        calls = [m for m in calls if hook or callable(getattr(m, "reset_parameters", None))]
        touched = {id(s): s for m in calls for s in m.modules()}.values()
        restore = []
        try:
            for mod in touched:  # this unit's parameters real, every other one hidden
                for key, p in list(mod._parameters.items()):
                    if p is None:
                        continue
                    restore.append((mod, key, p))
                    if id(p) in temp:
                        mod._parameters[key] = temp[id(p)]
                    elif not p.is_meta:
                        mod._parameters[key] = nn.Parameter(p.detach().to("meta"))
            with seeded_rng(unit_seed(self.seed, unit), self.device):
                for m in calls:
                    if callable(getattr(m, "reset_parameters", None)):
                        m.reset_parameters()
                before = {i: t.detach().clone() for i, t in temp.items()} if hook else {}
                for m in calls if hook else ():
                    hook(m)
        finally:
            for mod, key, p in reversed(restore):
                mod._parameters[key] = p
        values, how = {}, {}
        for n, p in params:
            if not p.is_meta:
                continue
            t = temp[id(p)].detach()
            nan = torch.isnan(t)
            if hook and not torch.equal(_bytes(before[id(p)]), _bytes(t)):
                how[n] = "hook"
            elif not bool(nan.any()):
                how[n] = "reset_parameters"
            elif bool(nan.all()):
                values[n], how[n] = self._counter(n, p).to(self.device), "counter"
                continue
            if bool(nan.any()):
                raise ValueError(
                    f"parameter {n!r} of unit {unit or '<root>'}: its module's initialisation "
                    f"(reset_parameters or init=) set only some of its elements; allowed is "
                    "setting all of them or none (then the counter-based rule gives it values)"
                )
            values[n] = t.float()
        return values, how


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bits as bytes (NaN compares unequal to itself; its bits do not)."""
    return t.reshape(-1).view(torch.uint8)


class PerUnit:
    """values_of(unit): StartValues.unit over all of the unit's parameters, run once.

    [Note: one pass per unit] reset_parameters() draws from the unit's seeded RNG for every
    parameter it initialises, but draws nothing for one left on the meta device. A unit whose
    frozen parameters were materialised in a second pass would therefore give its trainable
    ones other values than the same unit built whole; one pass over all of them keeps the bits
    of a real-device construction. The frozen half's values wait (FlatUnit pops its own names)
    until its FlatUnit is built, after the trainable units."""

    def __init__(self, starts: StartValues, params_of: dict):
        self.starts, self.params_of, self.made = starts, params_of, {}
        self.report = starts.report
        # calls each unit will get: two when it has both trainable and frozen parameters
        self.left = {
            u: 1 + (any(p.requires_grad for _, p in ps) and not all(p.requires_grad for _, p in ps))
            for u, ps in params_of.items()
        }

    def __call__(self, unit: str):
        if unit not in self.made:
            self.made[unit] = self.starts.unit(unit, self.params_of[unit])
        self.left[unit] -= 1
        return self.made.pop(unit) if self.left[unit] == 0 else self.made[unit]


# -- Counter-based initialisation: every parameter's first value, a pure function of (seed, name) -
# [Note: counter-based init] docs/design.md §2 asks that initial values be a pure function of
# (seed, parameter name, shape), so that a stage-3 rank can materialise one unit alone, in any
# order, and get the same bits as a single-process model built with the same seed. Hence:
# - every parameter is drawn from its *own* ``torch.Generator``, seeded by a stable hash of
#   f"{seed}:{name}" (blake2b: Python's ``hash()`` of a str changes with PYTHONHASHSEED);
# - the draw happens on CPU in float32 whatever the parameter's device and dtype, and is then
#   copied (cast) in, because CPU and CUDA generators give different streams;
# - constructors never touch the global RNG: modules are built on the meta device and then
#   materialised with ``to_empty``, so building a model does not shift anyone's random stream.


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


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device):
    """torch's CPU generator and `device`'s (when it is a GPU) seeded with `seed` inside, and
    restored on exit: a block whose draws are a function of `seed` alone."""
    device = torch.device(device)
    gpus = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        torch.random.default_generator.manual_seed(seed)
        if gpus:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield
