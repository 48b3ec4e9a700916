"""The NumPy reference: what one data-parallel training step means, bit for bit.

Read in this order: tree.py (the reduction order), layout.py (flat units, the norm's chunks),
precision.py (casts, loss scaler), optim.py (op-ordered optimizers), step.py (the step), and
simulate.py (ZeRO stages 0-3 on N simulated ranks, which must give step.py's bits; ranks.py
holds the ranks' buffers and the collectives between them). quantize.py is ZeRO++'s block
quantization and its worst-case error, alone and through a sum (for node-aware communication).
docs/design.md §2 is the contract these modules implement.
"""

from .layout import ALIGN, DEFAULT_CHUNK, UnitLayout, model_layout, unit_layout
from .optim import Hyper
from .precision import DTYPES, ScalerConfig, bits, cast
from .step import ModelSpec, StepConfig, StepInfo, TrainState, init_state, train_step, working_copy
from .tree import StreamingTree, global_norm, reduce_microbatches, tree_sum

__all__ = [
    "ALIGN",
    "DEFAULT_CHUNK",
    "DTYPES",
    "Hyper",
    "ModelSpec",
    "ScalerConfig",
    "StepConfig",
    "StepInfo",
    "StreamingTree",
    "TrainState",
    "UnitLayout",
    "bits",
    "cast",
    "global_norm",
    "init_state",
    "model_layout",
    "reduce_microbatches",
    "train_step",
    "tree_sum",
    "unit_layout",
    "working_copy",
]
