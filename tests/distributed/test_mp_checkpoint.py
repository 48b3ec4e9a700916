"""Checkpoints of a model-parallel engine (zero/checkpoint/mpformat.py, mpjoin.py): gloo ranks.

A run at (N_d, N_m) = (2, 2), stage 3, saves after k = 2 steps on all 4 ranks. Its *whole
state* is gather_state() on every slice joined by zero.mp.join_states (the plain GPT's fp32
master and optimizer states by name), taken independently of the checkpoint code. Then:
  - loaded at (1, 2) stage 0, (2, 1) stage 1, (1, 4) stage 2 and into a plain engine (N = 1), the
    loaded whole state has the saved one's bits (the TP splits are exact slices), as do t, the
    data step and each parameter's step count;
  - resumed at (2, 2) stage 3 and at (1, 2) stage 0 (the same N_m: bitwise across N_d and
    stages, docs/design.md §6) and run one step, the whole state and the loss have the bits of
    an uninterrupted run of k + 1 steps that never saved;
  - a plain engine's checkpoint loads into an MP engine (the plain engine above saves again);
  - `python -m zero.checkpoint consolidate` gives a state dict that loads with strict=True into
    the plain GPT and equals the whole state bit for bit, optimizer states included;
  - a planted join in the wrong order (slices reversed) fails both the load and the
    consolidation checks; bad input and tampered manifests are refused by name.
Across N_m the continued run is not bitwise (row-parallel sums differ), so only the loaded
state is compared there. Legend: N_d, N_m, (d, m), M micro-batches per step, k saved steps.
"""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from verify.mp.resume import (
    CFG,
    CHUNK,
    K,
    M,
    bits_equal,
    engine_at,
    load_and_continue,
    save_then_uninterrupted,
    train,
)
from zero.ranks.local import get_pool

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The (2, 2) stage-3 fp32 run: root, saved whole state, the uninterrupted K + 1 state,
    its last loss and t."""
    root = tmp_path_factory.mktemp("mp_ckpt") / "ckpt"
    (out, *_) = get_pool(4).run(save_then_uninterrupted, 2, 2, 3, "fp32", str(root))
    return (root, *out)


def test_the_saved_state_is_a_trained_one(saved):
    """The fixture's states differ (so the equalities below could fail) and are finite."""
    _, state, after, _, t = saved
    assert t == K + 1 and not bits_equal(state, after)
    assert all(np.isfinite(v).all() for per in state.values() for v in per.values())
    assert {"exp_avg", "exp_avg_sq"} <= set(state["transformer.wte.weight"])


@pytest.mark.parametrize(
    "dp,mp,stage", [(1, 2, 0), (2, 1, 1), (1, 4, 2)], ids=["1x2-s0", "2x1-s1", "1x4-s2"]
)
def test_loaded_at_another_mesh_is_the_saved_state_bitwise(saved, dp, mp, stage):
    """Slices joined and cut for another (N_d', N_m') (stage too): every master and optimizer
    state comes back with the saved bits; at (1, 2), the same N_m, the next step is the
    uninterrupted run's (whole state and loss)."""
    root, state, after, loss, _ = saved
    loaded, meta, nxt, nxt_loss = get_pool(dp * mp).run(
        load_and_continue, dp, mp, stage, "fp32", str(root)
    )[0]
    assert bits_equal(loaded, state)
    assert meta == (K, K, [K], 2, K)  # t, data step, every t_p, N_m saved at, engine t
    if mp == 2:
        assert bits_equal(nxt, after) and nxt_loss == loss


def test_resume_at_the_same_mesh_continues_the_uninterrupted_run(saved):
    root, state, after, loss, _ = saved
    loaded, _, nxt, nxt_loss = get_pool(4).run(load_and_continue, 2, 2, 3, "fp32", str(root))[0]
    assert bits_equal(loaded, state) and bits_equal(nxt, after) and nxt_loss == loss


def test_plain_and_model_parallel_checkpoints_load_into_each_other(saved, tmp_path):
    """(2, 2) -> a plain GPT engine at N = 1 (state bitwise), which saves a plain checkpoint;
    that one -> an MP engine at (1, 2): the same bits again."""
    root, state, *_ = saved
    plain_root = tmp_path / "plain"
    loaded, *_ = get_pool(1).run(
        load_and_continue,
        1,
        1,
        1,
        "fp32",
        str(root),
        (("plain", True), ("resave", str(plain_root))),
    )[0]
    assert bits_equal(loaded, state)
    m = json.loads((plain_root / (plain_root / "latest").read_text().strip() / "manifest.json")
                   .read_text())  # fmt: skip
    assert "mp" not in m and m["format_version"] == 2
    loaded, meta, *_ = get_pool(2).run(load_and_continue, 1, 2, 0, "fp32", str(plain_root))[0]
    assert bits_equal(loaded, state) and meta[3] == 1


def test_a_join_in_the_wrong_order_is_caught(saved):
    """The planted join (slices reversed) at (2, 1): the loaded state differs from the saved."""
    root, state, *_ = saved
    loaded, *_ = get_pool(2).run(load_and_continue, 2, 1, 1, "fp32", str(root), (("plant", True),))[
        0
    ]
    assert not bits_equal(loaded, state)


def test_a_plain_checkpoint_cut_wrong_on_load_is_caught_by_its_row_alone(saved, tmp_path):
    """verify's "plain 2 -> 1x2" row (verify/cells/interactions.py: MP × a plain checkpoint) with
    the
    loader cutting QKV as plain rows: the loaded state differs from the plain run's. The (2, 2)
    checkpoint at (1, 2), the same N_m, is read directly and still loads with the saved bits."""
    from verify.mp.resume import PLAIN_STAGE, save_plain

    root, state, *_ = saved
    plant = (("plant", "qkv_cut_as_rows"),)
    loaded, *_ = get_pool(2).run(load_and_continue, 1, 2, 0, "fp32", str(root), plant)[0]
    assert bits_equal(loaded, state)
    plain_root = tmp_path / "plain"
    plain = get_pool(2).run(save_plain, PLAIN_STAGE, "fp32", str(plain_root))[0]
    loaded, *_ = get_pool(2).run(load_and_continue, 1, 2, 0, "fp32", str(plain_root))[0]
    assert bits_equal(loaded, plain)
    loaded, *_ = get_pool(2).run(load_and_continue, 1, 2, 0, "fp32", str(plain_root), plant)[0]
    assert not bits_equal(loaded, plain)


def _consolidated_state(root, tmp_path) -> tuple[dict, object]:
    """`python -m zero.checkpoint consolidate` (its main, in this process), loaded with
    strict=True into the plain GPT; returns (whole state as _whole gives it, the model)."""
    from zero import checkpoint
    from zero.workloads.models import GPT, GPTConfig

    out = tmp_path / "model.pt"
    assert checkpoint.main(["consolidate", str(root), str(out)]) == 0
    ck = torch.load(out)
    model = GPT(GPTConfig(**CFG), seed=0)
    model.load_state_dict(ck["model"], strict=True)
    names = [n for group in ck["param_names"] for n in group]
    whole = {n: {"master": p.detach().numpy().copy()} for n, p in model.named_parameters()}
    for i, per in ck["optimizer"]["state"].items():
        whole[names[i]].update({k: v.numpy() for k, v in per.items() if k != "step"})
    return whole, ck


def test_consolidation_joins_the_slices_into_the_plain_gpt(saved, tmp_path):
    root, state, *_ = saved
    whole, ck = _consolidated_state(root, tmp_path)
    assert bits_equal(whole, state)
    assert ck["meta"]["mp"] == 2 and ck["meta"]["world_size"] == 2
    steps = {float(per["step"]) for per in ck["optimizer"]["state"].values()}
    assert steps == {float(K)}


def test_consolidation_sees_a_join_in_the_wrong_order(saved, tmp_path, monkeypatch):
    import zero.checkpoint.mpjoin as mj

    root, state, *_ = saved
    real = mj.glue_parts
    monkeypatch.setattr(mj, "glue_parts", lambda parts, rule: real(parts[::-1], rule))
    whole, _ = _consolidated_state(root, tmp_path)
    assert not bits_equal(whole, state)


def save_on_a_full_disk(rank, world, root):
    """Worker at (2, 2): a good save, then one step and a save whose shard write fails on
    global rank 3 = (1, 1) only (ENOSPC); returns what each rank raised and what is on disk."""
    import errno
    import os

    import zero.checkpoint.format as fmt
    from zero.workloads.models import GPTConfig

    d, _, _, eng = engine_at(2, 2, 1, "fp32", seed=3)
    first = eng.save(root)
    train(eng, d, 2, GPTConfig(**CFG), 0, 1)
    real = fmt._write_all

    def full(f, chunk):
        if rank == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, chunk)

    fmt._write_all = full
    try:
        eng.save(root)
        raised = None
    except Exception as exc:  # every rank must raise
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        fmt._write_all = real
    return raised, first.name, sorted(os.listdir(root))


def test_a_save_failing_on_one_rank_of_the_mesh_leaves_the_last_checkpoint(tmp_path):
    """[Note: atomic commit] over all N_d·N_m ranks: every rank raises, naming rank 3, the failed
    step directory is gone and `latest` still names the first, complete checkpoint."""
    from zero import checkpoint

    root = tmp_path / "ckpt"
    got = get_pool(4).run(save_on_a_full_disk, str(root))
    first = got[0][1]
    assert got[3][0].startswith("OSError: [Errno 28] No space left on device"), got[3]
    for raised, _, listing in got[:3]:
        assert raised.startswith("CheckpointError: save to ") and "failed on rank 3" in raised
        assert listing == sorted([first, "latest"])
    assert (root / "latest").read_text().strip() == first
    assert checkpoint.verify(root)["mp"]["size"] == 2


def bad_input(rank, world, root):
    """Worker on 2 ranks: each refusal's message (ValueError), or 'accepted'."""
    import torch.distributed as dist

    from zero.collectives import CommCounter
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.mp import TPGPT, MPContext
    from zero.workloads.models import GPTConfig

    class NoRule(TPGPT):
        split_rule = None

    def no_rule():
        from verify.mp.cells import mesh_groups

        g = mesh_groups(1, 2)
        ctx = MPContext.of(g.mp_group, counter=CommCounter())
        model = NoRule.build(GPTConfig(**CFG), ctx, seed=3)
        z = ZeroConfig(micro_batches=M, chunk=CHUNK)
        ZeroEngine(model, z, group=g.dp_group, mp=ctx).save(root + "-norule")

    def not_the_mesh():  # the world (2 ranks) is not this 1 × 1 mesh
        singles = [dist.new_group([r]) for r in range(world)]
        ctx = MPContext.of(singles[rank], counter=CommCounter())
        model = TPGPT.build(GPTConfig(**CFG), ctx, seed=3)
        z = ZeroConfig(micro_batches=M, chunk=CHUNK)
        ZeroEngine(model, z, group=singles[rank], mp=ctx).save(root + "-mesh")

    def other_shape():  # vocabulary 128: the whole wte differs
        _, _, _, eng = engine_at(1, 2, 1, "fp32", seed=3, cfg=dict(CFG, vocab_size=128))
        eng.load(root)

    def other_names():  # three blocks: transformer.h.2.* are not in the checkpoint
        _, _, _, eng = engine_at(1, 2, 1, "fp32", seed=3, cfg=dict(CFG, n_layer=3))
        eng.load(root)

    out = {}
    for name, fn in [("no rule", no_rule), ("not the mesh", not_the_mesh),
                     ("other shape", other_shape), ("other names", other_names)]:  # fmt: skip
        try:
            fn()
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_what_cannot_be_joined_is_refused_by_name(saved):
    root, *_ = saved
    for got in get_pool(2).run(bad_input, str(root)):
        assert got["no rule"].startswith("mp: NoRule has no split_rule(name) method"), got
        assert got["not the mesh"].startswith("mp: rank "), got
        assert (
            "of a world of 2 is (d, m) = (0, 0) of an N_d × N_m = 1 × 1 mesh" in got["not the mesh"]
        )
        assert got["other shape"].startswith(
            "parameter 'transformer.wte.weight': checkpoint shape (64, 16), model shape "
            "(128, 16) (whole shapes: the checkpoint's N_m = 2 slices, the model's N_m = 2)"
        ), got
        assert got["other names"].startswith(
            "parameter 'transformer.h.2.ln_1.weight': model shape (16,), not in the checkpoint"
        ), got


def _tampered(root, tmp_path, edit) -> object:
    """A copy of the checkpoint with its manifest edited by `edit` and re-checksummed."""
    from zero.checkpoint.format import _canonical

    step = (root / (root / "latest").read_text().strip()).name
    copy = tmp_path / "copy"
    shutil.copytree(root / step, copy)
    path = copy / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    body = {k: v for k, v in m.items() if k != "checksum"}
    m["checksum"] = hashlib.sha256(_canonical(body)).hexdigest()
    path.write_text(json.dumps(m))
    return copy


def test_the_manifest_records_the_splits_and_a_tampered_one_is_refused(saved, tmp_path):
    from zero import checkpoint
    from zero.checkpoint import CheckpointError

    root, *_ = saved
    m = checkpoint.verify(root)  # every file of every slice against its sha256
    assert m["format_version"] == 3 and m["world_size"] == 2 and m["mp"]["size"] == 2
    sp = m["mp"]["splits"]
    assert sp["transformer.h.0.attn.c_attn.weight"] == {"rule": "qkv", "dim": 0, "shape": [48, 16]}
    assert sp["transformer.h.0.mlp.c_proj.weight"] == {"rule": "cols", "dim": 1, "shape": [16, 64]}
    assert sp["transformer.wte.weight"] == {"rule": "rows", "dim": 0, "shape": [64, 16]}
    assert sp["transformer.wpe.weight"] == {"rule": None, "dim": None, "shape": [8, 16]}
    files = [set(s["rng"]["files"]) for s in m["mp"]["slices"]]
    assert files == [{"m0000-r0000.bin", "m0000-r0001.bin"}, {"m0001-r0000.bin", "m0001-r0001.bin"}]

    def wrong_dim(m):
        m["mp"]["splits"]["transformer.h.0.attn.c_attn.weight"]["dim"] = 1

    def wrong_slice_shape(m):
        m["mp"]["slices"][1]["params"][0]["shape"] = [64, 16]

    def uncuttable(m):
        m["mp"]["splits"]["transformer.h.0.attn.c_attn.weight"]["shape"] = [50, 16]

    def shared_file(m):
        m["mp"]["slices"][1]["rng"]["files"] = m["mp"]["slices"][0]["rng"]["files"]

    for edit, want in [
        (wrong_dim, r"mp.splits\['transformer.h.0.attn.c_attn.weight'\]: rule 'qkv', dim 1"),
        (
            wrong_slice_shape,
            r"mp.slices\[1\]\.params\[1\] \('transformer.wpe.weight'\): offset 512",
        ),
        (uncuttable, r"shape \(50, 16\) cannot be cut in 2 by rule 'qkv'"),
        (shared_file, r"mp.slices\[1\]: file 'm0000-r0000.bin' is also slice 0's"),
    ]:
        with pytest.raises(CheckpointError, match=want):
            checkpoint.verify(_tampered(root, tmp_path / edit.__name__, edit))


@pytest.mark.full
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bf16_and_other_meshes_full(precision, tmp_path):
    """Release tier: save at (2, 2) stage 2 in each precision; load at (4, 1) stage 3, (1, 4)
    stage 0, (2, 2) stage 1 (continuing bitwise) and into a plain engine at N = 2."""
    root = tmp_path / "ckpt"
    ((state, after, loss, _),) = [
        get_pool(4).run(save_then_uninterrupted, 2, 2, 2, precision, str(root))[0]
    ]
    for dp, mp, stage, plain in [(4, 1, 3, False), (1, 4, 0, False), (2, 2, 1, False),
                                 (2, 1, 0, True)]:  # fmt: skip
        loaded, meta, nxt, nxt_loss = get_pool(dp * mp).run(
            load_and_continue, dp, mp, stage, precision, str(root), (("plain", plain),)
        )[0]
        assert bits_equal(loaded, state), (dp, mp, stage, plain)
        if mp == 2 and not plain:
            assert bits_equal(nxt, after) and nxt_loss == loss
