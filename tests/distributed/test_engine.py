"""The engine (stages 0-2) on real gloo ranks: bits, volumes, memory, overlap, bad input.

Multi-process tests share the long-lived worker pools of zero.ranks.launch (one per world size); the
functions they run are module-level so that forked workers can unpickle them by reference.
"""

import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from engine_tools import failures, mlp_engine, one_step, patched
from hypothesis import given
from hypothesis import strategies as st

from reference.precision import DTYPES
from verify.cells import matrix
from verify.cells.cell import Cell
from verify.cells.matrix import OPTIMIZERS, PRECISIONS, STAGES
from verify.checks.harness import run_cells
from zero import collectives
from zero.common.memory import model_state_breakdown
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.partition import UnitPartition
from zero.ranks.launch import RankError
from zero.ranks.local import get_pool
from zero.workloads.models import MLP, MLPConfig, mlp_microbatches

pytestmark = pytest.mark.timeout(600)


def cells(n, mode="deterministic", **kw):
    return matrix.cells(
        stage=STAGES, world_size=n, precision=PRECISIONS, optimizer=OPTIMIZERS, mode=mode, **kw
    )


@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2, 4])
def test_deterministic_cells_are_bitwise_equal_to_the_reference(n):
    """Stages 0-3 x fp32/bf16/fp16 x SGD/Adam/AdamW, M = 2N, on the MLP; on the GPT (tied
    embedding and head in the root unit) for AdamW. Every rank, every step, every extent."""
    todo = cells(n, model="mlp") + [c for c in cells(n, model="gpt") if c.optimizer == "adamw"]
    assert failures(n, todo) == []


@pytest.mark.dist
def test_world_size_three_uses_its_own_tree():
    todo = [c for c in cells(3, model="mlp") if c.optimizer == "adam"]
    assert failures(3, todo) == []


# -- communication -----------------------------------------------------------------------------

# docs/design.md §2: per rank per step, in units of (N-1)/N·Ψ_padded; k = M/N
VOLUME = {
    (True, 0): lambda k: k + 1,
    (True, 1): lambda k: k + 1,
    (True, 2): lambda k: k + 1,
    (False, 0): lambda k: 2,
    (False, 1): lambda k: 2,
    (False, 2): lambda k: k + 1,
}
# collective calls per step, per unit (U units)
CALLS = {
    (True, 0): lambda k: {"reduce_scatter": k, "all_gather": 1},
    (True, 1): lambda k: {"reduce_scatter": k, "all_gather": 1},
    (True, 2): lambda k: {"reduce_scatter": k, "all_gather": 1},
    (False, 0): lambda k: {"all_reduce": 1},
    (False, 1): lambda k: {"reduce_scatter": 1, "all_gather": 1},
    (False, 2): lambda k: {"reduce_scatter": k, "all_gather": 1},
}


def measure_traffic(rank, n, stage, deterministic, k):
    model, eng = mlp_engine(stage, n, k, deterministic)
    one_step(eng, model, rank, n, k)
    step = eng.counter.step - 1
    return {
        "volume": eng.counter.volume(step),
        "counts": eng.counter.counts(step),
        "shards": [u.part.shard_numel for u in eng.units],
        "numel": sum(u.numel for u in eng.units),
        "control": eng.counter.counts(step, kind="control"),
    }


@pytest.mark.dist
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("n, k", [(2, 1), (2, 4), (4, 1), (4, 4), (3, 2)])
def test_counted_volume_equals_the_table(deterministic, stage, n, k):
    """Elements per rank = factor·(N-1)·ΣL exactly (padding included, N·ΣL = Ψ_padded); summed
    over ranks the non-padding elements = factor·(N-1)·Ψ exactly. At M = N, 2Ψ·(N-1)/N."""
    got = get_pool(n).run(measure_traffic, stage, deterministic, k)
    factor = VOLUME[(deterministic, stage)](k)
    units = len(got[0]["shards"])
    payload = 0
    for r in got:
        elements, padding = r["volume"]
        assert elements == factor * (n - 1) * sum(r["shards"])
        payload += elements - padding
        expected_calls = {op: c * units for op, c in CALLS[(deterministic, stage)](k).items()}
        assert r["counts"] == expected_calls
        # control traffic is apart: one exchange of losses, overflow flag and norm partials
        assert r["control"] == {"all_gather": 1}
    assert payload == factor * (n - 1) * got[0]["numel"]


def commdebug_counts(rank, n, stage, gloo_all_gather):
    from torch.distributed.tensor.debug import CommDebugMode

    from zero import collectives

    sends = []
    isend = torch.distributed.isend

    def counted_isend(*args, **kwargs):
        sends.append(1)
        return isend(*args, **kwargs)

    saved, on_host = collectives.GLOO_ALL_GATHER, collectives.on_host
    collectives.GLOO_ALL_GATHER = gloo_all_gather.removesuffix("-cuda")  # restored below
    if gloo_all_gather.endswith("-cuda"):  # the shards stand in for CUDA tensors
        collectives.on_host = lambda t: False
    torch.distributed.isend = counted_isend
    try:
        model, eng = mlp_engine(stage, n, 2, deterministic=True, overlap=False)
        batches = mlp_microbatches(model.cfg, seed=0, data_step=0, count=2 * n, batch_size=4)
        # forward runs outside: stages 0-2 communicate only in backward and step, and the
        # mode's module tracker trips over forward hooks here
        losses = [eng(*batches[i * n + rank])[1] for i in range(2)]
        with CommDebugMode() as mode:
            for loss in losses:
                eng.backward(loss)
            eng.step()
    finally:
        collectives.GLOO_ALL_GATHER, collectives.on_host = saved, on_host
        torch.distributed.isend = isend
    theirs = {str(op).split(".")[-1]: c for op, c in mode.get_comm_counts().items()}
    step = eng.counter.step - 1
    kinds = ("model", "control", "watchdog")
    return theirs, len(sends), *(eng.counter.counts(step, kind=kind) for kind in kinds)


@pytest.mark.dist
@pytest.mark.parametrize("gloo_all_gather", ["backend", "p2p", "p2p-cuda"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_counter_agrees_with_commdebugmode(stage, gloo_all_gather):
    """torch's own c10d counter sees the same number of calls as ours: our reduce-scatters are
    all-to-alls (deterministic), our all-gathers gloo's all_gather_into_tensor, control and the
    watchdog's boundary checks included (zero/ranks/watchdog.py's Watch.boundary). With the model's
    all-gathers as point-to-point sends ([Note: all-gather on gloo], the default on gloo), the
    mode does not see them: each is N - 1 sends per rank instead, counted at dist.isend. On
    CUDA tensors ("p2p-cuda": the shards stand in for them) gloo takes its collective again,
    whose point-to-point path fails there: no send."""
    n = 2
    theirs, sends, model, control, watchdog = get_pool(n).run(
        commdebug_counts, stage, gloo_all_gather
    )[0]
    p2p = gloo_all_gather == "p2p"
    assert model["all_gather"] > 0
    assert sends == (n - 1) * model["all_gather"] * p2p
    assert theirs == {
        "alltoall_base_": model["reduce_scatter"],  # deterministic reduce-scatter = all-to-all
        # the forwards' two checks ran before the mode was entered
        "_allgather_base_": model["all_gather"] * (not p2p)
        + control["all_gather"]
        + watchdog["all_gather"]
        - 2,
    }
    assert control == {"all_gather": 1}
    # 2 forwards, then the second backward (the first follows a checked forward), the step
    assert watchdog == {"all_gather": 4}


# -- memory ------------------------------------------------------------------------------------


def memory_of(rank, n, stage, deterministic, k, precision, reduce_dtype):
    model, eng = mlp_engine(
        stage, n, k, deterministic, precision=precision, reduce_dtype=reduce_dtype, optimizer="adam"
    )
    one_step(eng, model, rank, n, k)
    return eng.memory_report(), sum(u.part.padded_numel for u in eng.units)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize(
    "precision, reduce_dtype", [("fp32", None), ("bf16", "bf16"), ("fp16", "fp32")]
)
@pytest.mark.parametrize("deterministic, k", [(True, 1), (True, 4), (False, 4)])
def test_memory_report_equals_the_analytic_model(stage, precision, reduce_dtype, deterministic, k):
    n = 2
    got = get_pool(n).run(memory_of, stage, deterministic, k, precision, reduce_dtype)
    for report, padded in got:
        want = model_state_breakdown(
            num_params=padded,
            world_size=n,
            stage=stage,
            param_bytes=DTYPES[precision].itemsize,
            grad_bytes=DTYPES[reduce_dtype or "fp32"].itemsize,
            master_bytes=0 if precision == "fp32" else 4,
            optimizer_states=2,
            accumulation=k,
            deterministic=deterministic,
        )
        assert {x: report[x] for x in ("params", "grads", "master", "optimizer")} == {
            "params": want.params,
            "grads": want.grads,
            "master": want.master,
            "optimizer": want.optimizer,
        }


# -- overlap races -----------------------------------------------------------------------------


def bits_with_delays(rank, n, stage, delayed):
    """Two steps with overlap on; with delayed=True every collective launch sleeps 0-20 ms,
    a different amount on every rank, so completion order and interleaving change."""
    original = collectives.launch
    rng = random.Random(1234 + rank)

    def late(*a, **kw):
        time.sleep(rng.uniform(0, 0.02))
        return original(*a, **kw)

    with patched(collectives, **({"launch": late} if delayed else {})):
        model, eng = mlp_engine(stage, n, 2, precision="bf16", overlap=True)
        for step in range(2):
            one_step(eng, model, rank, n, 2, step)
        return [u.master.clone().view(torch.int32) for u in eng.units]


def stage3_traffic(rank, n, k, overlap):
    model, eng = mlp_engine(3, n, k, overlap=overlap)
    one_step(eng, model, rank, n, k)
    step = eng.counter.step - 1
    root = [u.part.shard_numel for u in eng.units if not u.name]
    rest = [u.part.shard_numel for u in eng.units if u.name]
    bits = [u.master.clone().view(torch.int32) for u in eng.units]
    return eng.counter.volume(step), eng.counter.counts(step), root, rest, eng.impl.peak_live, bits


@pytest.mark.dist
@pytest.mark.parametrize("n, k", [(2, 1), (4, 1), (4, 4), (3, 2)])
def test_stage3_counted_volume_and_calls(n, k):
    """Per micro-step: 2 all-gathers (forward, backward) and 1 reduce-scatter per unit, so
    3Ψ·(N-1)/N·M/N; the root stays gathered from forward to backward: 1 all-gather + 1
    reduce-scatter. Prefetch (overlap on) changes neither the counts nor the bits."""
    on = get_pool(n).run(stage3_traffic, k, True)
    off = get_pool(n).run(stage3_traffic, k, False)
    for (vol, counts, root, rest, live, bits), (vol2, counts2, *_, live2, bits2) in zip(on, off):
        assert vol[0] == k * (n - 1) * (3 * sum(rest) + 2 * sum(root))
        assert counts == {
            "all_gather": k * (2 * len(rest) + len(root)),
            "reduce_scatter": k * (len(rest) + len(root)),
        }
        assert (vol, counts) == (vol2, counts2)
        assert all(torch.equal(a, b) for a, b in zip(bits, bits2, strict=True))
        assert live <= 2 and live2 == 1  # the prefetch bound (max_live = 2), and none without


def stage3_gathers(rank, n, overlap):
    """Two steps of a 4-block GPT at stage 3, M = 2N: every gather of a non-root unit, as
    (pass, unit, how): "prefetch" launched ahead, "sync" launched and waited where needed."""
    from zero.loop import train_steps
    from zero.stages.stage3 import PartitionState
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))
    cfg = ZeroConfig(stage=3, micro_batches=2 * n, overlap=overlap, units=tuple(model.unit_names()))
    eng = ZeroEngine(model, cfg)
    impl, seen, passes = eng.impl, [], [0]
    inner, end_backward = impl._transition, impl.end_backward

    def transition(u, to, phase):
        if u.name and u.state is PartitionState.SHARDED and to is not PartitionState.SHARDED:
            how = "prefetch" if to is PartitionState.GATHERING else "sync"
            seen.append((passes[0], u.name, phase, how))
        inner(u, to, phase)

    def counted_end_backward():
        end_backward()
        passes[0] += 1

    impl._transition, impl.end_backward = transition, counted_end_backward

    def mb(s, j):
        return gpt_microbatches(model.cfg, seed=0, data_step=s, count=j + 1, batch_size=2)[j]

    train_steps(eng, mb, 2)
    bits = [u.master.clone().view(torch.int32) for u in eng.units]
    return seen, passes[0], bits, eng.counter.volume(0), eng.impl.peak_live


@pytest.mark.dist
def test_stage3_prefetches_the_ends_of_a_pass():
    """[Note: the ends of a pass]: once a pass has taught the order, no unit is gathered
    synchronously: the first block's forward gather is launched by the root's pre-hook and the
    last block's backward gather as forward frees it. Without overlap every gather is
    synchronous; the bits and the counted traffic are the same either way."""
    on = get_pool(2).run(stage3_gathers, True)
    off = get_pool(2).run(stage3_gathers, False)
    blocks = [f"transformer.h.{i}" for i in range(4)]
    for (seen, passes, bits, vol, live), (seen2, passes2, bits2, vol2, live2) in zip(on, off):
        assert passes == passes2 == 4  # 2 steps × M/N = 2 micro-steps
        first = [(name, phase, how) for p, name, phase, how in seen if p == 0]
        assert first[0] == (blocks[0], "param_fwd", "sync")  # no order learned yet
        later = [(name, phase, how) for p, name, phase, how in seen if p > 0]
        per_pass = [(b, "param_fwd", "prefetch") for b in blocks]
        per_pass += [(b, "param_bwd", "prefetch") for b in reversed(blocks)]
        assert later == per_pass * 3
        assert {how for *_, how in seen2} == {"sync"} and len(seen2) == 8 * 4
        assert all(torch.equal(a, b) for a, b in zip(bits, bits2, strict=True))
        assert vol == vol2 and live <= 2 and live2 == 1


def stage3_gpt_probe(rank, n):
    from zero.loop import train_steps
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    eng = ZeroEngine(
        model, ZeroConfig(stage=3, micro_batches=2 * n, chunk=128, units=tuple(model.unit_names()))
    )
    with eng.gathered_params():
        exact = all(
            torch.equal(p.detach().view(torch.int32), init[k].view(torch.int32))
            for k, p in model.named_parameters()
        )

    def mb(s, j):
        return gpt_microbatches(model.cfg, seed=0, data_step=s, count=j + 1, batch_size=2)[j]

    train_steps(eng, mb, 2)
    weight = model.transformer.h[1].attn.c_attn.weight
    try:
        float(weight.sum())
        error = ""
    except RuntimeError as e:
        error = str(e)
    return exact, tuple(weight.shape), error, eng.impl.peak_live


@pytest.mark.dist
def test_stage3_parameters_outside_a_gather():
    """Reading a sharded parameter raises an error naming it and its unit (shape stays
    readable); engine.gathered_params() shows the full values; 4 blocks, prefetch bound 2."""
    for exact, shape, error, live in get_pool(2).run(stage3_gpt_probe):
        assert exact and shape == (96, 32)
        assert "'transformer.h.1.attn.c_attn.weight' of unit transformer.h.1 is sharded" in error
        assert live <= 2


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_injected_delays_do_not_change_the_bits(stage):
    calm = get_pool(4).run(bits_with_delays, stage, False)
    late = get_pool(4).run(bits_with_delays, stage, True)
    for a, b in zip(calm, late, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- the harness has teeth ---------------------------------------------------------------------


def cells_with_sequential_reduce(rank, n, todo):
    """A broken engine: the deterministic reduce-scatter sums left to right, not by the tree."""

    def sequential(xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = acc + x
        return acc

    with patched(collectives, tree_sum=sequential):
        return run_cells(rank, n, todo)


@pytest.mark.dist
def test_harness_catches_a_reduce_scatter_in_another_order():
    todo = [Cell(stage=2, world_size=4, precision="fp32", optimizer="adam", mode="deterministic")]
    per_rank = get_pool(4).run(cells_with_sequential_reduce, todo)
    assert not all(r[0]["passed"] for r in per_rank)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stage": 4}, "stage"),
        ({"precision": "fp8"}, "precision"),
        ({"reduce_dtype": "bf16"}, "reduce_dtype"),
        ({"optimizer": "lamb"}, "optimizer"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"chunk": 100}, "chunk"),
        ({"units": ("a", "a")}, "units"),
        ({"deterministic": "yes"}, "deterministic"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ZeroConfig(**kwargs)


def build_with_rank_difference(rank, n):
    model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3))
    if rank == 1:
        with torch.no_grad():
            model.layers[1].weight[0, 0] += 1.0  # a different initial value on rank 1 only
    ZeroEngine(model, ZeroConfig(units=tuple(model.unit_names()), micro_batches=n, chunk=128))


def build_with_different_units(rank, n):
    model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3))
    units = tuple(model.unit_names()[: 1 + rank])
    ZeroEngine(model, ZeroConfig(units=units, micro_batches=n, chunk=128))


@pytest.mark.dist
def test_ranks_that_disagree_are_named():
    with pytest.raises(RankError, match=r"rank 1 disagrees with rank 0 on unit layers.1 initial"):
        get_pool(2).run(build_with_rank_difference)
    with pytest.raises(
        RankError, match=r"rank 1 has 3 units, rank 0 has 2: the ranks built different"
    ):
        get_pool(2).run(build_with_different_units)


def nonfinite_step(rank, n, precision):
    model, eng = mlp_engine(1, n, 1, precision=precision)
    _, loss = eng(*mlp_microbatches(model.cfg, seed=0, data_step=0, count=n, batch_size=4)[rank])
    eng.backward(loss * (float("inf") if rank == 1 else 1.0))
    eng.step()


def early_step(rank, n):
    model, eng = mlp_engine(1, n, 2)
    eng.step()


@pytest.mark.dist
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_gradient_without_loss_scaling_raises_on_every_rank(precision):
    """Only rank 1 sees inf, but the MAX all-reduce tells rank 0 too: both raise, none hangs."""
    with pytest.raises(RankError, match="non-finite gradient at data step 0") as err:
        get_pool(2).run(nonfinite_step, precision)
    assert f"precision='{precision}'" in str(err.value)


@pytest.mark.dist
def test_step_before_all_microsteps_is_refused():
    with pytest.raises(RankError, match="step\\(\\) after 0 micro-steps"):
        get_pool(2).run(early_step)


# -- partition (pure) --------------------------------------------------------------------------


@given(
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=6),
    n=st.integers(1, 8),
    groups=st.lists(st.integers(0, 2), min_size=6, max_size=6),
)
def test_partition_owns_every_element_once(sizes, n, groups):
    params = [(f"p{i}", (s,)) for i, s in enumerate(sizes)]
    parts = [
        UnitPartition.build(params, world_size=n, rank=r, groups=groups[: len(sizes)], chunk=128)
        for r in range(n)
    ]
    L = parts[0].shard_numel
    assert all(p.shard_numel == L for p in parts) and L % 128 == 0
    owner = np.zeros(parts[0].padded_numel, int)
    for p in parts:
        owner[p.own] += 1
        runs = p.runs()  # runs tile the shard exactly when it holds any parameter
        if runs:
            assert runs[0].start == 0 and runs[-1].stop == L
            assert all(a.stop == b.start for a, b in zip(runs, runs[1:]))
    assert (owner == 1).all()
    assert sum(p.real_elements(r) for r, p in enumerate(parts)) == sum(sizes)
    flat = torch.zeros(parts[0].padded_numel)
    values = {name: torch.randn(shape) for name, shape in params}
    parts[0].flatten_into(flat, values)
    back = parts[0].views(flat)
    assert all(torch.equal(back[k], v) for k, v in values.items())


def test_collective_names_resolve_on_this_torch():
    assert collectives.all_gather_flat in (
        getattr(dist, "all_gather_single", None),
        dist.all_gather_into_tensor,
    )


# -- fast mode, in lock-step -------------------------------------------------------------------


def fast_cells(n, model="mlp"):
    numerics = [
        {"precision": p, "optimizer": o, "reduce_dtype": rd}
        for p, o, rd in (("fp32", "adamw", None), ("bf16", "sgd", "bf16"), ("fp16", "adam", None))
    ]
    return matrix.cells(stage=STAGES, world_size=n, numerics=numerics, mode="fast", model=model)


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_fast_cells_stay_within_their_derived_bounds(n):
    """Backend reduce-scatter/all-reduce, local accumulation, torch's optimizer kernels: every
    step from the reference's state, R and the update within verify/checks/lockstep.py's bounds."""
    assert failures(n, fast_cells(n) + fast_cells(n, model="gpt")[:3]) == []


def fast_with_planted_bug(rank, n, bug, todo):
    """Broken fast engines: a reduce-scatter 0.1% off, or a learning rate 0.1% off. Both are
    far beyond rounding (bounds are ~1e-6 relative), so the lock-step checks must fail."""
    from zero.optim import update as zoptim

    originals = (collectives.reduce_scatter_fast, zoptim.fast_step, collectives.reduce_scatter_tree)

    def skew(fn):
        def skewed_reduce(*a, **kw):
            pending = fn(*a, **kw)
            finish = pending._finish
            pending._finish = lambda: finish() * 1.001
            return pending

        return skewed_reduce

    def skewed_lr(kind, hp, *a):
        from dataclasses import replace

        return originals[1](kind, replace(hp, lr=hp.lr * 1.001), *a)

    if bug == "reduce":  # fast mode on gloo reduce-scatters through the all-to-all too
        planted = patched(
            collectives,
            reduce_scatter_fast=skew(originals[0]),
            reduce_scatter_tree=skew(originals[2]),
        )
    else:
        planted = patched(zoptim, fast_step=skewed_lr)
    with planted:
        return run_cells(rank, n, todo)


@pytest.mark.dist
@pytest.mark.parametrize("bug, stage", [("reduce", 2), ("lr", 1)])
def test_fast_checks_catch_planted_bugs(bug, stage):
    todo = [Cell(stage=stage, world_size=2, precision="fp32", optimizer="adam", mode="fast")]
    per_rank = get_pool(2).run(fast_with_planted_bug, bug, todo)
    assert not all(r[0]["passed"] for r in per_rank)
    key = "reduced" if bug == "reduce" else "master"
    assert max(r[0]["ratios"][key] for r in per_rank) > 10


@pytest.mark.full
@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_release_matrix_on_the_gpt(n, mode):
    """Release tier: every stage x precision x optimizer on the GPT, M = 4N, 4 steps."""
    todo = cells(n, mode=mode, model="gpt", accumulation=4, steps=4)
    todo = [c for c in todo if c.stage < 3]
    assert failures(n, todo) == []


def persistent_traffic(rank, n, k, deterministic):
    model, eng = mlp_engine(3, n, k, deterministic=deterministic, persist_below=1000)
    one_step(eng, model, rank, n, k)
    step = eng.counter.step - 1
    by_unit = {}
    for r in eng.counter.of_step(step):
        by_unit.setdefault(eng.units[r.unit].name, {}).setdefault(r.op, 0)
        by_unit[eng.units[r.unit].name][r.op] += 1
    return by_unit, {u.name: u.numel for u in eng.units}


@pytest.mark.dist
@pytest.mark.parametrize("deterministic", [True, False])
def test_stage3_persistent_units(deterministic):
    """Units of at most persist_below parameters stay whole: no all-gathers of parameters, their
    gradients reduced as at stage 0 (2Ψ_unit: reduce-scatter per micro-step + all-gather of the
    reduced gradient, or one all-reduce in fast mode); the rest gather per use."""
    k, n = 2, 2
    todo = matrix.cells(
        stage=3, world_size=n, precision=("fp32", "bf16"), optimizer="adam",
        mode=("deterministic", "fast"),
        models=({"model": "mlp", "persist_below": 1000}, {"model": "gpt", "persist_below": 3000}),
    )  # fmt: skip
    assert failures(n, todo) == []
    by_unit, numel = get_pool(n).run(persistent_traffic, k, deterministic)[0]
    for name, ops in by_unit.items():
        if numel[name] <= 1000:
            want = {"reduce_scatter": k, "all_gather": 1} if deterministic else {"all_reduce": 1}
        else:
            want = {"reduce_scatter": k, "all_gather": 2 * k}
        assert ops == want, name
    assert any(v <= 1000 for v in numel.values()) and any(v > 1000 for v in numel.values())


# -- gradient injection ------------------------------------------------------------------------


def injected_run(rank, n, stage, precision, poison):
    """Two steps of injected gradients (M = 2N): random normals scaled by 2^e with e drawn per
    tensor in [-30, 10], so bf16/fp16 see subnormals and near-overflow values; with `poison`,
    rank 1's second micro-batch of step 0 carries an inf (fp16: skip and halve the scale)."""
    from reference.step import ModelSpec, init_state, train_step
    from verify.checks.harness import compare_rank

    k = 2
    model, eng = mlp_engine(stage, n, k, precision=precision)
    init = {name: v.detach().float().numpy().copy() for name, v in eng.gather_state()[0].items()}
    spec = ModelSpec.build(eng.unit_specs(), eng.group_index, chunk=eng.config.chunk)
    rcfg = eng.config.step_config(n)
    ref = init_state(init, spec, rcfg)
    dtype = eng.config.compute_dtype
    verdicts = []
    for step in range(2):
        rng = np.random.default_rng(step)
        grads = []
        for j in range(n * k):
            g = {}
            for name, v in init.items():
                e = rng.integers(-30, 11)
                x = torch.from_numpy(rng.standard_normal(v.shape).astype(np.float32) * 2.0**e)
                g[name] = x.to(dtype)
            if poison and step == 0 and j == n * 1 + 1:
                next(iter(g.values())).view(-1)[0] = float("inf")
            grads.append(g)
        ref, info = train_step(
            ref, [{a: to_np(b) for a, b in g.items()} for g in grads], spec, rcfg
        )
        for i in range(k):  # rank r takes micro-batches r, N + r, ... (docs/design.md §2)
            eng.inject_gradients(grads[i * n + rank], loss=1.0)
        res = eng.step()
        ok, _, _, first = compare_rank(eng, ref, rcfg)
        verdicts.append((ok, first, res.skipped, bool(info.skipped)))
    return verdicts


def to_np(t):
    from verify.checks.compare import to_numpy

    return to_numpy(t).copy()


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision, poison", [("fp32", False), ("bf16", False), ("fp16", True)])
def test_injected_gradients_reach_the_reference_bits(stage, precision, poison):
    """Gradients fed straight into the gradient path, with values no model would produce,
    give the reference's bits on every rank; an inf on one rank skips the step on all."""
    per_rank = get_pool(2).run(injected_run, stage, precision, poison)
    for verdicts in per_rank:
        assert [v[:2] for v in verdicts] == [(True, "")] * 2, verdicts
        assert [v[2] for v in verdicts] == [v[3] for v in verdicts]
        assert [v[3] for v in verdicts] == [poison, False]


def inject_wrong(rank, n, what):
    model, eng = mlp_engine(2, n, 1)
    grads = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    name = next(iter(grads))
    if what == "unknown":
        grads["not.a.parameter"] = torch.zeros(3)
    else:
        grads[name] = torch.zeros(3)
    eng.inject_gradients(grads)


@pytest.mark.dist
@pytest.mark.parametrize(
    "what, message",
    [("unknown", "'not.a.parameter'.*no trainable parameter"), ("shape", "needs shape")],
)
def test_injected_gradients_are_checked(what, message):
    with pytest.raises(RankError, match=message):
        get_pool(1).run(inject_wrong, what)
