"""ZeRO inside the DP group of each model-parallel slice: the engine on a TPGPT (gloo ranks).

- At fixed N_m, the full state (fp32 master, optimizer states, working copy, norm, skip,
  step count, loss scale) has the same bits at N_d = 1 and 2 and at stages 0-3, step after
  step (docs/design.md §6: the DP reduction is §2's, which is invariant over N_d).
- Every rank's slice equals reference/mp.py's step fed with the MP model's micro-batch
  gradients (each MP group computes every micro-batch on the reference's working copy), bit
  for bit, and the engine's norm is the reference's; a planted double count of the replicated
  parameters (counts_in_norm always true) gives another norm, and the check sees it.
- Counted traffic per step: kind "model" is docs/design.md §2's table for the slice
  (verify/checks/expect.py's expected_traffic on the slice's spec, within the DP group), kind "mp"
  is
  §6's table, written here again, k times forward and backward, and the MP control exchange
  is one all-gather of (overflow, s_m, used flags).
- An overflow in one slice alone (an injected inf on MP rank m = 1 of DP index 0) skips the
  step on every rank: no state changes anywhere.

Legend: N_d DP degree, N_m MP degree, (d, m) a rank's coordinates, M micro-batches per step,
k = M/N_d, L blocks, X = b·s·h, T = b·s.
"""

import math

import numpy as np
import pytest
import torch

from verify.mp import cells as mp_cells
from verify.mp.cells import BATCH, CFG, CHUNK, M
from zero.ranks.local import get_pool

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

_groups, _bits, _setup = mp_cells.mesh_groups, mp_cells.float_bits, mp_cells.setup


def _reference_grads(g, cfg, working, batches, dtype, scale):
    """Every slice's micro-batch gradients (verify/mp/cells.py's reference side)."""
    return mp_cells.reference_grads(g, cfg, working, batches, dtype, scale)[1]


def run_mp(rank, world, dp, mp, runs):
    """Worker: each run is (stage, precision, steps, options); returns per run and step the
    state digest, norm bits, skip flag, the reference check and the counted traffic."""
    import torch.distributed as dist

    from reference.mp import mp_train_step
    from reference.step import init_state, working_copy
    from verify.checks.expect import (
        expected_traffic,
        reference_spec,
        reference_step_config,
        traffic_of_step,
    )
    from verify.checks.harness import state_digest
    from zero.config import TORCH_DTYPES
    from zero.mp import counts_in_norm
    from zero.workloads.models import gpt_microbatches

    torch.set_num_threads(1)
    out = []
    for stage, precision, steps, opts in runs:
        opts = dict(opts)
        plant, check_ref = opts.pop("plant", None), opts.pop("reference", False)
        g, model, init, zcfg, eng = _setup(dp, mp, stage, precision, **opts)
        if plant == "double":  # the replicated parameters counted on every MP rank
            eng.mp.rule = lambda name: True
        spec, rcfg = reference_spec(model, zcfg), reference_step_config(zcfg, dp)
        every_init = [None] * mp
        dist.all_gather_object(every_init, init, group=g.mp_group)
        specs = [None] * mp
        dist.all_gather_object(specs, spec, group=g.mp_group)
        states = [init_state(x, s, rcfg) for x, s in zip(every_init, specs)]
        k, rows = M // dp, []
        for step in range(steps):
            batches = gpt_microbatches(model.cfg, seed=1, data_step=step, count=M, batch_size=2)
            row = {}
            if check_ref:
                scale = None if states[0].scaler is None else states[0].scaler.scale
                dtype = TORCH_DTYPES[precision]
                working = working_copy(states[g.m], rcfg)
                grads = _reference_grads(g, model.cfg, working, batches, dtype, scale)
                states, info = mp_train_step(states, grads, specs, rcfg, counts_in_norm)
                row["ref_norm"] = None if info.norm is None else _bits(float(info.norm))
            for i in range(k):
                _, loss = eng(*batches[i * dp + g.d])  # micro-batch j = i·N_d + d
                eng.backward(loss)
            res = eng.step()
            row.update(norm=_bits(res.norm), skipped=res.skipped, loss=_bits(res.loss))
            row["digest"] = state_digest(eng, res)
            if check_ref:
                master, opt = eng.gather_state()
                want = states[g.m]
                row["ref_state"] = all(
                    np.array_equal(
                        master[n].numpy().view(np.uint32), want.master[n].view(np.uint32)
                    )
                    and all(
                        np.array_equal(
                            opt[n][key].numpy().view(np.uint32), want.opt[n][key].view(np.uint32)
                        )
                        for key in want.opt[n]
                    )
                    for n in spec.names
                )
            counter = eng.counter
            row["model"] = traffic_of_step(counter, step)
            row["want_model"] = expected_traffic(zcfg, spec, dp, g.d, forward=True)
            row["mp"] = sorted((r.op, r.phase, r.elements) for r in counter.of_step(step, "mp"))
            row["mp_control"] = [
                (r.op, r.elements) for r in counter.of_step(step, "control") if r.phase == "mp_step"
            ]
            row["flags"] = sum(len(u.used) for u in eng.units)
            rows.append(row)
        out.append(rows)
    return out


def run_overflow(rank, world, dp, mp):
    """Worker: injected gradients, an inf in a split parameter on (d, m) = (0, 1) only; returns
    (skipped, norm, the state digest before and after) per rank."""
    from verify.checks.harness import state_digest

    g, model, init, zcfg, eng = _setup(dp, mp, 2, "fp32", nonfinite="skip")
    before = eng.gather_state()
    gen = torch.Generator().manual_seed(rank)
    for i in range(M // dp):
        grads = {
            name: torch.randn(shape, generator=gen) * 1e-3
            for unit in eng.unit_specs()
            for name, shape in unit
        }
        if (g.d, g.m, i) == (0, 1, 0):
            grads["transformer.h.1.mlp.c_fc.weight"][2, 3] = float("inf")
        eng.inject_gradients(grads)
    res = eng.step()
    after = eng.gather_state()
    same = all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    return res.skipped, res.norm, same, eng.t, state_digest(eng, res) is not None


def run_used(rank, world):
    """Worker, (N_d, N_m) = (1, 2): MP rank 1 never has a gradient for ln_f.weight, rank 0 has
    one; returns each rank's t_p of it and of a parameter no rank had a gradient for."""
    g, model, init, zcfg, eng = _setup(1, 2, 1, "fp32")
    gen = torch.Generator().manual_seed(rank)
    for _ in range(M):
        grads = {
            name: torch.randn(shape, generator=gen) * 1e-3
            for unit in eng.unit_specs()
            for name, shape in unit
            if name != "transformer.wpe.weight"
            and not (g.m == 1 and name == "transformer.ln_f.weight")
        }
        eng.inject_gradients(grads)
    eng.step()
    steps = eng.param_steps()
    return steps["transformer.ln_f.weight"], steps["transformer.wpe.weight"]


def test_used_flags_are_the_maximum_over_the_mp_group():
    """[Note: unused parameters] over the mesh: a parameter used on one slice is used on all
    (its t_p advances everywhere, as reference/mp.py's union says); one used nowhere stays."""
    assert get_pool(2).run(run_used, timeout_s=300) == [(1, 0), (1, 0)]


def mp_traffic(n, k):
    """docs/design.md §6's table for one step of k micro-batches (deterministic mode), as
    sorted (op, phase, elements) records: verify/checks/expect.py's expected_mp_traffic."""
    from verify.checks.expect import expected_mp_traffic
    from zero.workloads.models import GPTConfig

    return expected_mp_traffic(GPTConfig(**CFG), BATCH, n, k)


def _matrix(mp, runs):
    """{dp: per-rank results} for N_d in {1, 2} at this N_m."""
    return {dp: get_pool(dp * mp).run(run_mp, dp, mp, runs, timeout_s=600) for dp in (1, 2)}


def _assert_invariant(results, runs):
    """Every rank, N_d and run: the same digests, norms and skips step by step."""
    first = results[1][0][0]
    for dp, per_rank in results.items():
        # the loss: one value on every rank (the MP ranks compute it together, §6)
        assert (
            len(
                {tuple(row["loss"] for row in rows) for per_run in per_rank for rows in per_run[:1]}
            )
            == 1
        )
        for r, per_run in enumerate(per_rank):
            for i, rows in enumerate(per_run):
                for s, (row, want) in enumerate(zip(rows, first, strict=True)):
                    where = f"N_d={dp} rank={r} run={runs[i]} step={s}"
                    # every rank of one MP index holds one slice: compare within m
                    m = r % (len(per_rank) // dp)
                    ref = results[1][m][0][s]
                    assert row["digest"] == ref["digest"], where
                    assert (row["norm"], row["skipped"]) == (want["norm"], want["skipped"]), where


@pytest.mark.parametrize("mp", [1, 2])
def test_bitwise_across_dp_degree_and_stages(mp):
    """Fast subset: stages 0 and 3, fp32, two steps (the full matrix is marked full)."""
    runs = [(0, "fp32", 2, ()), (3, "fp32", 2, ())]
    results = _matrix(mp, runs)
    _assert_invariant(results, runs)
    assert not any(row["skipped"] for row in results[1][0][0])


@pytest.mark.full
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mp", [1, 2])
def test_bitwise_across_dp_degree_and_stages_full(mp, precision):
    runs = [(stage, precision, 3, ()) for stage in range(4)]
    _assert_invariant(_matrix(mp, runs), runs)


def _reference_rows(dp, mp, stage, precision, plant=None, steps=2):
    opts = (("reference", True),) + ((("plant", plant),) if plant else ())
    return get_pool(dp * mp).run(run_mp, dp, mp, [(stage, precision, steps, opts)], timeout_s=600)


def test_engine_equals_reference_fed_with_mp_gradients():
    per_rank = _reference_rows(2, 2, 3, "fp32")
    for r, (rows,) in enumerate(per_rank):
        for s, row in enumerate(rows):
            assert row["ref_state"], f"rank {r} step {s}: state differs from reference/mp.py"
            assert row["norm"] == row["ref_norm"], f"rank {r} step {s}: norm"
    # the norm is the whole model's: the same on every rank of the mesh
    assert len({row["norm"] for (rows,) in per_rank for row in rows[:1]}) == 1


@pytest.mark.full
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp,mp", [(1, 2), (2, 2), (2, 1)])
def test_engine_equals_reference_full(dp, mp, stage, precision):
    for r, (rows,) in enumerate(_reference_rows(dp, mp, stage, precision, steps=3)):
        for s, row in enumerate(rows):
            assert row["ref_state"] and row["norm"] == row["ref_norm"], (r, s)


def test_norm_counts_replicated_parameters_once():
    """Counting the replicated parameters on both MP ranks gives another norm (and, with
    clipping on, other states): the reference check fails on every rank."""
    per_rank = _reference_rows(1, 2, 1, "fp32", plant="double", steps=1)
    for (rows,) in per_rank:
        assert rows[0]["norm"] != rows[0]["ref_norm"]
        assert not rows[0]["ref_state"]


def test_counted_traffic_per_step():
    """(N_d, N_m) = (2, 2), stage 2: ZeRO's model traffic is §2's table for the slice, the MP
    traffic §6's, and the MP control exchange one all-gather of 2 + flags float64 values."""
    per_rank = get_pool(4).run(run_mp, 2, 2, [(2, "fp32", 2, ())], timeout_s=600)
    for r, (rows,) in enumerate(per_rank):
        for s, row in enumerate(rows):
            assert row["model"] == row["want_model"], (r, s)
            assert row["mp"] == mp_traffic(2, M // 2), (r, s)
            assert row["mp_control"] == [("all_gather", 2 + row["flags"])], (r, s)


def test_overflow_on_one_slice_skips_everywhere():
    per_rank = get_pool(4).run(run_overflow, 2, 2, timeout_s=600)
    for r, (skipped, norm, same, t, _) in enumerate(per_rank):
        assert skipped and norm is None and same and t == 0, f"rank {r}"


FAKE_RANKS = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from verify.checks.expect import expected_memory, reference_spec
from zero.collectives import CommCounter
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.workloads.models import GPTConfig
from zero.mp import TPGPT, Mesh, MPContext
dp, mp = 4, 2
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
out = []
for rank in (0, 5):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * mp)
    g = Mesh(dp=dp, mp=mp).groups()
    for stage in range(4):
        ctx = MPContext.of(g.mp_group, counter=CommCounter())
        tp = TPGPT.build(cfg, ctx, seed=None)  # a simulated rank: values void
        z = ZeroConfig(stage=stage, precision="bf16", micro_batches=8, chunk=128,
                       units=tuple(tp.unit_names()), nonfinite="skip")
        eng = ZeroEngine(tp, z, group=g.dp_group, mp=ctx)
        idx = torch.zeros((2, 16), dtype=torch.long)
        for _ in range(2):  # a step: the deterministic tree's partial sums are resident too
            eng.backward(eng(idx, idx)[1])
        eng.step()
        spec = reference_spec(tp, z)
        got = {k: v for k, v in eng.memory_report().items() if k != "comm_buffers"}
        out.append([rank, g.d, g.m, stage, spec.numel, got, expected_memory(z, spec, dp)])
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_simulated_rank_holds_its_slice_on_the_fake_process_group():
    """Ranks (0, 0) and (2, 1) of a 4 × 2 job, each alone in one process: after a step (values
    void, collectives instant) the engine's resident bytes at stages 0-3 equal
    verify.checks.expect's
    per-unit model (zero/common/memory.py) for the slice's spec at N = N_d, and the slice has
    tp_num_params(cfg, 2) parameters (counted by hand here)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from zero.mp import tp_num_params
    from zero.workloads.models import GPTConfig

    done = subprocess.run(
        [sys.executable, "-c", FAKE_RANKS],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    h, v, s, layers = 32, 64, 16, 2
    # per block: QKV 3h·h/2 + 3h/2, attention-out h·h/2 + h, MLP-in 4h·h/2 + 4h/2, MLP-out
    # 4h·h/2 + h, two LayerNorms 4h; then wte V·h/2, wpe S·h, ln_f 2h
    block = 3 * h * h // 2 + 3 * h // 2 + h * h // 2 + h + 4 * h * h // 2 + 2 * h
    block += 4 * h * h // 2 + h + 4 * h
    by_hand = layers * block + v * h // 2 + s * h + 2 * h
    cfg = GPTConfig(vocab_size=v, block_size=s, n_layer=layers, n_head=4, n_embd=h)
    assert tp_num_params(cfg, 2) == by_hand
    assert [(r[0], r[1], r[2]) for r in rows[::4]] == [(0, 0, 0), (5, 2, 1)]
    for rank, _, _, stage, numel, got, want in rows:
        assert numel == by_hand, (rank, stage)
        assert got == want, (rank, stage, got, want)
    stage3 = [r[5] for r in rows if r[3] == 3]
    stage0 = [r[5] for r in rows if r[3] == 0]
    for a, b in zip(stage0, stage3):  # the working copy is sharded over N_d = 4 at stage 3
        assert b["params"] < a["params"] / 3


def run_bad_input(rank, world):
    """Worker (N_d = N_m = 1): each refused engine construction's message (checkpoints:
    tests/distributed/test_mp_checkpoint.py)."""
    from zero.collectives import CommCounter
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.mp import TPGPT, MPContext
    from zero.workloads.models import GPT, GPTConfig

    g = _groups(1, 1)
    cfg = GPTConfig(**CFG)
    ctx = MPContext.of(g.mp_group, counter=CommCounter())
    z = ZeroConfig(micro_batches=1, chunk=CHUNK)
    fast = MPContext.of(g.mp_group, counter=ctx.counter, deterministic=False)
    cases = {
        "not a context": lambda: ZeroEngine(TPGPT.build(cfg, ctx), z, mp="mp"),
        "another context": lambda: ZeroEngine(
            TPGPT.build(cfg, MPContext.of(g.mp_group, counter=CommCounter())), z, mp=ctx
        ),
        "fast MP in deterministic": lambda: ZeroEngine(TPGPT.build(cfg, fast), z, mp=fast),
        "plain model": lambda: ZeroEngine(GPT(cfg), z, mp=ctx),
    }
    out = {}
    for name, build in cases.items():
        try:
            build()
            out[name] = "built"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_bad_input_is_refused_by_name():
    (got,) = get_pool(1).run(run_bad_input, timeout_s=300)
    assert got["not a context"].startswith("mp='mp': must be a zero.mp.MPContext")
    assert "must hold this same MPContext" in got["another context"]
    assert got["fast MP in deterministic"].startswith("mp.deterministic=False: must equal")
    assert "must hold this same MPContext" in got["plain model"]


def test_p_a_in_the_engine_changes_no_bit():
    """Stage 3 at N_d = 2, N_m = 2, two steps: without checkpointing, with it, with P_a and with
    P_a+cpu, the same state digests and norms on every rank (P_a gathers back the bits it cut);
    P_a's traffic is one all-gather of (N_m-1)·⌈X/N_m⌉ per checkpointed unit per micro-step,
    and nothing else changes."""
    from collections import Counter

    ckpt = (("activation_checkpointing", True),)
    p_a = (*ckpt, ("partition_activations", True))
    runs = [(3, "fp32", 2, opts) for opts in ((), ckpt, p_a, (*p_a, ("offload_activations", True)))]
    per_rank = get_pool(4).run(run_mp, 2, 2, runs, timeout_s=600)
    x = BATCH * CFG["block_size"] * CFG["n_embd"]
    want = Counter({("all_gather", "p_a", math.ceil(x / 2)): CFG["n_layer"] * (M // 2)})
    for per_run in per_rank:
        plain = per_run[0]
        for rows in per_run[1:]:
            for a, b in zip(plain, rows, strict=True):
                assert (a["digest"], a["norm"]) == (b["digest"], b["norm"])
        for a, b in zip(per_run[1], per_run[2], strict=True):
            assert Counter(b["mp"]) - Counter(a["mp"]) == want
            assert Counter(a["mp"]) - Counter(b["mp"]) == Counter()
