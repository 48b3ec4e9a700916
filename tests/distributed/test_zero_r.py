"""ZeRO-R on the engine: activation checkpointing per unit (with checkpoints offloaded to the
host) and constant-size communication buffers. Each option changes memory, never the bits.

Multi-process tests use zero.ranks.launch's shared worker pools; the functions they run are module
level so that forked workers can unpickle them by reference.
"""

import pytest
import torch
from engine_tools import OptCell, failures, mlp_engine, one_step, patched, probe_gpt_engine

from verify.cells.matrix import PRECISIONS, cells
from verify.checks.harness import run_cells
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.launch import RankError
from zero.ranks.local import get_pool
from zero.stages.stage3 import PartitionState
from zero.workloads.models import MLP, MLPConfig, gpt_microbatches
from zero.zero_r.activations import saved_activation_bytes

pytestmark = pytest.mark.timeout(600)

CKPT = (("activation_checkpointing", True),)
CKPT_CPU = CKPT + (("offload_activations", True),)


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"activation_checkpointing": 1}, "activation_checkpointing=1"),
        ({"offload_activations": True}, "offload_activations=True"),
        ({"offload_optimizer": "yes"}, "offload_optimizer='yes'"),
        ({"bucket_elements": 0}, "bucket_elements=0"),
        ({"bucket_elements": 2.5}, "bucket_elements=2.5"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)


def build_nested(rank, n):
    model = MLP(MLPConfig(d_in=4, d_hidden=8, d_out=2, n_layer=2))
    ZeroEngine(model, ZeroConfig(units=("layers", "layers.0"), activation_checkpointing=True))


@pytest.mark.dist
def test_nested_checkpointed_units_are_refused():
    with pytest.raises(RankError, match="'layers' contains 'layers.0'"):
        get_pool(1).run(build_nested)


# -- bits --------------------------------------------------------------------------------------


def ckpt_cells(n, stages, options, precisions=PRECISIONS):
    models = ({"model": "gpt", "optimizer": "adamw"}, {"model": "mlp", "optimizer": "adam"})
    return cells(
        cls=OptCell, stage=stages, world_size=n, precision=precisions, models=models,
        mode="deterministic", options=[options],
    )  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize(
    "n, stages, options",
    [
        (1, (0, 1, 2, 3), CKPT_CPU),
        (2, (0, 1, 2, 3), CKPT),
        (2, (2, 3), CKPT_CPU),
        (4, (3,), CKPT),
    ],
)
def test_checkpointed_cells_are_bitwise_equal_to_the_reference(n, stages, options):
    """Recomputation replays the unit's forward on the same working copy with the same kernels,
    so the gradients, hence every state, are the reference's bits (GPT: blocks checkpointed,
    the tied root not; MLP: every hidden Linear). Every rank, every step, every extent."""
    assert failures(n, ckpt_cells(n, stages, options)) == []


@pytest.mark.dist
def test_checkpointed_fast_cells_stay_within_their_bounds():
    todo = cells(
        cls=OptCell, stage=(2, 3), world_size=2, precision="bf16", optimizer="adamw", mode="fast",
        options=[CKPT, CKPT_CPU],
    )  # fmt: skip
    assert failures(2, todo) == []


def cells_with_a_recomputation_that_differs(rank, n, todo):
    """A broken checkpoint: the recomputation sees its input scaled by 1.01 (metadata
    unchanged, so torch's own recomputation check does not notice)."""
    from zero.zero_r import activations

    real = activations.checkpoint

    def broken(fn, *args, **kw):
        calls = [0]

        def once_more(x, *a, **k):
            calls[0] += 1
            return fn(x * 1.01 if calls[0] > 1 else x, *a, **k)

        return real(once_more, *args, **kw)

    with patched(activations, checkpoint=broken):
        return run_cells(rank, n, todo)


@pytest.mark.dist
def test_cells_catch_a_recomputation_that_differs():
    """The bitwise cells above have teeth: gradients really come from the recomputed graph."""
    todo = ckpt_cells(2, (0, 3), CKPT, precisions=("bf16",))
    per_rank = get_pool(2).run(cells_with_a_recomputation_that_differs, todo)
    assert not any(r[i]["passed"] for r in per_rank for i in range(len(todo)))


# -- stage 3: recomputation finds its unit gathered ---------------------------------------------


B, S, H, HEADS = 2, 32, 64, 2  # batch, sequence, hidden, heads of the probe GPT


def gpt_engine(stage, n, k, layers=4, **kw):
    """The probe GPT (bf16, one unit per block and the root) and its engine, M = N·k."""
    return probe_gpt_engine(stage, n, k, seq=S, hidden=H, heads=HEADS, layers=layers, **kw)


def recompute_probe(rank, n, k, checkpointing, overlap):
    """One step at stage 3. Every run of each block's feed-forward (forward, recomputation) is
    recorded with its unit's partition state; all-gathers counted per unit."""
    model, eng = gpt_engine(3, n, k, activation_checkpointing=checkpointing, overlap=overlap)
    seen: dict[str, list[str]] = {}
    by_name = {u.name: u for u in eng.units}
    for i, block in enumerate(model.transformer.h):
        name = f"transformer.h.{i}"

        def probe(_m, _a, name=name):
            seen.setdefault(name, []).append(by_name[name].state.value)

        block.mlp.c_fc.register_forward_pre_hook(probe)
    batches = gpt_microbatches(model.cfg, seed=0, data_step=0, count=n * k, batch_size=2)
    for i in range(k):
        _, loss = eng(*batches[i * n + rank])
        eng.backward(loss)
    eng.step()
    gathers: dict[str, int] = {}
    for r in eng.counter.of_step(0):
        if r.op == "all_gather" and r.phase.startswith("param"):
            name = eng.units[r.unit].name
            gathers[name] = gathers.get(name, 0) + 1
    bits = [u.master.clone().view(torch.int32) for u in eng.units]
    return seen, gathers, eng.impl.peak_live, bits


@pytest.mark.dist
@pytest.mark.parametrize("overlap", [True, False])
def test_stage3_recomputation_needs_no_extra_gather(overlap):
    """[Note: recomputation at stage 3]: with checkpointing each block's insides run twice per
    micro-step (forward, then recomputation in backward), both times on a gathered unit, and
    the all-gathers stay 2 per block per micro-step (forward, backward; the root 1), the same
    as without checkpointing; the live-unit bound (2 with prefetch) holds; same bits."""
    n, k = 2, 2
    on = get_pool(n).run(recompute_probe, k, True, overlap)
    off = get_pool(n).run(recompute_probe, k, False, overlap)
    gathered = PartitionState.GATHERED.value
    for (seen, gathers, live, bits), (seen0, gathers0, _, bits0) in zip(on, off, strict=True):
        assert seen == {name: [gathered] * 2 * k for name in seen0} and len(seen) == 4
        assert seen0 == {name: [gathered] * k for name in seen}
        assert gathers == gathers0
        assert gathers == {"": k} | {name: 2 * k for name in seen}
        assert live <= (2 if overlap else 1)
        assert all(torch.equal(a, b) for a, b in zip(bits, bits0, strict=True))


# -- activation memory -------------------------------------------------------------------------


def saved_bytes(rank, n, stage, layers, options):
    """Bytes autograd keeps for backward in one bf16 forward (parameters excluded), and the
    elements the activation offload moved down / up (kind 'offload')."""
    torch.set_num_threads(1)
    model, eng = gpt_engine(stage, n, 1, layers, **dict(options))
    x, y = gpt_microbatches(model.cfg, seed=0, data_step=rank, count=1, batch_size=B)[0]
    with saved_activation_bytes(eng) as saved:
        _, loss = eng(x, y)
    eng.backward(loss)  # the saved tensors were real: backward runs through them
    eng.step()
    moved = {}
    for r in eng.counter.of_step(0, kind="offload"):
        moved[r.phase] = moved.get(r.phase, 0) + r.elements
    return saved.nbytes, moved


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])
def test_checkpointing_reduces_activations_as_the_paper_says(stage):
    """Paper §3.2 / docs/paper.md §1.5: a transformer block keeps ≈ 12·b·s·h elements for backward
    (the footnote); with one checkpoint per block it keeps its input, b·s·h. The blocks' part is
    isolated as saved(2l) - saved(l) (embeddings, final norm, head and loss cancel).

    - Checkpointed: exactly l·b·s·h elements (2 bytes each, bf16): the blocks' inputs.
    - Not checkpointed, per block, in units of b·s·h elements: at least 7, the inputs of the four
      Linear layers' weight gradients (ln_1 out 1, attention out 1, ln_2 out 1, GELU out 4),
      which backward cannot do without; at most 22 + (2·a·s + 8 + 2a)/h, every full-size tensor
      the block creates (x, ln_1, q|k|v 3, attention 1, its contiguous copy 1, projection 1,
      dropout 1, residual 1, ln_2 1, c_fc 4, GELU 4, c_proj 1, dropout 1, residual 1 = 22) plus
      two attention-score tensors b·a·s², the LayerNorms' fp32 mean and rstd (4·b·s·4 bytes) and
      an fp32 log-sum-exp (b·a·s·4 bytes). The paper's 12 lies in that bracket, and so must
      the measurement: the reduction factor is that constant (16.125 measured here, torch 2.13
      CPU: 16 full-size tensors + the LayerNorm statistics).
    - offload_activations: the checkpoints are host bytes (none left for the device counter),
      every checkpoint goes down once in forward and comes up once in backward."""
    n, l = 2, 2
    unit = B * S * H  # elements of one block input
    got = {}
    for name, options in (("plain", ()), ("ckpt", CKPT), ("cpu", CKPT_CPU)):
        for layers in (l, 2 * l):
            got[name, layers] = get_pool(n).run(saved_bytes, stage, layers, options)
    for r in range(n):
        plain = got["plain", 2 * l][r][0] - got["plain", l][r][0]
        ckpt = got["ckpt", 2 * l][r][0] - got["ckpt", l][r][0]
        assert ckpt == l * unit * 2, ckpt
        per_block = plain / (l * unit * 2)
        assert 7 <= per_block <= 22 + (2 * HEADS * S + 8 + 2 * HEADS) / H, per_block
        assert got["cpu", 2 * l][r][0] == got["ckpt", 2 * l][r][0] - 2 * l * unit * 2
        for layers in (l, 2 * l):
            moved = got["cpu", layers][r][1]
            assert moved == {"activation_down": layers * unit, "activation_up": layers * unit}
            assert got["ckpt", layers][r][1] == {}


# -- constant-size buffers (C_B) -----------------------------------------------------------------


def bucket_cells(n, grid):
    at = [dict(zip(("stage", "precision", "model", "mode"), row)) for row in grid]
    return cells(
        cls=OptCell, at=at, world_size=n, optimizer="adam", options=[(("bucket_elements", 64),)]
    )


FULL_GRID = [
    (s, p, m, mode)
    for s in (0, 1, 2, 3)
    for p in ("fp32", "bf16")
    for m, mode in (("mlp", "deterministic"), ("gpt", "deterministic"), ("mlp", "fast"))
]


@pytest.mark.dist
def test_bucketed_cells_are_bitwise_equal_to_the_reference():
    """Pieces of at most C_B = 64 elements (32 columns of every shard; shards are multiples of
    128, so every unit takes several pieces): the tree sums each element on its own, so the
    bits are the reference's. Fast mode stays within its bounds. (Each piece is a gloo call:
    the fast tier runs a few cells, the release tier the grid.)"""
    grid = [(s, "bf16", "mlp", "deterministic") for s in (0, 1, 2, 3)]
    grid += [(3, "fp32", "gpt", "deterministic"), (2, "bf16", "mlp", "fast")]
    assert failures(2, bucket_cells(2, grid)) == []


@pytest.mark.full
@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_bucketed_release_grid(n):
    assert failures(n, bucket_cells(n, FULL_GRID)) == []


def bucket_traffic(rank, n, stage, deterministic, k, hidden, cap):
    model, eng = mlp_engine(stage, n, k, deterministic, "bf16", hidden, bucket_elements=cap)
    one_step(eng, model, rank, n, k)
    calls = {}
    for r in eng.counter.of_step(0):
        if r.op == "reduce_scatter":
            calls[r.unit] = calls.get(r.unit, 0) + 1
    shards = [u.part.shard_numel for u in eng.units]
    return eng.counter.volume(0), calls, shards, eng.memory_report()["comm_buffers"]


@pytest.mark.dist
@pytest.mark.parametrize("stage, deterministic", [(1, True), (2, True), (2, False), (3, True)])
def test_pieces_keep_the_volume_and_cut_the_calls(stage, deterministic):
    """Volume and padding exactly as without pieces; each unit's reduce-scatter becomes
    ceil(L / (C_B / N)) calls per reduction (per micro-step; fast stage 1 reduces once)."""
    n, k, cap = 2, 2, 96
    with_cap = get_pool(n).run(bucket_traffic, stage, deterministic, k, 48, cap)
    plain = get_pool(n).run(bucket_traffic, stage, deterministic, k, 48, None)
    reductions = 1 if (stage == 1 and not deterministic) else k
    for (vol, calls, shards, _), (vol0, calls0, _, _) in zip(with_cap, plain, strict=True):
        assert vol == vol0
        assert calls0 == {u: reductions for u in range(len(shards))}
        width = cap // n
        assert calls == {u: reductions * -(-L // width) for u, L in enumerate(shards)}


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_comm_buffers_stay_flat_as_the_model_grows(stage):
    """ZeRO-R's C_B: the reduction buffers a rank holds at once are capped (2 units in flight x
    Pieces.depth pieces x (fused + receive buffer) x C_B elements x 4 bytes: fp32 reduction),
    whatever the model's size; without the cap they grow with the largest unit: at least its
    own (arrival + receive buffer) x N·L x 4 bytes, at most twice that (2 units in flight; how
    many are in flight with the largest depends on the launch order, [Note: one launch
    order] in zero/engine.py)."""
    n, cap = 2, 256
    capped, plain = [], []
    for hidden in (48, 160, 480):
        capped.append(get_pool(n).run(bucket_traffic, stage, True, 1, hidden, cap)[0])
        plain.append(get_pool(n).run(bucket_traffic, stage, True, 1, hidden, None)[0])
    bound = 2 * 2 * 2 * cap * 4
    assert [c[3] for c in capped] == [bound] * 3
    largest = [max(p[2]) for p in plain]
    for p, L in zip(plain, largest, strict=True):
        assert 2 * n * L * 4 <= p[3] <= 2 * 2 * n * L * 4, (p[3], L)
    assert plain[-1][3] > 8 * bound  # grown far past the cap
    assert largest[-1] * n > 8 * cap  # the models really outgrow the cap
