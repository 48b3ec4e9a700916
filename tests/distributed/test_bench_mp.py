"""measure.bench's model-parallel systems (measure/bench_mp.py) at N = 4 gloo ranks, small GPT.

- Counted traffic per step: kind "mp" = docs/design.md §6's table (deterministic:
verify/checks/expect.py's
  expected_mp_traffic; fast: the table's fast column, written out here), kind "model" = §2's
  table for the slice in the DP group (verify/checks/expect.py's expected_traffic), for megatron-lm
  and
  ZeRO stages at N_m = 1, 2, 4; the records of run_bench carry the same per-step counts.
- megatron-lm-det trains, bit for bit, what a stage-0 engine at N_m = 4, N_d = 1 built here from the
  config alone trains: the slice cut from the whole GPT (TPGPT.from_gpt, not the benchmark's
  TPGPT.build), the step's N micro-batches as one, AdamW spelled out.
- The performance model's MP volume (paper_figures/perfmodel.mp_elements) = the engine's count
  with activation checkpointing, with and without P_a, fast mode.
- Bad input names the field. Speed is never asserted.
Legend: N world size, N_d DP degree, N_m MP degree, L blocks, X = b·s·h, T = b·s, b the sequences of
one micro-batch (N_m·B)."""

import math

import pytest
import torch

from measure import bench
from measure.bench import BenchConfig, run_bench
from zero.ranks.local import get_pool

SMALL = BenchConfig(model="small-mp", world_sizes=(4,), repeats=1, steps=1, warmup=0,
                    retries=0, quiet_wait_s=0.0, memory=False)  # fmt: skip
TRAFFIC_SYSTEMS = ("megatron-lm", "megatron-lm-det", "zero-s1-mp2-det", "zero-s3-mp2",
                   "zero-s2-mp1-det", "zero-s3-mp4-det", "zero-s0-mp2")  # fmt: skip


def fast_mp_traffic(cfg, b: int, n: int) -> list[tuple[str, str, int]]:
    """§6's fast column for one micro-batch of b sequences: every sum of X (2L + 1 forward: the
    g's and the embedding; 2L + 1 backward: the f's and the head) and the cross entropy's max
    and two sums of T are ring all-reduces of 2(N-1)·⌈elements/N⌉."""
    x, t, layers = b * cfg.block_size * cfg.n_embd, b * cfg.block_size, cfg.n_layer
    ring = lambda e: 2 * (n - 1) * math.ceil(e / n)  # noqa: E731
    return sorted(
        [("all_reduce", "mp_fwd", ring(x))] * (2 * layers)
        + [("all_reduce", "mp_embed", ring(x))]
        + [("all_reduce", "mp_xent", ring(t))] * 3
        + [("all_reduce", "mp_bwd", ring(x))] * (2 * layers + 1)
    )


def _traffic(rank, world, systems, cfg):
    """Worker: each system built by the benchmark, two steps; per system this rank's counted
    traffic of the second (bench_mp.step_traffic) and what verify/checks/expect.py expects of it."""
    from measure.bench_mp import step_traffic
    from verify.checks.expect import expected_mp_traffic, expected_traffic, reference_spec

    torch.set_num_threads(1)
    out = {}
    for name in systems:
        t = bench._make(name, rank, world, cfg)
        for _ in range(2):
            t.step(t.batch())
        eng, b = t.engine, t.mp * cfg.workload.batch_size
        spec = reference_spec(eng.module, t.config)
        want_mp = (
            expected_mp_traffic(cfg.workload.gpt, b, t.mp, 1)
            if t.deterministic
            else fast_mp_traffic(cfg.workload.gpt, b, t.mp)
        )
        want_model = expected_traffic(t.config, spec, t.dp, t.groups.d, forward=True)
        out[name] = (step_traffic(eng.counter), want_mp, want_model, (t.dp, t.mp))
    return out


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_counted_traffic_per_step_is_the_design_tables():
    cfg = BenchConfig(**{**vars(SMALL), "systems": TRAFFIC_SYSTEMS})
    per_rank = get_pool(4).run(_traffic, TRAFFIC_SYSTEMS, cfg, timeout_s=300)
    for rank, out in enumerate(per_rank):
        for name, (got, want_mp, want_model, mesh) in out.items():
            where = f"{name} rank {rank} (N_d, N_m) = {mesh}"
            assert [tuple(r) for r in got["mp"]] == want_mp, where
            assert {k: tuple(v) for k, v in got["model"].items()} == want_model, where
            assert got["elements"]["mp"] == sum(e for *_, e in want_mp), where
    # megatron-lm: N_d = 1, nothing of ZeRO's moves; N_m = 1: no MP traffic (all 0-element calls)
    assert per_rank[0]["megatron-lm"][0]["elements"]["model"] == 0
    assert per_rank[0]["zero-s2-mp1-det"][0]["elements"]["mp"] == 0


def _megatron_against_engine(rank, world, cfg, steps):
    """Worker: (losses, final slice) of the benchmark's megatron-lm-det and of an engine built here
    from the config alone, both as bit patterns."""
    from reference.optim import Hyper
    from verify.mp.cells import mesh_groups
    from zero.collectives import CommCounter
    from zero.config import ZeroConfig, decay_matrices_only
    from zero.engine import ZeroEngine
    from zero.mp import TPGPT, MPContext
    from zero.workloads.models import GPT, gpt_microbatches

    torch.set_num_threads(1)
    t = bench._make("megatron-lm-det", rank, world, cfg)
    theirs = [t.step(t.batch()) for _ in range(steps)]
    g = mesh_groups(1, world)
    ctx = MPContext.of(g.mp_group, counter=CommCounter(), deterministic=True)
    w = cfg.workload
    model = TPGPT.from_gpt(GPT(w.gpt, seed=cfg.seed), ctx)
    zcfg = ZeroConfig(
        stage=0, precision="fp32", deterministic=True, optimizer="adamw", micro_batches=1,
        groups=(Hyper(lr=cfg.lr, weight_decay=cfg.weight_decay), Hyper(lr=cfg.lr)),
        group_of=decay_matrices_only, units=tuple(model.unit_names()),
    )  # fmt: skip
    eng = ZeroEngine(model, zcfg, group=g.dp_group, mp=ctx)
    ours = []
    for step in range(steps):
        parts = gpt_microbatches(w.gpt, seed=cfg.seed, data_step=step, count=world,
                                 batch_size=w.batch_size)  # fmt: skip
        x, y = (torch.cat([p[i] for p in parts]) for i in (0, 1))
        _, loss = eng(x, y)
        eng.backward(loss)
        ours.append(eng.step().loss)

    def bits(master):
        return {k: v.detach().float().view(torch.int32).clone() for k, v in master.items()}

    return theirs, ours, bits(t.engine.gather_state()[0]), bits(eng.gather_state()[0])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_megatron_is_a_stage_0_engine_at_n_m_4_bit_for_bit():
    cfg = BenchConfig(**{**vars(SMALL), "systems": ("megatron-lm-det",)})
    for theirs, ours, a, b in get_pool(4).run(_megatron_against_engine, cfg, 3, timeout_s=300):
        assert [x.hex() for x in theirs] == [x.hex() for x in ours]  # the same float64 bits
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert theirs[-1] < theirs[0]  # it trains: 3 steps of lr 1e-3 on the same data lower it


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_run_bench_records_the_mesh_and_the_counts():
    cfg = BenchConfig(**{**vars(SMALL), "systems": ("ddp", "megatron-lm", "zero-s3-mp2")})
    records = {
        r["config"]["system"]: r for r in run_bench(cfg, pools=get_pool, say=lambda *a: None)
    }
    gpt = cfg.workload.gpt
    for name, (dp, mp, stage) in {"megatron-lm": (1, 4, 0), "zero-s3-mp2": (2, 2, 3)}.items():
        c, res = records[name]["config"], records[name]["result"]
        assert res["status"] == "ok", res
        assert (c["dp"], c["mp"], c["stage"], c["micro_batches"]) == (dp, mp, stage, dp)
        assert c["sequences_per_micro_batch"] == mp * cfg.workload.batch_size
        want = sum(e for *_, e in fast_mp_traffic(gpt, c["sequences_per_micro_batch"], mp))
        assert [t["elements"]["mp"] for t in res["traffic_per_step"]] == [want] * 4
        assert res["ratio_vs_ddp"] is not None and res["ratio_vs_megatron"] is not None
    assert records["ddp"]["result"]["traffic_per_step"] == [None] * 4  # not our engine
    from measure.bench_table import format_mp

    assert "zero-s3-mp2" in format_mp(list(records.values()))


def _perf_model_counts(rank, world, dp, mp, p_a):
    """Worker: one step of a fast engine at (dp, mp), every block checkpointed (P_a if asked);
    this rank's counted kind "mp" elements."""
    from measure.bench_mp import mesh_groups
    from zero.collectives import CommCounter
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.mp import TPGPT, MPContext
    from zero.workloads.models import gpt_microbatches

    torch.set_num_threads(1)
    g = mesh_groups(dp, mp)
    ctx = MPContext.of(g.mp_group, counter=CommCounter(), deterministic=False)
    gpt = SMALL.workload.gpt
    model = TPGPT.build(gpt, ctx, seed=0)
    zcfg = ZeroConfig(stage=2, deterministic=False, micro_batches=dp,
                      units=tuple(model.unit_names()), activation_checkpointing=True,
                      partition_activations=p_a)  # fmt: skip
    eng = ZeroEngine(model, zcfg, group=g.dp_group, mp=ctx)
    x, y = gpt_microbatches(gpt, seed=0, data_step=0, count=dp, batch_size=3)[g.d]
    _, loss = eng(x, y)
    eng.backward(loss)
    eng.step()
    return eng.counter.volume(0, "mp")[0]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p_a", [False, True])
def test_perf_model_mp_volume_is_the_engines_count(p_a):
    """paper_figures/perfmodel.mp_elements with recompute (and P_a) = the count at N_m = 2 and 4,
    one micro-batch of b = 3 sequences per DP rank."""
    from paper_figures.performance import throughput_model as pm

    gpt = SMALL.workload.gpt
    for dp, mp in ((2, 2), (1, 4)):
        got = get_pool(4).run(_perf_model_counts, dp, mp, p_a, timeout_s=300)
        want = pm.mp_elements(layers=gpt.n_layer, batch=3, seq=gpt.block_size,
                              hidden=gpt.n_embd, mp=mp, recompute=True, p_a=p_a)  # fmt: skip
        assert got == [want] * 4, (dp, mp, p_a)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(systems=("zero-s1-mp4",), world_sizes=(2,)), "world_sizes"),
        (dict(systems=("megatron-lm",), world_sizes=(3,), model="small"), "n_head"),
        (dict(systems=("zero-s1-mp2",), world_sizes=(4,), model="small-mp"), None),
        (dict(systems=("zero-s1-mp3",), world_sizes=(3,)), "systems"),
        (dict(systems=("zero-s4-mp2",), world_sizes=(4,)), "systems"),
        (dict(systems=("megatron",), world_sizes=(4,)), "systems"),  # the name is megatron-lm
    ],
)
def test_bad_mp_config_names_the_field(kwargs, field):
    if field is None:  # the good case beside the bad ones: accepted as is
        BenchConfig(**kwargs)
        return
    with pytest.raises(ValueError, match=f"^{field}"):
        BenchConfig(**kwargs)
