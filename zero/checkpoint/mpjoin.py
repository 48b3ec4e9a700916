"""A checkpoint's values as the parameters of the engine loading it, at any (N_d', N_m').

Legend (docs/design.md §6): (N_d, N_m) the mesh a checkpoint was saved at, (N_d', N_m') the
loading engine's, (d', m') its rank's coordinates; a plain engine or checkpoint has N_m = 1.

[Note: joining slices] A parameter split by a rule (zero/mp/gpt.py's SPLITS) is cut into N_m
exact copies of its parts. Where the saved and the loading mesh have the same N_m and the same
rule, slice m' is read directly (a plain checkpoint of slice m' at N_d: [Note: resharding by
layout] in zero/checkpoint/reshard.py). Otherwise the N_m saved slices of the parameter are read
whole, glued in m order along the saved rule's dim (a replicated parameter must hold the same
bits in every slice) and cut by the loading model's rule for m'. Every step copies elements, so
master and optimizer states come back bit for bit at any N_m'. Cost: one whole parameter per
state at a time in host memory, and every rank reads every slice's files of a unit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..mp.gpt import cut_part, glue_parts
from .format import CheckpointError, _Reader
from .mpformat import RULES, splits, views, whole_shape


class Place(NamedTuple):
    """Where a model-parallel engine's rank sits: N_m, m and how each parameter is split."""

    n: int
    m: int
    rule: object  # name -> a SPLITS value or None (the module's split_rule)


def place(engine) -> Place | None:
    """The engine's Place, None for a plain engine. Refuses (ValueError) a model-parallel engine
    whose module cannot say how it is split, or whose world is not its mesh."""
    if getattr(engine, "mp", None) is None:
        return None
    ctx, module = engine.mp.ctx, engine.module
    rule = getattr(module, "split_rule", None)
    if not callable(rule):
        raise ValueError(
            f"mp: {type(module).__name__} has no split_rule(name) method saying how each "
            "parameter is split over the MP group (zero.mp.TPGPT has one); a checkpoint of its "
            "slices could not be joined"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != engine.world_size * ctx.size or rank != engine.rank * ctx.size + ctx.rank:
        raise ValueError(
            f"mp: rank {rank} of a world of {world} is (d, m) = ({engine.rank}, {ctx.rank}) of "
            f"an N_d × N_m = {engine.world_size} × {ctx.size} mesh; checkpoints of a "
            "model-parallel engine need the world to be the mesh, rank d·N_m + m (zero.mp.Mesh)"
        )
    for name, _ in module.named_parameters():
        if rule(name) not in RULES:
            raise ValueError(
                f"mp: split_rule({name!r}) = {rule(name)!r}: expected one of {list(RULES)}"
            )
    return Place(n=ctx.size, m=ctx.rank, rule=rule)


def file_prefix(here: Place | None) -> str:
    """The prefix of slice m's file names ([Note: MP checkpoint layout]); none when plain."""
    return "" if here is None else f"m{here.m:04d}-"


def mp_section(here: Place, records: list[dict]) -> dict:
    """The manifest's "mp" section from the N_m slices' records (each a plain manifest's top)."""
    whole = {}
    for p in records[0]["params"]:
        rule = here.rule(p["name"])
        shape = whole_shape(p["shape"], rule, here.n)
        whole[p["name"]] = {"rule": rule, "dim": RULES[rule], "shape": list(shape)}
    return {"size": here.n, "splits": whole, "slices": records}


def whole_shapes(engine, here: Place | None) -> dict[str, tuple[int, ...]]:
    """Each of the engine's parameters' shape in the plain model (its slice's, glued)."""
    return {
        name: tuple(p.shape) if here is None else whole_shape(p.shape, here.rule(name), here.n)
        for name, p in engine.module.named_parameters()
    }


class Source:
    """The saved states of one checkpoint, read as the loading rank's slices ([Note: joining
    slices]). here: the loading engine's Place; None for a plain engine or consolidation."""

    def __init__(self, step_dir, m: dict, here: Place | None):
        self.views = views(m)
        self.readers = [_Reader(step_dir, v) for v in self.views]
        self.params = [{p["name"]: p for p in v["params"]} for v in self.views]
        self.splits = splits(m)
        self.n, self.m, self.rule = (1, 0, None) if here is None else here
        self.same = len(self.views) == self.n  # same N_m: slice m' is read directly

    def _saved_rule(self, name: str):
        return self.splits[name]["rule"] if name in self.splits else None

    def _direct(self, name: str) -> bool:
        return self.same and (self.n == 1 or self.rule(name) == self._saved_rule(name))

    def _range(self, k: int, name: str, key: str, lo: int, hi: int) -> torch.Tensor | None:
        """Elements [lo, hi) of slice k's `name` for state `key` ("frozen": the held values)."""
        view, p = self.views[k], self.params[k][name]
        if key != "frozen" and key not in view["units"][p["unit"]]["states"]:
            return None  # a state the saving optimizer did not keep
        start = p["offset"] + lo
        unit, frozen = p["unit"], key == "frozen"
        return self.readers[k].range(unit, key, start, start + hi - lo, frozen=frozen)

    def whole(self, name: str, key: str) -> torch.Tensor | None:
        """The parameter's state in the plain model's shape, fp32 (None: not kept)."""
        p0 = self.params[0][name]
        if len(self.views) == 1:
            got = self._range(0, name, key, 0, _numel(p0["shape"]))
            return None if got is None else got.view(p0["shape"])
        parts = [self._range(k, name, key, 0, _numel(p0["shape"])) for k in range(len(self.views))]
        if parts[0] is None:
            return None
        rule = self._saved_rule(name)
        if rule is None and not all(torch.equal(x, parts[0]) for x in parts):
            raise CheckpointError(
                f"{self.readers[0].dir}: replicated parameter {name!r} ({key}) differs between "
                "the MP slices"
            )
        return glue_parts([x.view(p0["shape"]) for x in parts], rule)

    def read(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor | None:
        """fp32 elements [lo, hi) of the loading rank's slice of `name` (flattened), state
        `key`; None where the saving optimizer kept no such state."""
        if self._direct(name):
            return self._range(self.m, name, key, lo, hi)
        whole = self.whole(name, key)
        if whole is None:
            return None
        rule = None if self.rule is None else self.rule(name)
        return cut_part(whole, rule, self.m, self.n).reshape(-1)[lo:hi]

    def rng_file(self, rank: int, world_size: int) -> str | None:
        """This rank's saved RNG file when it was saved at the same (N_d, N_m), else None."""
        view = self.views[self.m if self.same else 0]
        if not self.same or view["world_size"] != world_size:
            return None
        return view["rng"]["files"][rank]

    def buffers(self) -> tuple[_Reader, str]:
        """(reader, file) holding the saved buffers: slice m' at the same N_m, else slice 0."""
        k = self.m if self.same else 0
        return self.readers[k], self.views[k]["rng"]["files"][0]

    def drop(self) -> None:
        for r in self.readers:
            r.drop()


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
