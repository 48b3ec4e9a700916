"""The one training loop: data -> micro-batches -> engine. Tests, benchmarks and notebooks call it.

Micro-batch j of step s is produced by `microbatch(s, j)` and runs on rank j mod N at micro-step
j div N (DESIGN.md §2), so the data a rank sees depends on (s, j), never on the rank itself,
and the run is the same at every world size.

Launching (the loop is the same in every case; only the process group differs):
  * one process, or local ranks on this machine (gloo, forked):
        from zero.launch import spawn
        results = spawn(my_worker, 4)        # my_worker(rank, world_size) builds and trains
  * torchrun, one node (NCCL when CUDA is present, else gloo):
        torchrun --standalone --nproc-per-node 8 my_script.py
    where my_script.py calls zero.launch.init_from_env() and then train_steps(...)
  * torchrun, several nodes:
        torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d \\
                 --rdzv-endpoint HOST:29500 --rdzv-id JOB my_script.py
"""

from __future__ import annotations

from collections.abc import Callable

from .engine import StepResult, ZeroEngine


def default_loss(output):
    """Models here return (output, loss); anything else is taken to be the loss itself."""
    return output[1] if isinstance(output, tuple) else output


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

    microbatch(step, j) -> the positional inputs of micro-batch j (0 <= j < M) of a step.
    """
    n, rank = engine.world_size, engine.rank
    per_rank = engine.config.micro_batches // n
    results = []
    for step in range(start_step, start_step + steps):
        for k in range(per_rank):
            engine.backward(loss_of(engine(*microbatch(step, k * n + rank))))
        result = engine.step()
        results.append(result)
        if on_step is not None:
            on_step(step, result)
    return results
