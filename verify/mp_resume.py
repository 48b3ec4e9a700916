"""verify's model-parallel checkpoint rows: save at (N_d, N_m), load at another mesh, resume.

A run at (N_d, N_m) = (2, 2), stage 3, fp32, saves after K = 2 steps on all 4 ranks
(zero/checkpoint/mpformat.py). The expected side never reads the checkpoint: it is the saving
run's *whole state*, gather_state() on every slice joined by zero.mp.join_states (the plain
GPT's fp32 master and optimizer states by name), and an uninterrupted run of K + 1 steps that
never saves. Rows (in `python -m verify --resume` when its world sizes include 1, 2 and 4):
  - (2, 2) stage 3 -> (1, 2) stage 0: the loaded whole state bitwise, then one step whose whole
    state and loss are the uninterrupted run's bits (the same N_m: docs/design.md §6);
  - (2, 2) stage 3 -> (2, 1) stage 1: the slices joined and cut for N_m = 1, bitwise;
and on the first row, the consolidated checkpoint loaded strict into the plain GPT = the whole
state, bitwise. Across N_m the continued run is not bitwise (row-parallel sums), so only the
loaded state is compared there. tests/distributed/test_mp_checkpoint.py uses these workers.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

CFG = dict(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=16)  # n_head 4: N_m <= 4
BATCH, M, CHUNK, CLIP, K = 2, 4, 128, 0.05, 2
"""CLIP below the first steps' norms, so every step clips (the whole-model norm is in play)."""


def engine_at(dp, mp, stage, precision, seed, *, plain=False, cfg=CFG):
    """(this rank's DP index d, MP group or None, model, engine) at (dp, mp); plain: a GPT on
    the whole world (N = dp) without model parallelism."""
    from zero.collectives import CommCounter
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.mp import TPGPT, MPContext
    from zero.workloads.models import GPT, GPTConfig

    from .mp_cells import mesh_groups

    gcfg = GPTConfig(**cfg)
    units = tuple(f"transformer.h.{i}" for i in range(gcfg.n_layer))
    z = ZeroConfig(
        stage=stage, precision=precision, micro_batches=M, chunk=CHUNK, clip_norm=CLIP,
        units=units,
    )  # fmt: skip
    if plain:
        model = GPT(gcfg, seed=seed)
        eng = ZeroEngine(model, z)
        return eng.rank, None, model, eng
    g = mesh_groups(dp, mp)
    ctx = MPContext.of(g.mp_group, counter=CommCounter())
    model = TPGPT.build(gcfg, ctx, seed=seed)
    return g.d, g.mp_group, model, ZeroEngine(model, z, group=g.dp_group, mp=ctx)


def train(eng, d, dp, cfg, start, steps) -> list[float]:
    """Steps start .. start+steps-1; micro-batch j = i·N_d + d; returns the losses."""
    from zero.workloads.models import gpt_microbatches

    losses = []
    for step in range(start, start + steps):
        batches = gpt_microbatches(cfg, seed=1, data_step=step, count=M, batch_size=BATCH)
        for i in range(M // dp):
            _, loss = eng(*batches[i * dp + d])
            eng.backward(loss)
        losses.append(eng.step().loss)
    return losses


def whole_state(eng, mp_group, cfg) -> dict | None:
    """The plain GPT's state: gather_state() per slice, joined by zero.mp.join_states (on the
    rank of global index 0; None elsewhere). name -> {"master": array, key: array, ...}."""
    import torch.distributed as dist

    from zero.mp import join_states

    master, opt = eng.gather_state()
    if mp_group is not None:
        every = [None] * dist.get_world_size(mp_group)
        dist.all_gather_object(every, (master, opt), group=mp_group)
        master = join_states([s for s, _ in every], cfg)
        keys = {k for per in every[0][1].values() for k in per}
        joined = {k: join_states([{n: o[n][k] for n in o if k in o[n]} for _, o in every], cfg)
                  for k in keys}  # fmt: skip
        opt = {n: {k: joined[k][n] for k in keys if n in joined[k]} for n in master}
    if dist.get_rank() != 0:
        return None
    out = {n: {"master": v.numpy().copy()} for n, v in master.items()}
    for n, per in opt.items():
        out[n].update({k: v.numpy().copy() for k, v in per.items()})
    return out


def save_then_uninterrupted(rank, world, dp, mp, stage, precision, root):
    """Worker: K steps, save, the whole state; then a fresh run of K + 1 steps never saving:
    its whole state and last loss (rank 0's)."""
    from zero.workloads.models import GPTConfig

    cfg = GPTConfig(**CFG)
    d, group, _, eng = engine_at(dp, mp, stage, precision, seed=3)
    train(eng, d, dp, cfg, 0, K)
    eng.save(root)
    saved = whole_state(eng, group, cfg)
    d, group, _, eng = engine_at(dp, mp, stage, precision, seed=3)
    losses = train(eng, d, dp, cfg, 0, K + 1)
    return saved, whole_state(eng, group, cfg), losses[-1], eng.t


def _plant_reversed_join():
    """The join with the slices in reverse m order; returns the undo (pools are long-lived)."""
    import zero.checkpoint.mpjoin as mj

    real = mj.glue_parts
    mj.glue_parts = lambda parts, rule: real(parts[::-1], rule)
    return lambda: setattr(mj, "glue_parts", real)


def load_and_continue(rank, world, dp, mp, stage, precision, root, opts=()):
    """Worker: an engine from another seed loads root; the whole state, (t, data step, step
    counts, N_m) of the info, then one more step's whole state and loss. opts (pairs): plain (a
    GPT engine, no MP), plant (the reversed join), resave (a directory to save to after loading)."""
    from zero.workloads.models import GPTConfig

    opts = dict(opts)
    plain, plant, resave = opts.get("plain", False), opts.get("plant", False), opts.get("resave")

    undo = _plant_reversed_join() if plant else None
    try:
        cfg = GPTConfig(**CFG)
        d, group, _, eng = engine_at(dp, mp, stage, precision, seed=11, plain=plain)
        info = eng.load(root)
        loaded = whole_state(eng, group, cfg)
        if resave:
            eng.save(resave)
        meta = (info.t, info.data_step, sorted(set(info.steps.values())), info.mp, eng.t)
        losses = train(eng, d, dp, cfg, info.data_step, 1)
        return loaded, meta, whole_state(eng, group, cfg), losses[-1]
    finally:
        if undo:
            undo()


def bits_equal(a: dict, b: dict) -> bool:
    """Every array of two whole states (same names, same keys) has the same float32 bits."""
    if a.keys() != b.keys():
        return False
    return all(
        a[n].keys() == b[n].keys()
        and all(
            a[n][k].shape == b[n][k].shape
            and np.array_equal(a[n][k].view(np.uint32), b[n][k].view(np.uint32))
            for k in a[n]
        )
        for n in a
    )


def consolidated_whole(root) -> dict:
    """zero.checkpoint.consolidate(root) loaded with strict=True into the plain GPT, as a
    whole state (the optimizer's "step" aside)."""
    from zero.checkpoint import consolidate
    from zero.workloads.models import GPT, GPTConfig

    ck = consolidate(root)
    model = GPT(GPTConfig(**CFG), seed=0)
    model.load_state_dict(ck["model"], strict=True)
    names = [n for group in ck["param_names"] for n in group]
    out = {n: {"master": p.detach().numpy().copy()} for n, p in model.named_parameters()}
    for i, per in ck["optimizer"]["state"].items():
        out[names[i]].update({k: v.numpy() for k, v in per.items() if k != "step"})
    return out


LOADS = ((1, 2, 0), (2, 1, 1))
"""(N_d', N_m', stage) the (2, 2) stage-3 checkpoint is loaded at."""


def mp_rows(*, timeout_s: float = 600) -> list[dict]:
    """The rows (see the module docstring), in the resume table's row format."""
    from zero.ranks.launch import under_torchrun
    from zero.ranks.local import get_pool

    if under_torchrun():
        return []
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero-mp-resume-") as tmp:
        root = Path(tmp) / "ckpt"
        started = time.perf_counter()
        saved, after, loss, _ = get_pool(4).run(
            save_then_uninterrupted, 2, 2, 3, "fp32", str(root), timeout_s=timeout_s
        )[0]
        for i, (dp, mp, stage) in enumerate(LOADS):
            loaded, meta, nxt, nxt_loss = get_pool(dp * mp).run(
                load_and_continue, dp, mp, stage, "fp32", str(root), timeout_s=timeout_s
            )[0]
            first = "" if bits_equal(loaded, saved) else "loaded state != saved whole state"
            if not first and meta != (K, K, [K], 2, K):
                first = f"(t, data step, t_p, N_m, engine t) = {meta}, expected K = {K}"
            if not first and mp == 2 and not (bits_equal(nxt, after) and nxt_loss == loss):
                first = "the resumed step != the uninterrupted run's"
            plain = None
            if i == 0:
                plain = {"state_bitwise": bits_equal(consolidated_whole(root), saved)}
                if not first and not plain["state_bitwise"]:
                    first = "consolidated state != saved whole state"
            rows.append({
                "from_world_size": "2x2", "from_stage": 3, "to_world_size": f"{dp}x{mp}",
                "to_stage": stage, "precision": "fp32", "optimizer": "adamw",
                "mode": "deterministic", "bitwise": not first, "passed": not first,
                "first_mismatch": first, "consolidated": plain,
                "seconds": round(time.perf_counter() - started, 2),
                "config": {"mesh": [2, 2], "to": [dp, mp], "stage": [3, stage], "model": CFG},
            })  # fmt: skip
            started = time.perf_counter()
    return rows
