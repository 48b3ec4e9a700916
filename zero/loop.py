"""The one training loop: `train_steps`, which tests, benchmarks, notebooks and
`python -m zero.workloads.train` all call.

Micro-batch j of step s is produced by `microbatch(s, j)` and runs on rank j mod N at micro-step j
div N (docs/design.md §2), so the data a rank sees depends on (s, j), never on the rank itself, and
the run is the same at every world size."""

from __future__ import annotations

from collections.abc import Callable

from .engine import StepResult, ZeroEngine


def default_loss(output):
    """Models here return (output, loss); an object with a `.loss` (a Hugging Face ModelOutput)
    gives that; anything else is taken to be the loss itself."""
    if isinstance(output, tuple):
        return output[1]
    loss = getattr(output, "loss", None)
    return output if loss is None else loss


def train_steps(
    engine: ZeroEngine,
    microbatch: Callable[[int, int], tuple],
    steps: int,
    *,
    start_step: int = 0,
    loss_of: Callable = default_loss,
    on_step: Callable[[int, StepResult], None] | None = None,
) -> list[StepResult]:
    """Run `steps` optimizer steps; returns each step's StepResult (global loss, norm, skip).

    microbatch(step, j) -> the inputs of micro-batch j (0 <= j < M) of a step: a tuple of
    positional inputs, or a dict of keyword inputs (`{"input_ids": x, "labels": x}`). Each
    forward draws its randomness (dropout) from torch's RNG seeded by (config.dropout_seed,
    data step, j) ([Note: seeded forward] in zero/hooks.py): the same at every N and stage.
    """
    n, rank = engine.world_size, engine.rank
    per_rank = engine.config.micro_batches // n
    results = []
    for step in range(start_step, start_step + steps):
        for k in range(per_rank):
            batch = microbatch(step, k * n + rank)
            out = engine(**batch) if isinstance(batch, dict) else engine(*batch)
            engine.backward(loss_of(out))
        result = engine.step()
        results.append(result)
        if on_step is not None:
            on_step(step, result)
    return results
