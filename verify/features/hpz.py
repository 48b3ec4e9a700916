"""ZeRO++'s hpZ (ZeroConfig.hpz, zero/stages/hpz.py): at stage 3 each rank keeps a secondary
part (1/R of every sharded unit but the root) from the forward's all-gather, and the backward
all-gather gathers the R parts inside the node instead of the N shards over the world. The
parts are copies of this micro-step's gathered values, so every cell with it stays bitwise;
its backward gathers are expected by verify.checks.expect (hpz_gather: (R-1)·N·L/R elements per
call), intra-node only by the verdict's link check, and its memory by expected_memory's "hpz"
category."""

from __future__ import annotations

from .record import Bug, Feature


def plant_hpz_stale(p) -> None:
    """The secondary parts copied at a unit's first forward only: every later backward gathers
    the values from before the first update."""
    from zero.stages import hpz

    real = hpz.HpZ.keep

    def keep(self, u):
        if not hasattr(u, "secondary"):  # a frozen unit keeps no part
            return
        if not getattr(u, "planted_kept", False):
            real(self, u)
            u.planted_kept = True
        u.hpz_fresh = True

    p.setattr(hpz.HpZ, "keep", keep)


def plant_hpz_over_world(p) -> None:
    """The backward all-gather over the world's N shards, as without hpZ: the same bits, the
    world's volume and links."""
    from zero.stages import hpz

    p.setattr(hpz.HpZ, "serves", lambda self, u, phase: False)


def _steps_after_update(c) -> int:
    return c.steps - (min(2, (c.steps + 1) // 2) if c.gradients == "nonfinite" else 0)


FEATURE = Feature(
    name="hpz",
    doc="ZeRO++'s hpZ: stage 3's backward all-gather from a secondary partition inside the node",
    config=lambda value: {"hpz": True},
    needs=lambda c: (
        "" if c.stage == 3 and c.ranks_per_node is not None
        else "hpZ partitions stage 3 inside nodes; needs stage=3 and 'ranks_per_node=<R>'"
    ),
    # 2 × 2 in bf16 and fp32 (two micro-steps each: a part is valid for its micro-step only),
    # 2 × 2 in fast mode, and one node of 2 (the node's group is the world)
    quick=(
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=4, accumulation=2,
             features=("ranks_per_node=2", "hpz"), seed=6600),
        dict(stage=3, precision="fp32", optimizer="adam", world_size=4, accumulation=2,
             features=("ranks_per_node=2", "hpz"), seed=6601),
        dict(stage=3, precision="bf16", optimizer="sgd", world_size=4, accumulation=1,
             mode="fast", features=("ranks_per_node=2", "hpz"), seed=6602),
        dict(stage=3, precision="fp32", optimizer="adamw", world_size=2, accumulation=1,
             features=("ranks_per_node=2", "hpz"), seed=6603),
    ),
    branches={"hpZ's backward all-gather inside the node": lambda c: c.hpz},
    bugs=(
        Bug(name="hpz_stale", breaks="hpZ's secondary parts not refreshed after an update",
            where="hpZ, deterministic, two optimizer steps", plant=plant_hpz_stale,
            check="state", observable=lambda c: (  # with the frozen MLP only the first
                # layer keeps a part, and its backward reads no weight (its input needs no grad)
                c.hpz and c.mode == "deterministic" and _steps_after_update(c) >= 2
                and not c.frozen
            )),
        Bug(name="hpz_over_world", breaks="hpZ's backward all-gather taken over the world",
            where="hpZ on more than one node", plant=plant_hpz_over_world, check="traffic",
            observable=lambda c: c.hpz and c.ranks_per_node < c.world_size),
    ),
)  # fmt: skip
