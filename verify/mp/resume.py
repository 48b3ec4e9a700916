"""verify's model-parallel checkpoint rows: save at (N_d, N_m), load at another mesh, resume.

A run at (N_d, N_m) = (2, 2), stage 3, fp32, saves after K = 2 steps on all 4 ranks
(zero/checkpoint/mpformat.py). The expected side never reads the checkpoint: it is the saving
run's *whole state*, gather_state() on every slice joined by verify.mp.cells.join (the plain
GPT's fp32 master and optimizer states by name; docs/design.md §6.1's split rule stated again
in verify, not zero.mp's glue, which the loader under test uses), and an uninterrupted run of
K + 1 steps that never saves. Rows (in `python -m verify --resume` when its world sizes include
1, 2 and 4):
  - (2, 2) stage 3 -> (1, 2) stage 0: the loaded whole state bitwise, then one step whose whole
    state and loss are the uninterrupted run's bits (the same N_m: docs/design.md §6);
  - (2, 2) stage 3 -> (2, 1) stage 1: the slices joined and cut for N_m = 1, bitwise;
  - (2, 2) stage 3 -> a plain GPT engine at N = 2, stage 1: the slices joined, bitwise;
  - a plain GPT engine's checkpoint (N = 2, stage 2) -> (1, 2) stage 0: the plain state cut
    into slices on load, bitwise against the plain run's state (verify/cells/interactions.py's
    "MP × plain checkpoint");
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

    from .cells import mesh_groups

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


def whole_state(eng, mp_group) -> dict | None:
    """The plain GPT's state: gather_state() per slice, joined by verify.mp.cells.join (on the
    rank of global index 0; None elsewhere). name -> {"master": array, key: array, ...}."""
    import torch.distributed as dist

    from .cells import join, split_of

    master, opt = eng.gather_state()
    mine = {n: {"master": v.numpy().copy()} for n, v in master.items()}
    for n, per in opt.items():
        mine[n].update({k: v.numpy().copy() for k, v in per.items()})
    every = [mine]
    if mp_group is not None:
        every = [None] * dist.get_world_size(mp_group)
        dist.all_gather_object(every, mine, group=mp_group)
    if dist.get_rank() != 0:
        return None
    return {
        n: {k: join([s[n][k] for s in every], split_of(n), n) for k in per}
        for n, per in mine.items()
    }


def save_then_uninterrupted(rank, world, dp, mp, stage, precision, root):
    """Worker: K steps, save, the whole state; then a fresh run of K + 1 steps never saving:
    its whole state and last loss (rank 0's)."""
    from zero.workloads.models import GPTConfig

    cfg = GPTConfig(**CFG)
    d, group, _, eng = engine_at(dp, mp, stage, precision, seed=3)
    train(eng, d, dp, cfg, 0, K)
    eng.save(root)
    saved = whole_state(eng, group)
    d, group, _, eng = engine_at(dp, mp, stage, precision, seed=3)
    losses = train(eng, d, dp, cfg, 0, K + 1)
    return saved, whole_state(eng, group), losses[-1], eng.t


def _plant_reversed_join():
    """The join with the slices in reverse m order; returns the undo (pools are long-lived)."""
    import zero.checkpoint.mpjoin as mj

    real = mj.glue_parts
    mj.glue_parts = lambda parts, rule: real(parts[::-1], rule)
    return lambda: setattr(mj, "glue_parts", real)


def _plant_qkv_cut_as_rows():
    """The loader cutting a fused QKV matrix as plain rows (one block, not each third): only
    where a parameter is cut on load (a plain checkpoint into an MP engine, or another N_m),
    never on a direct read at the same N_m. Returns the undo."""
    import zero.checkpoint.mpjoin as mj

    real = mj.cut_part
    mj.cut_part = lambda t, rule, m, n: real(t, "rows" if rule == "qkv" else rule, m, n)
    return lambda: setattr(mj, "cut_part", real)


def load_and_continue(rank, world, dp, mp, stage, precision, root, opts=()):
    """Worker: an engine from another seed loads root; the whole state, (t, data step, step
    counts, N_m) of the info, then one more step's whole state and loss. opts (pairs): plain (a
    GPT engine, no MP), plant (True: the reversed join; "qkv_cut_as_rows"), resave (a directory to
    save to after loading)."""
    from zero.workloads.models import GPTConfig

    opts = dict(opts)
    plain, plant, resave = opts.get("plain", False), opts.get("plant", False), opts.get("resave")

    plants = {True: _plant_reversed_join, "qkv_cut_as_rows": _plant_qkv_cut_as_rows}
    undo = plants[plant]() if plant else None
    try:
        cfg = GPTConfig(**CFG)
        d, group, _, eng = engine_at(dp, mp, stage, precision, seed=11, plain=plain)
        info = eng.load(root)
        loaded = whole_state(eng, group)
        if resave:
            eng.save(resave)
        meta = (info.t, info.data_step, sorted(set(info.steps.values())), info.mp, eng.t)
        losses = train(eng, d, dp, cfg, info.data_step, 1)
        return loaded, meta, whole_state(eng, group), losses[-1]
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
PLAIN_STAGE, PLAIN_LOAD = 2, (1, 2, 0)
"""The plain checkpoint's stage (N = 2), and the (N_d', N_m', stage) it is loaded at."""


def row_names() -> list[str]:
    """The rows' names, in order (verify --list; verify/cells/interactions.py's predicates)."""
    d, m, _ = PLAIN_LOAD
    return [f"2x2 -> {dp}x{mp}" for dp, mp, _ in LOADS] + ["2x2 -> plain 2", f"plain 2 -> {d}x{m}"]


def save_plain(rank, world, stage, precision, root):
    """Worker: a plain GPT engine (N = world) trains K steps and saves; its whole state."""
    from zero.workloads.models import GPTConfig

    d, _, _, eng = engine_at(world, 1, stage, precision, seed=3, plain=True)
    train(eng, d, world, GPTConfig(**CFG), 0, K)
    eng.save(root)
    return whole_state(eng, None)


def failed_rows(failed: dict) -> list[dict]:
    """The rows of mp_rows when it raised (verify.checks.report.guarded's failing row, named "mp
    resume"): one failing row per row_names() entry, each naming its meshes and the error."""
    return [
        mesh_row(name, stage, f"raised {failed['error']}", None, time.perf_counter())
        | failed
        | {"name": f"mp resume {name}"}
        for name, stage in zip(row_names(), _stages(), strict=True)
    ]


def _stages() -> list[tuple[int, int]]:
    """(saved stage, loaded stage) of each row, in row_names() order."""
    return [(3, s) for _, _, s in LOADS] + [(3, 1), (PLAIN_STAGE, PLAIN_LOAD[2])]


def mesh_row(name: str, stages, first: str, plain: dict | None, started: float) -> dict:
    """The row `name` ("FROM -> TO", meshes as N_dxN_m or "plain N"), saved and loaded at
    `stages`, in the resume table's row format: passed when `first` is ''."""
    frm, to = name.split(" -> ")
    return {
        "from_world_size": frm, "from_stage": stages[0], "to_world_size": to,
        "to_stage": stages[1], "precision": "fp32", "optimizer": "adamw",
        "mode": "deterministic", "bitwise": not first, "passed": not first,
        "first_mismatch": first, "consolidated": plain,
        "seconds": round(time.perf_counter() - started, 2),
        "config": {"from": frm, "to": to, "stage": list(stages), "model": CFG},
    }  # fmt: skip


def loaded_verdict(loaded, meta, saved, saved_mp: int) -> str:
    """'' when the loaded whole state is the saved one's bits and the info says K steps at
    N_m = saved_mp; else the first difference."""
    if not bits_equal(loaded, saved):
        return "loaded state != saved whole state"
    if meta != (K, K, [K], saved_mp, K):
        return f"(t, data step, t_p, N_m, engine t) = {meta}, expected K = {K}, N_m = {saved_mp}"
    return ""


def mp_rows(*, timeout_s: float = 600) -> list[dict]:
    """The rows (see the module docstring), in the resume table's row format."""
    from zero.ranks.launch import under_torchrun
    from zero.ranks.local import get_pool

    if under_torchrun():
        return []
    rows, names, stages = [], row_names(), _stages()
    with tempfile.TemporaryDirectory(prefix="zero-mp-resume-") as tmp:
        root = Path(tmp) / "ckpt"
        started = time.perf_counter()
        saved, after, loss, _ = get_pool(4).run(
            save_then_uninterrupted, 2, 2, 3, "fp32", str(root), timeout_s=timeout_s
        )[0]
        loads = [(dp, mp, s, ()) for dp, mp, s in LOADS] + [(2, 1, 1, (("plain", True),))]
        for i, (dp, mp, stage, opts) in enumerate(loads):
            loaded, meta, nxt, nxt_loss = get_pool(dp * mp).run(
                load_and_continue, dp, mp, stage, "fp32", str(root), opts, timeout_s=timeout_s
            )[0]
            first = loaded_verdict(loaded, meta, saved, 2)
            if not first and mp == 2 and not (bits_equal(nxt, after) and nxt_loss == loss):
                first = "the resumed step != the uninterrupted run's"
            plain = None
            if i == 0:
                plain = {"state_bitwise": bits_equal(consolidated_whole(root), saved)}
                if not first and not plain["state_bitwise"]:
                    first = "consolidated state != saved whole state"
            rows.append(mesh_row(names[i], stages[i], first, plain, started))
            started = time.perf_counter()
        plain_root = Path(tmp) / "plain"  # a plain checkpoint cut into slices on load
        saved = get_pool(2).run(
            save_plain, PLAIN_STAGE, "fp32", str(plain_root), timeout_s=timeout_s
        )[0]
        dp, mp, stage = PLAIN_LOAD
        loaded, meta, _, _ = get_pool(dp * mp).run(
            load_and_continue, dp, mp, stage, "fp32", str(plain_root), timeout_s=timeout_s
        )[0]
        first = loaded_verdict(loaded, meta, saved, 1)
        rows.append(mesh_row(names[-1], stages[-1], first, None, started))
    return rows
