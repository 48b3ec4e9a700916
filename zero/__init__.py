"""ZeRO, the Zero Redundancy Optimizer (Rajbhandari et al., arXiv 1910.02054), on torch.distributed.

    from zero import ZeroConfig, ZeroEngine, spawn, train_steps

Stages, as in the paper (§5), in zero/stages/: 0 plain data parallelism (the baseline); 1 the
optimizer states partitioned (P_os); 2 gradients too (P_os+g); 3 parameters too (P_os+g+p),
gathered unit by unit. ZeRO-R's options (offload, arenas, C_B, activation checkpointing) are
policies the stages are given (zero/zero_r/); checkpoints are zero/checkpoint/. The semantics
every stage must reproduce are the single-process NumPy package ``reference``'s; ``verify``
checks them. ``zero.common.memory`` (the analytic model) and ``zero.common.results`` are pure
Python.

Legend: Ψ = num_params, N_d = world_size (the data-parallel degree), K = the optimizer-state
multiplier (12 for mixed-precision Adam).

Importing ``zero`` does not import torch: the analytic modules must stay usable (and fast to
import) where torch is absent, so the public names below are loaded on first use.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "ZeroConfig": "zero.config",
    "ZeroEngine": "zero.engine",
    "spawn": "zero.ranks.local",
    "train_steps": "zero.loop",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """The public names, imported (with torch) only when first asked for."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'zero' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
