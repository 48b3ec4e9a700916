"""The stage ladder: stage 0 plain data parallelism, each later stage a diff of the one before.

Legend: P_os, P_g, P_p the partitioned optimizer states, gradients and parameters (paper §5).
    stage0.Stage0   nothing partitioned; deterministic (tree-ordered) or fast (DDP-like)
    stage1.Stage1   P_os: master and optimizer states sharded
    stage2.Stage2   P_os+g: reduced gradients sharded too
    stage3.Stage3   P_os+g+p: working parameters sharded, gathered unit by unit
    stage3.Persistent  stage 0 for the small units stage 3 keeps whole (persist_below)
Every stage is built from a StageContext (base.py) and never holds the engine; the engine picks
one stage object per unit (ZeroEngine.stage_of), so a persistent unit is simply given to Persistent.
"""

from __future__ import annotations

from .base import Accounting, Reductions, StageContext
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import PartitionState, Persistent, Stage3

STAGE_CLASSES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}

__all__ = [
    "STAGE_CLASSES",
    "Accounting",
    "PartitionState",
    "Persistent",
    "Reductions",
    "Stage0",
    "Stage1",
    "Stage2",
    "Stage3",
    "StageContext",
    "stage_class",
]


def stage_class(stage: int, numel: int, persist_below: int) -> type[Stage0]:
    """The stage class for a unit of numel parameters: at stage 3 a unit of at most
    persist_below parameters is persistent (whole on every rank, docs/design.md §3)."""
    if stage == 3 and numel <= persist_below:
        return Persistent
    return STAGE_CLASSES[stage]
