"""Around the wrapped module's forward and backward: input casting, seeded randomness, scaling.

Legend: N world size, k the micro-step within a data step, j = k·N + rank the micro-batch index
(docs/design.md §2: micro-batch j runs on rank j mod N at micro-step j div N).

- Inputs: every floating tensor among the inputs, positional or keyword, nested in lists, tuples
  and dicts, is cast to the compute dtype, as FSDP's mixed precision casts forward inputs;
  integer and bool tensors (token ids, masks) are passed as given. Verification casts its
  single-process micro-batches with the same function, so both sides see the same inputs.
- Randomness: [Note: seeded forward] Each micro-batch's forward runs with torch's RNG (the CPU
  generator and, on a GPU, the engine device's) seeded from (seed, data step, j), inside
  `torch.random.fork_rng`, so dropout draws the same masks at every N, rank and stage, and the
  caller's own random stream is left as it was. Non-reentrant activation checkpointing stores
  and restores this state for its recomputation, so recomputed dropout masks are the same too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from .init import stable_seed


def cast_inputs(args, kwargs, dtype: torch.dtype) -> tuple[tuple, dict]:
    """(args, kwargs) with every floating tensor in them (at any depth of lists, tuples and
    dicts) cast to `dtype`; every other value as given."""

    def cast(x):
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    return tuple(pytree.tree_map(cast, tuple(args))), pytree.tree_map(cast, dict(kwargs))


def backward_scaled(loss: torch.Tensor, scale: float | None) -> None:
    """Backward of S·loss (fp16) or of loss. Verification computes single-process micro-batch
    gradients through this same function, so that they are the engine's bits."""
    (loss if scale is None else loss.float() * scale).backward()


def microbatch_seed(seed: int, data_step: int, j: int) -> int:
    """The RNG seed of micro-batch j's forward in data step `data_step` ([Note: seeded forward])."""
    return stable_seed("forward", seed, data_step, j)


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


def forward_rng(seed: int | None, data_step: int, j: int, device):
    """seeded_rng for micro-batch j of `data_step`; nothing at all when seed is None."""
    if seed is None:
        return contextlib.nullcontext()
    return seeded_rng(microbatch_seed(seed, data_step, j), device)
