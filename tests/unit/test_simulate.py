"""The N-rank NumPy simulation of ZeRO stages 0-3 against the single-process reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import Hyper, ModelSpec, StepConfig, cast, init_state, train_step, working_copy
from reference.precision import DTYPES, bits
from reference.simulate import World
from verify.checks.bounds import sum_bound
from zero.common.memory import model_state_breakdown, model_state_bytes

OPTIMIZERS = {
    "sgd": (
        Hyper(lr=0.05, momentum=0.9, weight_decay=0.01),
        Hyper(lr=0.1, momentum=0.5, nesterov=True),
    ),
    "adam": (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=3e-2)),
    "adamw": (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=3e-2, betas=(0.8, 0.99))),
}


def make_spec(sizes):
    """sizes: a list of units, each a list of numels; odd-indexed parameters are in group 1."""
    units = [[(f"u{i}.p{j}", (n,)) for j, n in enumerate(u)] for i, u in enumerate(sizes)]
    group_of = {name: j % 2 for u in units for j, (name, _) in enumerate(u)}
    return ModelSpec.build(units, group_of, chunk=128), units


def draw_grads(rng, units, m, precision, scale=1.0, exponents=8):
    return [
        {
            n: cast(
                rng.standard_normal(s) * 2.0 ** rng.integers(-exponents, exponents, s) * scale,
                precision,
            )
            for u in units
            for n, s in u
        }
        for _ in range(m)
    ]


def assert_same(world, ref_state, cfg, spec):
    """Every rank's shards and copies equal the reference, bit for bit."""
    fm, fo = world.full_master(), world.full_opt()
    for n in spec.names:
        assert np.array_equal(bits(fm[n]), bits(ref_state.master[n])), n
        for k, v in ref_state.opt[n].items():
            assert np.array_equal(bits(fo[n][k]), bits(v)), (n, k)
    work = working_copy(ref_state, cfg)
    for rk in world.ranks:  # each rank's working buffers as it holds them
        for u, lay in enumerate(spec.layouts):
            buf = rk.working[u]
            L = world.shard[u]
            if world.stage == 3:
                full = lay.flatten(work, world.n, DTYPES[cfg.precision])
                assert np.array_equal(bits(buf), bits(full[rk.rank * L : (rk.rank + 1) * L]))
            else:
                for n, v in lay.unflatten(buf).items():
                    assert np.array_equal(bits(v), bits(work[n])), (rk.rank, n)


sizes_strategy = st.lists(
    st.lists(st.integers(1, 300), min_size=1, max_size=3), min_size=1, max_size=3
)


@settings(max_examples=max(60, settings.default.max_examples))
@given(
    sizes=sizes_strategy,
    log_n=st.integers(0, 3),
    log_k=st.integers(0, 2),
    stage=st.integers(0, 3),
    precision=st.sampled_from(["fp32", "bf16", "fp16"]),
    reduce_in_compute=st.booleans(),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    clip=st.sampled_from([None, 0.5]),
    seed=st.integers(0, 2**32 - 1),
)
def test_world_size_invariance(
    sizes, log_n, log_k, stage, precision, reduce_in_compute, optimizer, clip, seed
):
    """Power-of-two N dividing M: the simulation at every stage equals the single-process
    reference (world_size=1) bit for bit, every step, on every rank."""
    n, m = 2**log_n, 2 ** (log_n + log_k)
    spec, units = make_spec(sizes)
    rng = np.random.default_rng(seed)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    common = dict(
        optimizer=optimizer,
        groups=OPTIMIZERS[optimizer],
        precision=precision,
        reduce_dtype=precision if reduce_in_compute else "fp32",
        micro_batches=m,
        clip_norm=clip,
    )
    ref_cfg = StepConfig(world_size=1, **common)
    cfg = StepConfig(world_size=n, **common)
    ref = init_state(master, spec, ref_cfg)
    world = World(master, spec, cfg, stage=stage, mode="deterministic")
    for _ in range(2):
        g = draw_grads(rng, units, m, precision, scale=2.0**8 if precision == "fp16" else 1.0)
        ref, info = train_step(ref, g, spec, ref_cfg)
        sim_info = world.step(g)
        assert sim_info.skipped == info.skipped
        assert info.skipped or float(sim_info.norm).hex() == float(info.norm).hex()
        assert_same(world, ref, cfg, spec)


@settings(max_examples=max(40, settings.default.max_examples))
@given(
    sizes=sizes_strategy,
    log_n=st.integers(0, 2),
    stage=st.integers(0, 3),
    precision=st.sampled_from(["fp32", "bf16"]),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    clip=st.sampled_from([None, 0.5]),
    seed=st.integers(0, 2**32 - 1),
    presence=st.lists(st.integers(0, 2**8 - 1), min_size=3, max_size=3),
)
def test_unused_parameters_equal_the_reference(
    sizes, log_n, stage, precision, optimizer, clip, seed, presence
):
    """[Note: unused parameters] Micro-batches that omit parameters (some of them, or all of
    them for a whole step): every stage at N = 1, 2, 4 equals the reference at N bit for bit,
    and each parameter's own step count is the reference's."""
    n = 2**log_n
    m = 2 * n
    spec, units = make_spec(sizes)
    rng = np.random.default_rng(seed)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    cfg = StepConfig(
        optimizer=optimizer,
        groups=OPTIMIZERS[optimizer],
        precision=precision,
        world_size=n,
        micro_batches=m,
        clip_norm=clip,
    )
    ref = init_state(master, spec, cfg)
    world = World(master, spec, cfg, stage=stage, mode="deterministic")
    names = spec.names
    for step, bitsmask in enumerate(presence):
        g = draw_grads(rng, units, m, precision)
        for i, name in enumerate(names):
            # per parameter, per step: absent everywhere, present everywhere, or a pattern
            kind = (bitsmask >> (2 * (i % 4))) & 3
            for j in range(m):
                if kind == 0 or (kind == 3 and (j + i + step) % 3 == 0):
                    del g[j][name]
        ref, info = train_step(ref, g, spec, cfg)
        sim_info = world.step(g)
        assert float(sim_info.norm).hex() == float(info.norm).hex()
        assert world.state.steps == ref.steps
        assert world.state.t == ref.t == step + 1
        assert_same(world, ref, cfg, spec)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_three_equals_reference_at_three(stage):
    spec, units = make_spec([[37, 5], [300], [1]])
    rng = np.random.default_rng(3)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    cfg = StepConfig(optimizer="adamw", groups=OPTIMIZERS["adamw"], world_size=3, micro_batches=6)
    ref1 = StepConfig(optimizer="adamw", groups=OPTIMIZERS["adamw"], micro_batches=6)
    ref, ref_at_1 = init_state(master, spec, cfg), init_state(master, spec, ref1)
    world = World(master, spec, cfg, stage=stage, mode="deterministic")
    for _ in range(2):
        g = draw_grads(rng, units, 6, "fp32", exponents=20)
        ref, _ = train_step(ref, g, spec, cfg)
        ref_at_1, _ = train_step(ref_at_1, g, spec, ref1)
        world.step(g)
        assert_same(world, ref, cfg, spec)
    # N = 3 is a different tree: invariance is promised only for powers of two
    assert any(
        not np.array_equal(bits(ref.master[n]), bits(ref_at_1.master[n])) for n in spec.names
    )


# docs/design.md §2, per rank per step, in units of (N-1)/N · Ψ; k = M/N
VOLUME = {
    ("deterministic", 0): lambda k: k + 1,
    ("deterministic", 1): lambda k: k + 1,
    ("deterministic", 2): lambda k: k + 1,
    ("deterministic", 3): lambda k: 3 * k,
    ("fast", 0): lambda k: 2,
    ("fast", 1): lambda k: 2,
    ("fast", 2): lambda k: k + 1,
    ("fast", 3): lambda k: 3 * k,
}


@pytest.mark.parametrize("mode, stage", sorted(VOLUME))
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_communication_volume_equals_the_table(mode, stage, n, k):
    """Per rank: elements sent (padding included) = factor·(N-1)·ΣL exactly, where N·ΣL is the
    padded Ψ; summed over ranks, the non-padding elements = factor·(N-1)·Ψ exactly. At M = N
    that is the paper's 2Ψ (stages 0-2) and 3Ψ (stage 3), times (N-1)/N."""
    spec, units = make_spec([[37, 5], [300, 129], [1]])
    rng = np.random.default_rng(0)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    cfg = StepConfig(optimizer="adam", groups=OPTIMIZERS["adam"], world_size=n, micro_batches=n * k)
    world = World(master, spec, cfg, stage=stage, mode=mode)
    world.step(draw_grads(rng, units, n * k, "fp32"))
    factor = VOLUME[(mode, stage)](k)
    shard_total = sum(world.shard)
    payload = 0
    for r in range(n):
        elements, padding = world.traffic(r)
        assert elements == factor * (n - 1) * shard_total
        payload += elements - padding
    assert payload == factor * (n - 1) * spec.numel
    # control traffic is kept apart: the overflow flag and one used-flag per parameter, plus
    # norm partials at stages 1-3
    chunks = sum(L // 128 for L in world.shard)
    control = (n - 1) * (1 + len(spec.names) + (chunks if stage > 0 else 0))
    assert all(world.traffic(r, "control") == (control, 0) for r in range(n))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "precision, reduce_dtype, optimizer",
    [
        ("bf16", "bf16", "adam"),
        ("fp16", "fp32", "adamw"),
        ("fp32", "fp32", "adam"),
        ("bf16", "fp32", "sgd"),
    ],
)
@pytest.mark.parametrize(
    "n, k, mode",
    [
        (4, 1, "deterministic"),
        (4, 4, "deterministic"),
        (2, 8, "deterministic"),
        (4, 4, "fast"),
        (3, 2, "fast"),
    ],
)
def test_resident_bytes_equal_the_analytic_model(
    stage, precision, reduce_dtype, optimizer, n, k, mode
):
    spec, units = make_spec([[37, 5], [300, 129], [1]])
    rng = np.random.default_rng(0)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    cfg = StepConfig(
        optimizer=optimizer,
        groups=OPTIMIZERS[optimizer],
        precision=precision,
        reduce_dtype=reduce_dtype,
        world_size=n,
        micro_batches=n * k,
    )
    world = World(master, spec, cfg, stage=stage, mode=mode)
    world.step(draw_grads(rng, units, n * k, precision))
    padded = n * sum(world.shard)
    expected = model_state_breakdown(
        num_params=spec.numel,
        padding=padded - spec.numel,
        world_size=n,
        stage=stage,
        param_bytes=DTYPES[precision].itemsize,
        grad_bytes=DTYPES[reduce_dtype].itemsize,
        master_bytes=0 if precision == "fp32" else 4,
        optimizer_states={"adam": 2, "adamw": 2, "sgd": 1}[optimizer],
        accumulation=k,
        deterministic=mode == "deterministic",
    )
    for r in range(n):
        got = world.resident_bytes(r)
        assert got == {
            "params": expected.params,
            "grads": expected.grads,
            "master": expected.master,
            "optimizer": expected.optimizer,
        }, r
    if (precision, reduce_dtype, optimizer, k) == ("bf16", "bf16", "adam", 1):  # paper config
        assert sum(world.resident_bytes(0).values()) == model_state_bytes(padded, n, stage)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
def test_fast_mode_within_the_summation_bound(stage, reduce_dtype):
    """Fast mode sums in another order. Both it and the reference are orders of the same M
    terms, so |R_fast - R_ref| <= 2·γ_{M-1}·Σ|g_j| elementwise (verify/checks/bounds.py)."""
    n, m = 4, 16
    spec, units = make_spec([[37, 5], [300]])
    rng = np.random.default_rng(5)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    common = dict(
        optimizer="sgd",
        groups=OPTIMIZERS["sgd"],
        precision="bf16",
        reduce_dtype=reduce_dtype,
        micro_batches=m,
    )
    cfg = StepConfig(world_size=n, **common)
    world = World(master, spec, cfg, stage=stage, mode="fast")
    g = draw_grads(rng, units, m, "bf16", exponents=12)
    _, info = train_step(init_state(master, spec, cfg), g, spec, cfg)
    world.step(g)
    differs = False
    for u, lay in enumerate(spec.layouts):
        L = world.shard[u]
        held = (
            [
                rk.grad[u] if rk.grad[u].size == L else rk.grad[u][rk.rank * L : (rk.rank + 1) * L]
                for rk in world.ranks
            ]
            if stage
            else [world.ranks[0].grad[u]]
        )
        fast = lay.unflatten(np.concatenate(held) if stage else held[0])
        for name in fast:
            ref = info.reduced[name].astype(np.float64)
            abs_sum = sum(np.abs(x[name].astype(np.float64)) for x in g)
            bound = 2 * sum_bound(abs_sum, m, reduce_dtype)
            diff = np.abs(fast[name].astype(np.float64) - ref)
            assert np.all(diff <= bound), name
            assert not np.all(diff + 10 * bound <= bound) or not bound.any()  # twin
            differs |= bool(np.any(diff > 0))
    assert differs or reduce_dtype == "fp32"  # bf16 sums in another order really differ


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overflow_on_one_rank_skips_on_every_rank(stage):
    n = 4
    spec, units = make_spec([[37, 5], [300]])
    rng = np.random.default_rng(1)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    cfg = StepConfig(
        optimizer="adam", groups=OPTIMIZERS["adam"], precision="fp16", world_size=n, micro_batches=n
    )
    world = World(master, spec, cfg, stage=stage, mode="deterministic")
    world.step(draw_grads(rng, units, n, "fp16"))
    before = world.full_master()
    g = draw_grads(rng, units, n, "fp16")
    g[2]["u1.p0"][7] = np.float16(np.inf)  # micro-batch 2 lives on rank 2 only
    info = world.step(g)
    assert info.skipped and world.state.t == 1 and world.state.scaler.scale == 2.0**15
    after = world.full_master()
    assert all(np.array_equal(bits(before[x]), bits(after[x])) for x in spec.names)
    assert all(any(s.phase == "overflow" for s in world.log[r]) for r in range(n))


def test_stage3_gathers_the_reference_working_copy():
    n = 4
    spec, units = make_spec([[37, 5], [300]])
    rng = np.random.default_rng(2)
    master = {name: rng.standard_normal(s).astype(np.float32) for u in units for name, s in u}
    cfg = StepConfig(
        optimizer="adamw",
        groups=OPTIMIZERS["adamw"],
        precision="bf16",
        world_size=n,
        micro_batches=n,
    )
    world = World(master, spec, cfg, stage=3, mode="deterministic")
    ref = init_state(master, spec, cfg)
    for _ in range(2):
        g = draw_grads(rng, units, n, "bf16")
        work = working_copy(ref, cfg)  # what forward must see during this step
        world.step(g)
        for u, lay in enumerate(spec.layouts):
            for name, v in lay.unflatten(world.gathered[u]).items():
                assert np.array_equal(bits(v), bits(work[name]))
        ref, _ = train_step(ref, g, spec, cfg)


def test_bad_stage_and_mode():
    spec, units = make_spec([[3]])
    master = {"u0.p0": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="stage=4"):
        World(master, spec, StepConfig(), stage=4, mode="fast")
    with pytest.raises(ValueError, match="mode='slow'"):
        World(master, spec, StepConfig(), stage=1, mode="slow")
