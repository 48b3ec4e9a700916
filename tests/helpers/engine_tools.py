"""Helpers shared by the engine's multi-process tests (test_engine, test_zero_r, test_offload).

Everything here is module level and importable by name, so that the functions the tests hand to
zero.ranks.launch's forked worker pools can use it on every rank. Nothing here is a test.
"""

import contextlib
import dataclasses

from verify.cells.cell import Cell
from verify.checks.harness import run_cells
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.local import get_pool
from zero.workloads.models import MLP, MLPConfig, mlp_microbatches


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptCell(Cell):
    """A verify cell with extra ZeroConfig fields (verify.checks.harness builds the rest)."""

    options: tuple = ()  # ((field, value), ...)

    def zero_config(self, units) -> ZeroConfig:
        return dataclasses.replace(super().zero_config(units), **dict(self.options))


def failures(n, todo):
    """Run the verify cells ``todo`` on the N-rank pool; each cell that failed on any rank, with
    every rank's first difference. An empty list is the pass."""
    per_rank = get_pool(n).run(run_cells, todo, timeout_s=600)
    return [
        (c, [r[i]["first"] for r in per_rank])
        for i, c in enumerate(todo)
        if not all(r[i]["passed"] for r in per_rank)
    ]


@contextlib.contextmanager
def patched(target, **replacements):
    """Set attributes of ``target`` (a module) for the ``with`` block, then put the originals
    back whatever happens: how the tests plant a bug in one rank's engine and make sure the
    long-lived pool worker is healthy again for the next test."""
    originals = {name: getattr(target, name) for name in replacements}
    for name, value in replacements.items():
        setattr(target, name, value)
    try:
        yield originals
    finally:
        for name, value in originals.items():
            setattr(target, name, value)


def mlp_engine(stage, n, k, deterministic=True, precision="fp32", hidden=48, **kw):
    """The tests' small MLP (16 -> hidden x 3 layers -> 4) and its engine: M = N·k micro-batches,
    one unit per layer, 128-element chunks; ``kw`` are further ZeroConfig fields."""
    model = MLP(MLPConfig(d_in=16, d_hidden=hidden, d_out=4, n_layer=3))
    cfg = ZeroConfig(
        stage=stage,
        micro_batches=n * k,
        deterministic=deterministic,
        precision=precision,
        units=tuple(model.unit_names()),
        chunk=128,
        **kw,
    )
    return model, ZeroEngine(model, cfg)


def one_step(eng, model, rank, n, k, step=0):
    """One optimizer step of ``mlp_engine``'s model: this rank's k micro-batches of data step
    ``step`` (rank r takes micro-batches r, N + r, ...; docs/design.md §2)."""
    batches = mlp_microbatches(model.cfg, seed=0, data_step=step, count=n * k, batch_size=4)
    for i in range(k):
        _, loss = eng(*batches[i * n + rank])
        eng.backward(loss)
    return eng.step()


def probe_gpt_engine(stage, n, k, *, seq, hidden, heads, layers, **kw):
    """A probe GPT (vocabulary 64, bf16, one unit per block and the root) and its engine at
    M = N·k, chunks of 128; kw are further ZeroConfig fields."""
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.workloads.models import GPT, GPTConfig

    model = GPT(
        GPTConfig(vocab_size=64, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden)
    )
    cfg = ZeroConfig(
        stage=stage,
        precision="bf16",
        micro_batches=n * k,
        chunk=128,
        units=tuple(model.unit_names()),
        **kw,
    )
    return model, ZeroEngine(model, cfg)


def on_half_the_world(rank, n, fields):
    """The tests' MLP in an engine over half of the world (as model parallelism's DP group
    would be; every rank creates both halves' groups): the message its construction is refused
    with, "" if built. fields: ZeroConfig fields over stage 3, M = 2, 128-element chunks."""
    import torch.distributed as dist

    groups = [dist.new_group(list(range(0, n // 2))), dist.new_group(list(range(n // 2, n)))]
    model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3))
    base = {"stage": 3, "micro_batches": n // 2, "units": tuple(model.unit_names()), "chunk": 128}
    try:
        ZeroEngine(model, ZeroConfig(**{**base, **fields}), group=groups[rank // (n // 2)])
    except ValueError as e:
        return str(e)
    return ""
