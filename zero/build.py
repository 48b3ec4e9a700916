"""Construction helpers of ZeroEngine: which parameters form which unit, and rank agreement.

Legend: a unit is a submodule named in config.units (the root "" holds every other parameter
and all tied ones); a "meta" model has its parameters on the meta device and is materialised
unit by unit (zero/materialize.py's start values). Nothing here communicates except
check_ranks_agree, which exchanges digests as control traffic before any step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import warnings
from dataclasses import fields

import torch
import torch.distributed as dist
from torch import nn

from . import control
from .config import ZeroConfig
from .partition import UnitPartition
from .ranks.nodes import check_rows
from .stages import stage_class
from .unit import FlatUnit
from .zero_r.activations import check_not_nested


def check_config(config: ZeroConfig, n: int) -> None:
    """What the config cannot check alone: the options that depend on the world size n."""
    if config.bucket_elements is not None and config.bucket_elements < n:
        raise ValueError(
            f"bucket_elements={config.bucket_elements}: must be at least the world size {n} "
            "(every rank gets at least one element of each piece)"
        )
    if config.micro_batches % n:
        raise ValueError(
            f"micro_batches={config.micro_batches}: must be a multiple of the world size {n}"
        )
    if config.activation_checkpointing:
        check_not_nested(config.units)


def resolve_units(module: nn.Module, config: ZeroConfig) -> ZeroConfig:
    """config with units="auto" spelled out (zero/build.py), and a warning when stage 3 would
    gather the whole model as one root unit for all of forward and backward. Refuses a module
    without parameters and arguments of the wrong type."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={type(module).__name__}: must be a torch.nn.Module")
    if not isinstance(config, ZeroConfig):
        raise ValueError(f"config={type(config).__name__}: must be a zero.ZeroConfig")
    if next(module.parameters(), None) is None:  # else a bare StopIteration further on
        raise ValueError(
            f"module={type(module).__name__}: has no parameters; the engine trains parameters"
        )
    if config.units == "auto":
        config = dataclasses.replace(config, units=tuple(auto(module)))
    if config.stage == 3 and not config.units:
        _warn_one_root_unit()
    return config


def _warn_one_root_unit() -> None:
    """resolve_units' warning: stage 3 with no unit named gathers the whole model at once."""
    warnings.warn(
        "stage 3 with units=(): the whole model is one root unit, gathered for all of "
        "forward and backward, so stage 3 saves no parameter memory; name the repeated "
        "blocks (units=('blocks.0', 'blocks.1', ...)) or pass units='auto' "
        "(zero.build.auto(model))",
        UserWarning,
        stacklevel=4,  # ZeroEngine.__init__ (here, resolve_units, _validate, __init__)
    )


def check_units(module: nn.Module, units) -> None:
    """A unit is a module that is called in forward, apart from every other unit
    (docs/models.md): containers and nested units are refused by name."""
    mods = dict(module.named_modules())
    for uname in units:
        if uname not in mods:
            raise ValueError(f"units: {uname!r} is not a submodule of the model")
        m = mods[uname]
        if isinstance(m, nn.ModuleList | nn.ModuleDict):
            kids = ", ".join(repr(f"{uname}.{k}") for k, _ in m.named_children())
            raise ValueError(
                f"units: {uname!r} is an nn.{type(m).__name__}, a container that is never called "
                "itself, and a unit must be a module whose forward runs (its hooks gather and "
                f"reduce it); name its children instead: units=({kids}), or pass units='auto' "
                "(zero.build.auto(model))"
            )
    for a in units:
        for b in units:
            if a != b and b.startswith(a + "."):
                raise ValueError(
                    f"units: {a!r} contains {b!r}; nested units are not supported (each "
                    "parameter belongs to one unit): name only one of them"
                )


def check_params(module: nn.Module, config: ZeroConfig) -> None:
    """Every trainable parameter is trained from an fp32 master, every frozen one is held in the
    compute dtype (docs/design.md §2): dtypes other than float32 and the compute dtype are
    refused by name, and so is a model with no trainable parameter (torch.optim refuses an
    empty parameter list too)."""
    allowed = dict.fromkeys((torch.float32, config.compute_dtype))
    for name, p in module.named_parameters():
        if p.dtype not in allowed:
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}: ZeroEngine keeps an fp32 master and "
                f"computes in the configured precision={config.precision!r}, so allowed are "
                f"{' and '.join(str(d) for d in allowed)} (e.g. model.float()); {p.dtype} would "
                "be trained in another dtype"
            )
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            "the model has no parameter with requires_grad=True: there is nothing to train "
            "(unfreeze at least one parameter)"
        )


def split_frozen(named):
    """collect_units' list cut in two, each in the same form and unit order, empty units left
    out: the trainable parameters (requires_grad=True) and the frozen ones (docs/design.md §2,
    "Which parameters train"). A unit may appear in both."""
    keep = [(u, [(n, p) for n, p in ps if p.requires_grad]) for u, ps in named]
    frozen = [(u, [(n, p) for n, p in ps if not p.requires_grad]) for u, ps in named]
    return [x for x in keep if x[1]], [x for x in frozen if x[1]]


def collect_units(module: nn.Module, config: ZeroConfig):
    """[(unit name, [(param name, param)])], root first; shared parameters go to the root."""
    check_units(module, config.units)
    check_params(module, config)
    mods = dict(module.named_modules())
    owner: dict[int, str] = {}
    for uname in config.units:
        for p in mods[uname].parameters():
            owner[id(p)] = "" if owner.get(id(p), uname) != uname else uname
    named = {uname: [] for uname in ("", *config.units)}
    for p_name, p in module.named_parameters():  # each Parameter once, tied ones too
        named[owner.get(id(p), "")].append((p_name, p))
    return [(k, v) for k, v in named.items() if v]


def prepare_buffers(module: nn.Module, device, dtype: torch.dtype):
    """[Note: buffers] Buffers (BatchNorm's running statistics, ...) are not model states:
    they are not sharded, reduced or optimised. Each rank keeps them whole on `device`, floating
    ones in the compute dtype (as the working parameters, so modules that mix the two run in one
    dtype, as under FSDP's mixed precision with buffer_dtype=param_dtype); rank 0's are
    broadcast before each forward (config.broadcast_buffers). A meta buffer is materialised by
    its module's reset_running_stats() (the norms'); any other meta buffer has no value this
    engine could know, so it is refused by name. Returns [(qualified name, buffer)]."""
    out = []
    for prefix, mod in module.named_modules():
        keys = [k for k, b in mod._buffers.items() if b is not None]
        meta = [k for k in keys if mod._buffers[k].is_meta]
        if meta and not callable(getattr(mod, "reset_running_stats", None)):
            name = f"{prefix}.{meta[0]}" if prefix else meta[0]
            raise ValueError(
                f"buffer {name!r} is on the meta device and its module "
                f"{type(mod).__name__} has no reset_running_stats() to give it a value: build "
                "buffers on a real device (parameters may stay on meta)"
            )
        for k in keys:
            b = mod._buffers[k]
            if b.is_meta:
                b = torch.empty_like(b, device=device)
            mod._buffers[k] = b.to(device=device, dtype=dtype if b.is_floating_point() else None)
        if meta:
            mod.reset_running_stats()
        out += [(f"{prefix}.{k}" if prefix else k, mod._buffers[k]) for k in keys]
    return out


def partitions(config: ZeroConfig, named, groups, *, world_size: int, rank: int):
    """Each unit's UnitPartition at this world size, seen from this rank."""
    return [
        UnitPartition.build(
            [(p_name, p.shape) for p_name, p in params],
            world_size=world_size,
            rank=rank,
            groups=[groups[p_name] for p_name, _ in params],
            chunk=config.chunk,
        )
        for _, params in named
    ]


def rebind(module: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    """Put materialised parameters in place of their meta originals in every module that
    holds them (so a tied weight stays one Parameter)."""
    for mod in module.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None and id(p) in replaced:
                mod._parameters[key] = replaced[id(p)]


def group_index(config: ZeroConfig, named) -> dict[str, int]:
    """Parameter name -> its optimizer parameter group (config.group_of, else 0)."""
    fn, k = config.group_of, len(config.groups)
    return {pn: 0 if fn is None else _group_of(fn, k, pn, p) for _, ps in named for pn, p in ps}


def _group_of(fn, k: int, pn: str, p) -> int:
    """fn(pn, p), the user's group_of, checked: one that raises, or returns anything but an int
    index into the k groups, is refused by name: a ValueError naming the parameter and the value
    (the exception it raised chained)."""
    try:
        g = fn(pn, p)
    except Exception as exc:  # the user's function: its error, with where it happened
        why = " ".join(str(exc).split())
        raise ValueError(
            f"group_of({pn!r}) raised {type(exc).__name__}: {why}; allowed is a function "
            f"of (name, parameter) returning 0..{k - 1} (an int index into groups)"
        ) from exc
    try:  # an int, or an integer type that says it is one (numpy's); not a bool
        index = None if isinstance(g, bool) else operator.index(g)
    except TypeError:
        index = None
    if index is None or not 0 <= index < k:
        raise ValueError(
            f"group_of({pn!r})={g!r}: allowed are 0..{k - 1} (an int index into groups)"
        )
    return index


def check_ranks_agree(config: ZeroConfig, named, groups: dict[str, int], *, engine_like) -> None:
    """Different models, unit orders, configs or initial values on different ranks would
    hang or silently diverge: compare digests and name the first rank and unit that differ.
    `named` holds every parameter, trainable and frozen (group -1: not in `groups`).
    engine_like: group, world_size, counter, device (control tensors live there), and nodes and
    node (the world's layout and this rank's node, zero/ranks/nodes.py): the first exchange
    also carries them, so the ranks agree on one node layout."""
    group, world_size = engine_like.group, engine_like.world_size
    counter, device = engine_like.counter, engine_like.device
    cfg = {f.name: repr(getattr(config, f.name)) for f in fields(config) if f.name != "group_of"}
    rows = [("config", json.dumps(cfg, sort_keys=True).encode())]
    for uname, ps in named:
        shape = [(pn, tuple(p.shape), str(p.dtype), groups.get(pn, -1)) for pn, p in ps]
        rows.append((f"unit {uname or '<root>'} structure", repr(shape).encode()))
        if not any(p.is_meta for _, p in ps):  # meta values come from (seed, name) alone
            vals = b"".join(p.detach().float().cpu().numpy().tobytes() for _, p in ps)
            rows.append((f"unit {uname or '<root>'} initial values", vals))
    digests = [
        int.from_bytes(hashlib.blake2b(v, digest_size=7).digest(), "little") for _, v in rows
    ]
    mine = torch.tensor([len(named), *digests], dtype=torch.int64, device=device)
    where = [dist.get_rank(), engine_like.nodes.ranks_per_node, engine_like.node]  # nodes.py
    head = torch.tensor([len(named), *where], dtype=torch.int64, device=device)
    counts = control.gather_control(head, group=group, counter=counter, phase="agree")
    check_rows(counts[:, 1:].tolist())  # one node layout on every rank
    for r, c in enumerate(counts[:, 0].tolist()):
        if c != counts[0, 0]:
            raise ValueError(
                f"rank {r} has {c} units, rank 0 has {int(counts[0, 0])}: the ranks built "
                "different models or unit lists"
            )
    every = control.gather_control(mine, group=group, counter=counter, phase="agree")
    for r in range(world_size):
        for i, (what, _) in enumerate(rows):
            if every[r, 1 + i] != every[0, 1 + i]:
                raise ValueError(f"rank {r} disagrees with rank 0 on {what}")


def broadcast_buffers(buffers, *, group, counter) -> None:
    """Rank 0's buffers to every rank, in place (DDP's broadcast_buffers), counted as control
    traffic; `buffers` is prepare_buffers' list of (name, tensor)."""
    control.broadcast_control([b for _, b in buffers], group=group, counter=counter)


# -- Choosing units: `auto(model)` names the repeated blocks of common model structures. -----------
#     ZeroConfig(units="auto")               # the engine calls auto(model)
#     ZeroConfig(units=tuple(auto(model)))   # the same, spelled out
#
# Legend (docs/design.md §3, docs/models.md): a unit is a submodule whose parameters are flattened,
# reduced and (stage 3) gathered together; it must be a module that is called in forward, so a
# container (nn.ModuleList, nn.ModuleDict) is never a unit, its children are.


def auto(model: nn.Module) -> list[str]:
    """The children of the largest nn.ModuleList or nn.Sequential whose children (at least two)
    are all of one class: transformer blocks, residual stages, MLP layers. Largest by
    parameters, then by children; ties go to the first in module order. [] when there is none
    (everything is then the root unit)."""
    best, best_key = None, (0, 0)
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList | nn.Sequential):
            continue
        kids = list(mod.named_children())
        if len(kids) < 2 or len({type(m) for _, m in kids}) != 1:
            continue
        key = (sum(p.numel() for _, m in kids for p in m.parameters()), len(kids))
        if key[0] and key > best_key:
            best, best_key = [f"{name}.{k}" if name else k for k, _ in kids], key
    return best or []


class CalledCheck:
    """Watches which units' forward runs, and refuses a unit whose parameters got a gradient
    in a backward although its forward never ran: its hooks (stage 3's gather, the activation
    checkpoint) never fired, so its parameters were used through its submodules or directly
    (docs/models.md). A unit is watched until its forward is seen once; a unit a backward
    did not use at all (a branch that step skips) is simply not judged yet."""

    def __init__(self, names: list[str], modules: dict[str, nn.Module]):
        self.names, self.called = [n for n in names if n], set()
        self.hooks = {
            n: modules[n].register_forward_pre_hook(lambda _m, _a, n=n: self.called.add(n))
            for n in self.names
        }

    def stop(self) -> None:
        """Remove the hooks still watching (the engine is gone)."""
        while self.hooks:
            self.hooks.popitem()[1].remove()

    def check(self, used: set[str]) -> None:
        """At the end of a backward; `used`: the units some of whose parameters had a
        gradient in it."""
        for n in [n for n in self.hooks if n in self.called]:
            self.hooks.pop(n).remove()  # seen called: stop watching
        missing = [n for n in self.names if n in self.hooks and n in used]
        if missing:
            raise ValueError(
                f"units: the forward of unit {missing[0]!r} was never called, yet its "
                "parameters got gradients (they were used through its submodules or "
                "directly); a unit must be a module that is called: name the modules that are "
                "called, or pass units='auto'"
            )


# -- Frozen parameters (requires_grad=False): their own flat buffer per unit, never updated. -------
# Legend: N ranks, L a buffer's shard length (its padded buffer has N·L elements), Ψ_f the frozen
# elements of a unit (docs/design.md §2 "Which parameters train", §3 "Frozen parameters").
#
# A unit's frozen parameters are laid out by the same rules as its trainable ones
# (reference/layout.py's unit_layout: 256-byte-aligned offsets, whole chunks, N equal shards) in a
# second flat buffer beside the trainable one, in the compute dtype, cast once from the start
# values (round to nearest even). It has no gradient, no fp32 master, no optimizer state, no
# autograd hook and no place in the clipping norm, so the trainable buffers, their layouts and
# the norm's chunks are exactly those of the model without the frozen parameters. Stages 0-2
# (and stage 3's persistent units) hold it whole on every rank; stage 3 shards it 1/N and
# all-gathers it with its unit for forward and for backward (zero/stages/stage3.py), traffic
# counted as the trainable parameters' gathers are, with no reduce-scatter.


def build_frozen_units(engine, named, values_of, assign) -> list[FlatUnit]:
    """One FlatUnit (u.frozen = True) per unit that has frozen parameters, indexed after the
    trainable units, allocated by its stage: whole, or this rank's shard at stage 3. `named`
    is build.split_frozen's frozen half; `values_of(unit)` its start values
    (zero/materialize.py's PerUnit); `assign(u, kind)` gives u the engine's stage object of
    that class."""
    cfg, n, rank = engine.config, engine.shard_size, engine.shard_rank  # HSDP: a world of G
    out = []
    for j, (uname, params) in enumerate(named):
        part = UnitPartition.build(
            [(pn, p.shape) for pn, p in params],
            world_size=n,
            rank=rank,
            groups=[0] * len(params),  # no optimizer: the group is never read
            chunk=cfg.chunk,
        )
        u = FlatUnit(len(engine.units) + j, uname, params, part, cfg.compute_dtype,
                     engine.device, values_of(uname))  # fmt: skip
        u.frozen = True
        if u.replaced:
            rebind(engine.module, u.replaced)
        kind = stage_class(cfg.stage, part.layout.numel, cfg.persist_below)
        assign(u, kind).allocate_frozen(u)
        u.initial = None  # the working copy is all there is (in fp32 it is this very tensor)
        out.append(u)
    return out
