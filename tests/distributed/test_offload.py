"""ZeRO-Offload on the engine (zero/zero_r/offload.py): the fp32 master, optimizer states and
reduced gradient shard in host memory, the update on the CPU. On this CPU-only machine offload is a
change of placement: what is tested is the bits, the exact host<->device bytes, and which buffers
moved from the device to the host."""

import pytest
from engine_tools import OptCell, failures, mlp_engine, one_step

from reference.precision import DTYPES
from verify.cells.matrix import PRECISIONS, STAGES, cells
from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(600)

OFFLOAD = (("offload_optimizer", True),)
NUMERICS = [{"precision": p, "optimizer": o} for p, o in zip(PRECISIONS, ("adamw", "sgd", "adam"))]


# -- bits --------------------------------------------------------------------------------------


def offload_cells(n, mode, model="mlp", gradients="backward"):
    return cells(
        cls=OptCell, stage=STAGES, world_size=n, numerics=NUMERICS, mode=mode, model=model,
        gradients=gradients, options=[OFFLOAD],
    )  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2, 4])
def test_offloaded_cells_are_bitwise_equal_to_the_reference(n):
    """The CPU update runs zero/optim/update.py's deterministic kernels on host tensors, the working
    copy is rounded on the host: every rank's master, states and working copy are the
    reference's bits, stages 0-3 x fp32/bf16/fp16, on the MLP and (AdamW) on the GPT."""
    todo = offload_cells(n, "deterministic")
    todo += [c for c in offload_cells(n, "deterministic", "gpt") if c.optimizer == "adamw"]
    assert failures(n, todo) == []


@pytest.mark.dist
def test_offloaded_injected_extremes_and_nonfinite_gradients():
    """Injected gradients (subnormals, near-overflow, inf on one rank: fp16 skips the step on
    every rank) reach the reference's bits through the host path too."""
    todo = offload_cells(2, "deterministic", "params-uneven", "extreme")
    todo += [
        c
        for c in offload_cells(2, "deterministic", "params-uneven", "nonfinite")
        if c.precision == "fp16"
    ]
    assert failures(2, todo) == []


@pytest.mark.dist
def test_offloaded_fast_cells_stay_within_their_bounds():
    assert failures(2, offload_cells(2, "fast")) == []


# -- traffic -----------------------------------------------------------------------------------


def offload_traffic(rank, n, stage, k, precision, reduce_dtype, deterministic=True):
    model, eng = mlp_engine(
        stage,
        n,
        k,
        deterministic,
        precision,
        reduce_dtype=reduce_dtype,
        optimizer="adam",
        offload_optimizer=True,
    )
    for step in range(2):
        one_step(eng, model, rank, n, k, step)
    recs = [
        (r.phase, r.unit, r.elements, r.padding, r.nbytes)
        for r in eng.counter.of_step(1, "offload")
    ]
    extents = [eng.master_extent(u) for u in eng.units]
    return recs, [e.stop - e.start for e in extents], model.num_params()


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "precision, reduce_dtype, minimum",
    [("bf16", "bf16", 4), ("fp16", "fp16", 4), ("bf16", None, 6), ("fp32", None, 8)],
)
def test_one_rank_moves_zero_offloads_minimum(stage, precision, reduce_dtype, minimum):
    """N = 1, M = 1: per step the reduced gradient goes down once (Ψ in the reduction dtype)
    and the updated parameters come up once (Ψ in the compute dtype): 2Ψ + 2Ψ = 4Ψ bytes with
    16-bit gradients, 4Ψ + 2Ψ = 6Ψ with fp32 gradients (ZeRO-Offload's minimum, docs/paper.md §2),
    8Ψ in pure fp32. One record per unit and way; padding counted apart."""
    ((recs, extents, psi),) = get_pool(1).run(offload_traffic, stage, 1, precision, reduce_dtype)
    down = [r for r in recs if r[0] == "grad_down"]
    up = [r for r in recs if r[0] == "param_up"]
    assert [r[1] for r in down] == [r[1] for r in up] == list(range(len(extents)))
    assert [r[2] for r in down] == [r[2] for r in up] == extents
    assert sum(r[2] - r[3] for r in down) == sum(r[2] - r[3] for r in up) == psi
    grad_bytes = DTYPES[reduce_dtype or "fp32"].itemsize
    param_bytes = DTYPES[precision].itemsize
    payload = sum((r[2] - r[3]) * r[4] // r[2] for r in recs)
    assert payload == (grad_bytes + param_bytes) * psi == minimum * psi
    assert len(recs) == 2 * len(extents)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("deterministic, k", [(True, 1), (True, 4), (False, 1), (False, 4)])
def test_ranks_move_their_shards_once_per_step(stage, deterministic, k):
    """N = 2: each rank moves its extent (L per unit); over the ranks the non-padding elements
    are Ψ each way. Deterministic mode brings R down once per step whatever M/N (the streaming
    tree's partial sums stay on the device); fast mode at stages 2-3 accumulates the reduced
    shards on the host: M/N downloads per step (stage 1 accumulates on the device: one)."""
    n = 2
    got = get_pool(n).run(offload_traffic, stage, k, "bf16", "bf16", deterministic)
    downs_per_unit = k if (not deterministic and stage >= 2) else 1
    for way in ("grad_down", "param_up"):
        total = 0
        for recs, extents, _ in got:
            mine = [r for r in recs if r[0] == way]
            per = downs_per_unit if way == "grad_down" else 1
            assert sorted(r[1] for r in mine) == sorted(list(range(len(extents))) * per)
            assert all(r[2] == extents[r[1]] and r[4] == 2 * r[2] for r in mine)
            total += sum(r[2] - r[3] for r in mine) // per
        assert total == got[0][2]  # Ψ


# -- memory ------------------------------------------------------------------------------------


def split_of(rank, n, stage, precision, reduce_dtype, offload):
    model, eng = mlp_engine(
        stage,
        n,
        1,
        precision=precision,
        reduce_dtype=reduce_dtype,
        optimizer="adam",
        offload_optimizer=offload,
    )
    one_step(eng, model, rank, n, 1)
    extents = [eng.master_extent(u).stop - eng.master_extent(u).start for u in eng.units]
    return eng.memory_split(), eng.memory_report(), sum(extents), max(extents)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(
    "precision, reduce_dtype", [("bf16", "bf16"), ("fp16", None), ("fp32", None)]
)
def test_offload_moves_the_optimizer_states_and_the_gradient_shard(stage, precision, reduce_dtype):
    """Adam, N = 2, M = N. With E = the rank's extent (Σ L over units, padding included):
    the device loses KE (K = 12: fp32 master 4 + m 4 + v 4; pure fp32 K = 8, the master being
    the working copy itself) and, at stages 2-3, the gradient shard E·grad bytes; the host holds
    exactly the master (4E), the states (8E), the reduced gradient of the extent (E·grad bytes)
    and, in mixed precision, two compute-dtype staging slots of the largest extent E_max
    ([Note: bounded upload staging]: 2·E_max·param bytes, not E·param bytes).
    Stage 1 keeps its full gradient buffer on the device (its collectives read it)."""
    n = 2
    off = get_pool(n).run(split_of, stage, precision, reduce_dtype, False)
    on = get_pool(n).run(split_of, stage, precision, reduce_dtype, True)
    g = DTYPES[reduce_dtype or "fp32"].itemsize
    p = DTYPES[precision].itemsize
    k = 8 if precision == "fp32" else 12
    for (before, total0, e, _), (after, total1, e1, largest) in zip(off, on, strict=True):
        assert e == e1
        dev0, dev1, host = before["device"], after["device"], after["host"]
        assert before["host"] == {x: 0 for x in before["host"]}
        shard = g * e if stage >= 2 else 0
        assert sum(dev0.values()) - sum(dev1.values()) == k * e + shard
        assert (dev1["master"], dev1["optimizer"]) == (0, 0)
        assert dev1["params"] == dev0["params"]
        assert dev1["grads"] == dev0["grads"] - shard
        assert host["master"] == 4 * e and host["optimizer"] == 8 * e
        assert host["grads"] == g * e
        assert host.get("staging", 0) == (0 if precision == "fp32" else 2 * p * largest)
        # memory_report keeps its meaning: totals per category, wherever they live
        assert total1 == {x: dev1.get(x, 0) + host.get(x, 0) for x in total1}
        assert (total1["params"], total1["optimizer"]) == (total0["params"], total0["optimizer"])
        # the master is a view of the working copy in pure fp32; offloaded it needs its own 4E
        assert total1["master"] == total0["master"] + (4 * e if precision == "fp32" else 0)
