"""Gradient buffers released after every update and allocated again in the next step
(ZeroConfig.release_grads), except contiguous_memory's arena views and the host shards that
offload_optimizer reduces into at stages 2-3 (zero/zero_r/placement.py)."""

from __future__ import annotations

from .record import Bug, Feature, Pair


def plant_release_arena_views(p) -> None:
    """release_grads lets go of contiguous_memory's arena views too (the arena check dropped)."""
    from zero.zero_r.placement import Placement

    def releasable(self, on_host: bool) -> bool:
        return not (self.offload is not None and on_host)

    p.setattr(Placement, "releasable", releasable)


def plant_release_host_shards(p) -> None:
    """release_grads lets go of offload_optimizer's host gradient shards too (stages 2-3)."""
    from zero.zero_r.placement import Placement

    def releasable(self, on_host: bool) -> bool:
        return self.grad_arena is None

    p.setattr(Placement, "releasable", releasable)


def plant_release_ignored(p) -> None:
    """release_grads asked for and silently not done: every buffer kept between steps. No bit
    and no reported byte changes (memory_report counts a released buffer as held); only the
    engine's released_grads() against verify.checks.expect.expected_released shows it."""
    from zero.zero_r.placement import Placement

    p.setattr(Placement, "releasable", lambda self, on_host: False)


FEATURE = Feature(
    name="release_grads",
    doc="gradient buffers released between steps (ZeroConfig.release_grads=True)",
    config=lambda value: {"release_grads": True},
    absent=None,  # the engine's default: released on CUDA only
    # with contiguous memory (arena views stay) and with offload (host shards stay at stages
    # 2-3; the device buffer goes at stages 0-1)
    quick=(
        dict(stage=0, precision="bf16", optimizer="adam", features=("contiguous",
             "release_grads"), seed=6304),
        dict(stage=2, precision="fp32", optimizer="adamw", features=("contiguous",
             "checkpointing", "release_grads"), seed=6305),
        dict(stage=1, precision="bf16", optimizer="adamw", features=("offload",
             "release_grads"), seed=6306),
        dict(stage=3, precision="fp32", optimizer="sgd", features=("offload", "release_grads"),
             seed=6307),
    ),
    branches={"gradient buffers released between steps": lambda c: bool(c.release_grads)},
    pairs=(
        Pair("release_grads × checkpointing", "buffers allocated again during recomputation",
             "cells", lambda c: bool(c.release_grads) and c.checkpointing),
        Pair("release_grads × contiguous_memory", "arena views kept, never released",
             "cells", lambda c: bool(c.release_grads) and c.contiguous),
        Pair("release_grads × offload_optimizer, stage 0-1", "the device buffer released, the "
             "host copy kept", "cells",
             lambda c: bool(c.release_grads) and c.offload and c.stage <= 1),
        Pair("release_grads × offload_optimizer, stage 2-3", "host shards kept, never released",
             "cells", lambda c: bool(c.release_grads) and c.offload and c.stage >= 2),
    ),
    bugs=(
        # the predicate decides at allocation which buffers the arena holds: with arena views
        # releasable, the arena is left unfilled and the engine's own allocation invariant
        # (zero/engine.py, every arena byte handed out) stops the build, before any step
        Bug(name="release_arena_views", breaks="release_grads releases contiguous arena views",
            where="release_grads × contiguous_memory (interactions)",
            plant=plant_release_arena_views, check="raised",
            why_raise="the engine's allocation invariant refuses it while building: no step runs",
            observable=lambda c: bool(c.release_grads) and c.contiguous),
        # the released buffers are compared after every step
        # (verify.checks.expect.expected_released):
        # a released host shard is seen after the step that released it, before the next step
        # writes into the freed buffer and raises
        Bug(name="release_host_shards", breaks="release_grads releases offload's host shards",
            where="release_grads × offload, stage 2-3 (interactions)",
            plant=plant_release_host_shards, check="memory",
            observable=lambda c: bool(c.release_grads) and c.offload and c.stage >= 2),
        Bug(name="release_ignored", breaks="release_grads=True keeps every gradient buffer",
            where="release_grads, outside arenas and host shards",
            plant=plant_release_ignored, check="memory",
            observable=lambda c: (
                bool(c.release_grads) and not c.contiguous and not (c.offload and c.stage >= 2)
            )),
    ),
)  # fmt: skip
