"""The whole tensor-parallel GPT on gloo ranks: bits, traffic, and the mesh's groups.

- Deterministic mode is reproducible bit for bit: two runs, one with random delays injected
  before every MP collective, give the same loss and gradients; every MP rank holds the same
  loss and the same gradients of the replicated parameters (docs/design.md §6).
- The counted MP traffic of one forward and one backward equals docs/design.md §6's table,
  written here again: forward 2L + 1 sums of b·s·h (g in each block's two branches, the
  embedding) and the cross entropy's max and two sums of b·s; backward 2L + 1 sums of b·s·h
  (f in each block's two branches and in the head).
- Mesh(dp, mp).groups() on real ranks: each rank sums its global rank over its MP and its DP
  group; the sums equal the hand-written membership. On the fake process group (one process
  playing each rank of a 4 × 2 mesh in turn) the groups are the hand-written ones too, and the
  simulated rank runs its TPGPT slice with the table's collectives.

Legend: N = N_m, L blocks, X = b·s·h, T = b·s, ⌈⌉ the ring's chunk rounding.
"""

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]

CFG = dict(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=32)
BATCH = 2


def run_model(rank, world, deterministic, delay_seed=None):
    """Worker: two micro-batches of forward + backward on this rank's TPGPT slice. Returns
    loss bits, a digest per parameter gradient, and the counted MP traffic per pass."""
    import random
    import time

    import zero.mp.tp_comm as mpc
    from zero.collectives import CommCounter
    from zero.mp import TPGPT, Mesh, MPContext
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    groups = Mesh(dp=1, mp=world).groups()
    real = mpc.__dict__.setdefault("_real_reduce_sum", mpc.reduce_sum)
    rng = random.Random(f"{delay_seed}-{rank}")

    def delayed(x, *, ctx, phase):
        time.sleep(rng.uniform(0, 0.02))  # ranks arrive in a different order every call
        return real(x, ctx=ctx, phase=phase)

    mpc.reduce_sum = real if delay_seed is None else delayed
    try:
        cfg = GPTConfig(**CFG)
        counter = CommCounter(keep_steps=None)
        mp = MPContext.of(groups.mp_group, counter=counter, deterministic=deterministic)
        tp = TPGPT.from_gpt(GPT(cfg, seed=5), mp)
        losses, traffic = [], []
        for j, (idx, tgt) in enumerate(
            gpt_microbatches(cfg, seed=1, data_step=0, count=2, batch_size=BATCH)
        ):
            counter.step = 2 * j
            _, loss = tp(idx, tgt)
            counter.step = 2 * j + 1
            loss.backward()
            losses.append(loss.detach().view(torch.int32).item())
            traffic.append(
                [
                    sorted((r.op, r.phase, r.elements) for r in counter.of_step(s, "mp"))
                    for s in (2 * j, 2 * j + 1)
                ]
            )
        grads = {
            k: hashlib.sha256(p.grad.contiguous().view(torch.uint8).numpy()).hexdigest()
            for k, p in tp.named_parameters()
        }
        return dict(
            losses=losses, grads=grads, traffic=traffic, model_kind=counter.total("model")["calls"]
        )
    finally:
        mpc.reduce_sum = real


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_deterministic_mode_is_bitwise_reproducible_with_delays(n):
    from zero.mp import split_rule

    plain = get_pool(n).run(run_model, True)
    delayed = get_pool(n).run(run_model, True, 7)
    for a, b in zip(plain, delayed, strict=True):
        assert a["losses"] == b["losses"] and a["grads"] == b["grads"]
    # the loss and the replicated parameters' gradients: the same bits on every MP rank, so
    # the engine may treat them as one copy (docs/design.md §6)
    first = plain[0]
    replicated = [k for k in first["grads"] if split_rule(k) is None]
    assert replicated
    for r in plain[1:]:
        assert r["losses"] == first["losses"]
        assert all(r["grads"][k] == first["grads"][k] for k in replicated)
    split = [k for k in plain[0]["grads"] if split_rule(k) is not None]
    assert any(plain[0]["grads"][k] != plain[1]["grads"][k] for k in split)  # slices differ


def expected_traffic(n, deterministic):
    """docs/design.md §6's table: (op, phase, elements) of one forward and one backward."""
    h, t, layers = CFG["n_embd"], BATCH * CFG["block_size"], CFG["n_layer"]
    x = t * h
    op = "all_gather" if deterministic else "all_reduce"

    def sum_of(k):  # one sum of k elements over the MP group
        return (n - 1) * k if deterministic else 2 * (n - 1) * math.ceil(k / n)

    ring_max = ("all_reduce", "mp_xent", 2 * (n - 1) * math.ceil(t / n))
    forward = [(op, "mp_fwd", sum_of(x))] * (2 * layers) + [(op, "mp_embed", sum_of(x))]
    forward += [(op, "mp_xent", sum_of(t))] * 2 + [ring_max]
    backward = [(op, "mp_bwd", sum_of(x))] * (2 * layers + 1)
    return [sorted(forward), sorted(backward)]


def check_traffic(n):
    for deterministic in (True, False):
        want = expected_traffic(n, deterministic)
        for r in get_pool(n).run(run_model, deterministic):
            assert r["traffic"] == [want, want]  # both micro-batches
            assert r["model_kind"] == 0  # MP traffic never lands in ZeRO's "model" kind


@pytest.mark.dist
def test_counted_mp_traffic_equals_the_table_at_2():
    check_traffic(2)


@pytest.mark.dist
@pytest.mark.full
def test_counted_mp_traffic_equals_the_table_at_4():
    check_traffic(4)


def group_sums(rank, world, dp, mp):
    """Worker: Σ of global ranks over this rank's MP group and DP group, and its coordinates."""
    import torch.distributed as dist

    from zero.mp import Mesh

    g = Mesh(dp=dp, mp=mp).groups()
    out = []
    for group in (g.mp_group, g.dp_group):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out.append(int(t.item()))
    return dict(coords=(g.d, g.m), sums=out)


# (dp, mp) -> each rank's (d, m), its MP group, its DP group: written by hand
MEMBERSHIP = {
    (1, 2): [((0, 0), [0, 1], [0]), ((0, 1), [0, 1], [1])],
    (2, 1): [((0, 0), [0], [0, 1]), ((1, 0), [1], [0, 1])],
    (2, 2): [
        ((0, 0), [0, 1], [0, 2]),
        ((0, 1), [0, 1], [1, 3]),
        ((1, 0), [2, 3], [0, 2]),
        ((1, 1), [2, 3], [1, 3]),
    ],
}


@pytest.mark.dist
@pytest.mark.parametrize("shape", sorted(MEMBERSHIP))
def test_mesh_groups_on_real_ranks(shape):
    dp, mp = shape
    got = get_pool(dp * mp).run(group_sums, dp, mp)
    for r, (coords, mp_ranks, dp_ranks) in zip(got, MEMBERSHIP[shape], strict=True):
        assert r["coords"] == coords and r["sums"] == [sum(mp_ranks), sum(dp_ranks)]


def commdebug(rank, world, deterministic):
    """Worker: torch's c10d call counts over one forward + backward, beside our counter's.
    All-gathers take gloo's own collective here, which the mode sees; the point-to-point form
    ([Note: all-gather on gloo]) is counted against isend in tests/distributed/test_engine.py."""
    from torch.distributed.tensor.debug import CommDebugMode

    from zero import collectives
    from zero.collectives import CommCounter
    from zero.mp import TPGPT, Mesh, MPContext
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    groups = Mesh(dp=1, mp=world).groups()
    cfg = GPTConfig(**CFG)
    counter = CommCounter()
    mp = MPContext.of(groups.mp_group, counter=counter, deterministic=deterministic)
    tp = TPGPT.from_gpt(GPT(cfg, seed=5), mp)
    idx, tgt = gpt_microbatches(cfg, seed=1, data_step=0, count=1, batch_size=BATCH)[0]
    saved, collectives.GLOO_ALL_GATHER = collectives.GLOO_ALL_GATHER, "backend"
    try:  # pool workers live on: restored below
        with CommDebugMode() as mode:
            tp(idx, tgt)[1].backward()
    finally:
        collectives.GLOO_ALL_GATHER = saved
    theirs = {str(op).split(".")[-1]: c for op, c in mode.get_comm_counts().items()}
    return theirs, counter.counts(kind="mp")


@pytest.mark.dist
@pytest.mark.parametrize("deterministic", [True, False])
def test_counter_agrees_with_commdebugmode(deterministic):
    """torch's own c10d counter sees every call ours records, and no other."""
    theirs, ours = get_pool(2).run(commdebug, deterministic)[0]
    names = {"all_gather": "_allgather_base_", "all_reduce": "allreduce_"}
    assert theirs == {names[op]: c for op, c in ours.items()}


def compose(rank, world, plant=None):
    """Worker: loss and gradients of the TPGPT slice and of the plain GPT, both in float64."""
    import zero.mp.gpt as mpgpt
    from zero.collectives import CommCounter
    from zero.mp import TPGPT, Mesh, MPContext
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    groups = Mesh(dp=1, mp=world).groups()
    saved = dict(mpgpt.SPLITS)
    if plant == "qkv_as_rows":  # q, k and v cut as one block: rank 0 gets q and half of k
        mpgpt.SPLITS.update({"attn.c_attn.weight": "rows", "attn.c_attn.bias": "rows"})
    try:
        cfg = GPTConfig(**CFG)
        full = GPT(cfg, seed=5).double()
        mp = MPContext.of(groups.mp_group, counter=CommCounter(), deterministic=True)
        tp = TPGPT.from_gpt(full, mp)
        idx, tgt = gpt_microbatches(cfg, seed=1, data_step=0, count=1, batch_size=BATCH)[0]
        loss1, loss_tp = full(idx, tgt)[1], tp(idx, tgt)[1]
        loss1.backward(), loss_tp.backward()
        grads = lambda model: {k: p.grad for k, p in model.named_parameters()}  # noqa: E731
        return loss1.item(), loss_tp.item(), grads(full), grads(tp)
    finally:
        mpgpt.SPLITS.clear()
        mpgpt.SPLITS.update(saved)


def composition_errors(n, plant=None):
    from zero.mp import join_states
    from zero.workloads.models import GPTConfig

    ranks = get_pool(n).run(compose, plant)
    loss1, _, g1, _ = ranks[0]
    joined = join_states([r[3] for r in ranks], GPTConfig(**CFG))
    loss_err = max(abs(r[1] - loss1) for r in ranks) / abs(loss1)
    grad_err = max(float((joined[k] - g).abs().max() / g.abs().max()) for k, g in g1.items())
    return loss_err, grad_err


# [Composition, not rounding] There is no derivable rounding bound for a whole model (docs §6);
# this checks how the operators are put together (splits, residuals, embeddings, head). In
# float64 both models round at u = 2^-53; to differ by 2^-24 relative (float32's unit roundoff)
# they would need a condition number above 2^29, while a structural error moves the loss and
# the gradients at the percent level. Relative to the loss, and to each gradient tensor's
# largest element.
SEPARATION = 2.0**-24


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_the_split_model_composes_like_the_plain_one(n):
    loss_err, grad_err = composition_errors(n)
    assert loss_err <= SEPARATION and grad_err <= SEPARATION, (loss_err, grad_err)


@pytest.mark.dist
def test_a_wrong_split_fails_the_composition_check():
    """Cutting QKV as one block passes every operator lock-step (both sides cut alike) and
    must fail here."""
    loss_err, grad_err = composition_errors(2, "qkv_as_rows")
    assert loss_err > 1e3 * SEPARATION and grad_err > 1e3 * SEPARATION, (loss_err, grad_err)


FAKE_MESH = """
import json, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from zero.mp import Mesh
out = {}
for rank in range(8):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    g = Mesh(dp=4, mp=2).groups()
    out[rank] = [g.d, g.m, dist.get_process_group_ranks(g.mp_group),
                 dist.get_process_group_ranks(g.dp_group)]
    if rank == 5:  # the simulated rank runs its TPGPT slice (values void, traffic counted)
        import torch
        from zero.collectives import CommCounter
        from zero.workloads.models import GPTConfig
        from zero.mp import TPGPT, MPContext
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
        counter = CommCounter()
        tp = TPGPT.build(cfg, MPContext.of(g.mp_group, counter=counter), seed=None)
        idx = torch.zeros((2, 16), dtype=torch.long)
        tp(idx, idx)[1].backward()
        out["counts"] = counter.counts(kind="mp")
    dist.destroy_process_group()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
try:
    Mesh(dp=2, mp=2).groups()
except ValueError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def test_a_simulated_4x2_mesh_on_the_fake_process_group():
    done = subprocess.run(
        [sys.executable, "-c", FAKE_MESH], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    mp_groups = [[0, 1], [2, 3], [4, 5], [6, 7]]  # written by hand
    dp_groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    for rank in range(8):
        d, m = rank // 2, rank % 2
        assert got[str(rank)] == [d, m, mp_groups[d], dp_groups[m]]
    layers = 2  # docs/design.md §6: 2L + 1 sums forward, 2L + 1 backward, 2 sums + 1 max (xent)
    assert got["counts"] == {"all_gather": 2 * (2 * layers + 1) + 2, "all_reduce": 1}
    assert got["error"].startswith("world size=8 is not allowed: expected dp·mp = 2·2 = 4")
