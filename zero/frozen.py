"""Frozen parameters (requires_grad=False): their own flat buffer per unit, never updated.

Legend: N ranks, L a buffer's shard length (its padded buffer has N·L elements), Ψ_f the frozen
elements of a unit (docs/design.md §2 "Which parameters train", §3 "Frozen parameters").

A unit's frozen parameters are laid out by the same rules as its trainable ones
(reference/layout.py's unit_layout: 256-byte-aligned offsets, whole chunks, N equal shards) in a
second flat buffer beside the trainable one, in the compute dtype, cast once from the start
values (round to nearest even). It has no gradient, no fp32 master, no optimizer state, no
autograd hook and no place in the clipping norm, so the trainable buffers, their layouts and
the norm's chunks are exactly those of the model without the frozen parameters. Stages 0-2
(and stage 3's persistent units) hold it whole on every rank; stage 3 shards it 1/N and
all-gathers it with its unit for forward and for backward (zero/stages/stage3.py), traffic
counted as the trainable parameters' gathers are, with no reduce-scatter.
"""

from __future__ import annotations

from .partition import UnitPartition
from .stages import stage_class
from .unit import FlatUnit


def build_frozen_units(engine, named, values_of, assign) -> list[FlatUnit]:
    """One FlatUnit (u.frozen = True) per unit that has frozen parameters, indexed after the
    trainable units, allocated by its stage: whole, or this rank's shard at stage 3. `named`
    is build.split_frozen's frozen half; `values_of(unit)` its start values
    (zero/materialize.py's PerUnit); `assign(u, kind)` gives u the engine's stage object of
    that class."""
    cfg, n, rank = engine.config, engine.world_size, engine.rank
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
            from .build import rebind

            rebind(engine.module, u.replaced)
        kind = stage_class(cfg.stage, part.layout.numel, cfg.persist_below)
        assign(u, kind).allocate_frozen(u)
        u.initial = None  # the working copy is all there is (in fp32 it is this very tensor)
        out.append(u)
    return out
