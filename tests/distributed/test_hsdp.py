"""Hierarchical sharding (ZeroConfig.shard_group_size, zero/stages/hsdp.py) on real gloo ranks:
the bits of plain ZeRO at the same N, the traffic of the shard group and of the replicas derived
here by hand from N, G and the units' layouts, the model states at 1/G, and the refusals.

Legend: N ranks, G ranks per shard group, K = N/G replicas, k = M/N micro-steps per rank,
C = 128-element chunks. The MLP 16 -> 48 -> 48 -> 4 of engine_tools.mlp_engine has units of 3
(the root, layers.2), 7 (layers.0) and 19 (layers.1) chunks (test_node_traffic.py derives them
from the shapes); at a world of G a unit's shard is L_u = ceil(chunks / G)·C.
"""

from __future__ import annotations

import math

import pytest
from engine_tools import mlp_engine, on_half_the_world, one_step

from reference.optim import Hyper
from verify.checks.sides import state_digest
from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(300)

CHUNKS = (3, 7, 19)  # the root's, layers.0's and layers.1's 128-element chunks
BYTES = {"fp32": 4, "bf16": 2}
CELLS = (  # (stage, precision, optimizer, k, further fields): every stage, dtype, optimizer, k
    (1, "bf16", "adam", 2, {}),
    (1, "fp32", "adamw", 1, {}),
    (2, "fp32", "sgd", 1, {}),
    (2, "bf16", "adam", 2, {"bucket_elements": 256}),  # C_B pieces, then the replicas
    (3, "bf16", "adamw", 2, {}),
    (3, "fp32", "adam", 1, {"persist_below": 200}),  # the root persistent: stage 0's path
)


COMMON = {"groups": (Hyper(weight_decay=0.1, momentum=0.9),), "clip_norm": 0.05}
"""Decay (so adam and adamw differ), momentum (so sgd keeps a state), and clipping that acts."""


def shards(g: int) -> list[int]:
    """L_u of every unit at a world of g."""
    return [math.ceil(c / g) * 128 for c in CHUNKS]


def digests(rank, n, g, cells, deterministic=True, steps=2):
    """Each cell's state digest after `steps` steps, with shard_group_size g (None: plain)."""
    out = []
    for stage, precision, optimizer, k, kw in cells:
        model, eng = mlp_engine(
            stage,
            n,
            k,
            deterministic,
            precision,
            optimizer=optimizer,
            shard_group_size=g,
            **COMMON,
            **kw,
        )
        for step in range(steps):
            result = one_step(eng, model, rank, n, k, step)
        out.append(state_digest(eng, result))
    return out


# N = 8 in the release tier (`full`): make test keeps (4, 2) here and verify's quick cells at
# N = 8, G = 4 (tests/distributed/test_verify_cli.py), within its 15-minute budget
@pytest.mark.dist
@pytest.mark.parametrize(
    "n, g",
    [
        (4, 2),
        pytest.param(8, 2, marks=pytest.mark.full),
        pytest.param(8, 4, marks=pytest.mark.full),
    ],
)
def test_hsdp_is_bitwise_plain_zero_at_the_same_n(n, g):
    """Deterministic: T over N ranks = T over the K groups of T over G ([Note: the sum over
    replicas]), so every rank ends every cell with plain ZeRO's digest at N."""
    pool = get_pool(n)
    plain = pool.run(digests, None, CELLS)
    ours = pool.run(digests, g, CELLS)
    assert ours == plain
    assert all(len(set(col)) == 1 for col in zip(*ours, strict=True))  # every rank the same
    # the cells' numerics differ (the stage changes no bit): a digest is not a constant
    assert len(set(plain[0])) == len({cell[1:4] for cell in CELLS}) == 5


@pytest.mark.dist
def test_fast_mode_at_two_replicas_is_plain_fast_mode():
    """Fast mode on gloo reduce-scatters with the tree as well ([Note: fast reduce-scatter on
    gloo]); the sum of K = 2 partials is one addition, which commutes, so at N = 4, G = 2 fast
    HSDP gives plain fast mode's bits (stage 1 accumulates locally: one reduction a step)."""
    cells = [c for c in CELLS if not c[4]]
    pool = get_pool(4)
    assert pool.run(digests, 2, cells, False) == pool.run(digests, None, cells, False)


def traffic(rank, n, g, stage, deterministic, per_node):
    """One step at k = 2, bf16 (gradients summed in fp32): per (op, phase) of model traffic,
    (calls, elements, bytes), and the step's (intra, inter) bytes per link; and memory_report."""
    model, eng = mlp_engine(
        stage, n, 2, deterministic, "bf16", shard_group_size=g, ranks_per_node=per_node
    )
    one_step(eng, model, rank, n, 2)
    sent: dict = {}
    for r in eng.counter.of_step(0):
        row = sent.setdefault((r.op, r.phase), [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + r.elements, row[2] + r.nbytes
    return {k: tuple(v) for k, v in sent.items()}, eng.counter.link_volume(0), eng.memory_report()


def expected(n, g, stage, deterministic):
    """What one rank sends in one step at k = 2 (ΣL over the units at a world of G):
    reduce-scatter in the group, k per unit, (G-1)·L_u; the replicas' sum, k per unit, (K-1)·L_u
    gathered (deterministic) or once per unit with 2(K-1)·L_u/K (fast, stage 2-3 every micro-step,
    stage 1 once); stage 1-2 the updated parameters' all-gather (G-1)·L_u; stage 3 a forward and
    a backward gather per micro-step, (G-1)·L_u, the root's forward only (it stays gathered
    from its forward to the end of backward)."""
    k, kk, ls = 2, n // g, shards(g)
    per = 1 if stage == 1 and not deterministic else k  # reductions per unit and step
    out = {("reduce_scatter", "grad"): (per * 3, per * sum((g - 1) * x for x in ls))}
    if deterministic:
        out["all_gather", "grad_replicas"] = (k * 3, k * sum((kk - 1) * x for x in ls))
    else:
        out["all_reduce", "grad_replicas"] = (
            per * 3,
            per * sum(2 * (kk - 1) * (x // kk) for x in ls),
        )
    if stage < 3:
        out["all_gather", "param_update"] = (3, sum((g - 1) * x for x in ls))
    else:
        units = ls[1:]
        out["all_gather", "param_fwd"] = (k * 3, k * (g - 1) * sum(ls))
        out["all_gather", "param_bwd"] = (k * 2, k * (g - 1) * sum(units))
    size = {"grad": 4, "grad_replicas": 4}  # fp32 gradients, bf16 parameters
    return {key: (c, el, size.get(key[1], 2) * el) for key, (c, el) in out.items()}


@pytest.mark.dist
@pytest.mark.parametrize("n, g", [(4, 2), (8, 4)])
def test_traffic_in_the_group_and_across_replicas_is_the_derived_volume(n, g):
    """Per rank and step: the volumes of `expected`, by hand above; with one shard group per
    node (ranks_per_node = G) the group's collectives stay inside the node and only the
    replicas' sum crosses nodes. The states are those of a world of G: ΣL_u fp32 elements of
    master, two of Adam's states, and at stage 3 ΣL_u bf16 working parameters."""
    assert (n, g, sum(shards(g))) in ((4, 2, 2048), (8, 4, 1024))  # 16 and 8 chunks of 128
    pool = get_pool(n)
    for stage, det in ((1, True), (2, True), (3, True), (1, False), (3, False)):
        got = pool.run(traffic, g, stage, det, g)
        want = expected(n, g, stage, det)
        replicas = next(v[2] for key, v in want.items() if key[1] == "grad_replicas")
        inside = sum(v[2] for key, v in want.items() if key[1] != "grad_replicas")
        for rank, (sent, links, memory) in enumerate(got):
            assert sent == want, (stage, det, rank)
            assert links == (inside, replicas), (stage, det, rank)
            states = 4 * sum(shards(g))
            assert memory["master"] == states and memory["optimizer"] == 2 * states
            if stage == 3:
                assert memory["params"] == states // 2


def wrong_world(rank, n, g, deterministic=True):
    """The message an engine at world n with shard_group_size g refuses with ("" if built)."""
    try:
        mlp_engine(2, n, 1, deterministic, shard_group_size=g)
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.dist
def test_a_group_size_that_does_not_divide_n_is_refused_by_name():
    got = get_pool(4).run(wrong_world, 3, False)
    for msg in got:
        assert msg.startswith("shard_group_size=3: must divide the world size N = 4"), msg
        assert "allowed here: [1, 2, 4] or None" in msg
    got = get_pool(4).run(wrong_world, 8)
    assert all("allowed here: [1, 2, 4] or None" in m for m in got)


# -- checkpoints: [Note: HSDP checkpoints] in zero/checkpoint/commit.py ----------------------------


def leg(rank, n, stage, g, steps, save_to=None, load_from=None, fmt="native"):
    """verify's resume numerics (verify/checkpoints/resume.py: groups, clipping, M = 4, bf16
    AdamW) at (n, stage, shard_group_size g): load (into a model of other start values), train
    `steps`, save. Rank 0 returns state_of() and, after a save, the manifest (native format)."""
    import dataclasses

    from verify.checkpoints.resume import ResumeCase, microbatches, state_of
    from zero.checkpoint import load_dcp, read_manifest, resolve, save_dcp
    from zero.engine import ZeroEngine
    from zero.loop import train_steps
    from zero.workloads.models import init_parameters

    case = ResumeCase(n1=n, s1=stage, n2=n, s2=stage)
    model = case.make_model()
    if load_from is not None:
        init_parameters(model, 1)
    cfg = case.engine_config(stage, model.unit_names())
    eng = ZeroEngine(model, dataclasses.replace(cfg, shard_group_size=g))
    if load_from is not None:
        eng.load(load_from) if fmt == "native" else load_dcp(eng, load_from)
    train_steps(eng, microbatches(case, model), steps, start_step=eng.data_step)
    manifest = None
    if save_to is not None and fmt == "native":
        manifest = read_manifest(resolve(eng.save(save_to)))
    elif save_to is not None:
        save_dcp(eng, save_to)
    state = state_of(eng)  # gathered: every rank takes part
    return (state, manifest) if rank == 0 else None


@pytest.mark.dist
def test_checkpoints_reshard_between_hsdp_and_plain_bitwise(tmp_path):
    """(N=4, G=2, stage 3) 2 steps -> save -> (N=2, plain, stage 1) 1 step -> save -> (N=4,
    G=1, stage 2) 1 step: the bits of 4 uninterrupted plain steps (N=4, stage 3). The HSDP
    manifest records N and G, and only the first group wrote unit files: G per unit."""
    from verify.checkpoints.resume import compare_states

    four, two = get_pool(4), get_pool(2)
    whole = four.run(leg, 3, None, 4)[0][0]
    a, b = tmp_path / "a", tmp_path / "b"
    saved = four.run(leg, 3, 2, 2, str(a))[0][1]
    assert (saved["world_size"], saved["shard_group_size"]) == (4, 2)
    assert all(len(u["files"]) == 2 for u in saved["units"]) and len(saved["rng"]["files"]) == 4
    assert sorted(p.name for p in (a / saved["name"]).glob("u*-r*.bin")) == sorted(
        f for u in saved["units"] for f in u["files"]
    )
    from zero import checkpoint

    assert checkpoint.verify(a)["shard_group_size"] == 2  # every file against its checksum
    two.run(leg, 1, None, 1, str(b), str(a))
    state = four.run(leg, 2, 1, 1, None, str(b))[0][0]
    assert compare_states(state, whole) == ""
    moved = four.run(leg, 2, 2, 2, None, str(a))[0][0]  # HSDP into HSDP: G and stage change
    assert compare_states(moved, whole) == ""
    assert compare_states(four.run(leg, 3, None, 3)[0][0], whole) != ""  # a step short differs


@pytest.mark.dist
def test_dcp_round_trip_between_hsdp_and_plain_bitwise(tmp_path):
    """save_dcp at (N=4, G=2, stage 2) after 2 steps (the first group writes each chunk once),
    load_dcp at (N=2, plain, stage 3) and at (N=4, G=2, stage 3), 2 more steps: the
    uninterrupted plain run's bits."""
    from verify.checkpoints.resume import compare_states

    four, two = get_pool(4), get_pool(2)
    whole = two.run(leg, 3, None, 4)[0][0]
    four.run(leg, 2, 2, 2, str(tmp_path / "d"), None, "dcp")
    state = two.run(leg, 3, None, 2, None, str(tmp_path / "d"), "dcp")[0][0]
    assert compare_states(state, whole) == ""
    state = four.run(leg, 3, 2, 2, None, str(tmp_path / "d"), "dcp")[0][0]  # into HSDP too
    assert compare_states(state, whole) == ""


def test_hsdp_with_model_parallelism_is_refused_by_name():
    """Refused before any collective: a mesh's data-parallel group is not sharded in groups."""
    from zero.config import ZeroConfig
    from zero.stages import hsdp

    cfg = ZeroConfig(stage=2, micro_batches=4, shard_group_size=2)
    with pytest.raises(ValueError, match=r"^shard_group_size=2 with model parallelism \(mp=\)"):
        hsdp.check(cfg, 4, mp=object())


@pytest.mark.dist
def test_hsdp_over_a_subgroup_is_refused_by_name_unless_plain():
    got = get_pool(4).run(on_half_the_world, {"stage": 2, "shard_group_size": 1})
    for msg in got:
        assert msg.startswith("shard_group_size=1: the engine's group has 2 of the world's 4"), msg
    assert (
        get_pool(4).run(on_half_the_world, {"stage": 2, "shard_group_size": 2}) == [""] * 4
    )  # G = N of its group: plain ZeRO


def overflow(rank, n, g):
    """Two injected steps at stage 2, bf16; in the first, one element of rank 3's gradient is
    inf: which steps each rank skipped, and its digest."""
    import torch

    model, eng = mlp_engine(2, n, 1, precision="bf16", shard_group_size=g, nonfinite="skip")
    skipped = []
    for step in range(2):
        grads = {
            name: torch.full(p.shape, 0.01 * (rank + 1 + step), dtype=p.dtype)
            for name, p in model.named_parameters()
        }
        if step == 0 and rank == 3:
            grads["layers.1.weight"][0, 0] = float("inf")
        eng.inject_gradients(grads)
        result = eng.step()
        skipped.append(result.skipped)
    return skipped, state_digest(eng, result)


@pytest.mark.dist
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    """The overflow decision stays the world's: rank 3 (group 1) alone sees the inf, and every
    rank of both groups skips the first step, then ends as plain ZeRO does."""
    pool = get_pool(4)
    ours, plain = pool.run(overflow, 2), pool.run(overflow, None)
    assert [s for s, _ in ours] == [[True, False]] * 4
    assert ours == plain
