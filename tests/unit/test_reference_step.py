"""The trainer step: reduction, overflow and skipping, the 1/(S·M) scaling, clipping, groups."""

import math

import numpy as np
import pytest

from reference import Hyper, ModelSpec, ScalerConfig, StepConfig, cast, init_state, train_step
from reference.precision import bits
from verify.checks.bounds import UNIT_ROUNDOFF, gamma

UNITS = [[("w", (6, 5)), ("b", (5,))], [("h", (40,))]]
SPEC = ModelSpec.build(UNITS, {"b": 1}, chunk=128)
TWO = (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=2e-2))  # "b" is in group 1: no decay


def master(seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for u in UNITS for n, s in u}


def grads(m, precision, seed=1, scale=1.0):
    rng = np.random.default_rng(seed)
    return [
        {n: cast(rng.standard_normal(s) * scale, precision) for u in UNITS for n, s in u}
        for _ in range(m)
    ]


def same(a, b):
    return all(np.array_equal(bits(a[n]), bits(b[n])) for n in a)


@pytest.mark.parametrize("where", ["microbatch", "sum"])
def test_fp16_overflow_skips_and_changes_only_the_scaler(where):
    cfg = StepConfig(
        optimizer="adam",
        precision="fp16",
        reduce_dtype="fp16",
        micro_batches=4,
        groups=(Hyper(lr=0.1), Hyper(lr=0.2)),
    )
    s0 = init_state(master(), SPEC, cfg)
    s1, _ = train_step(s0, grads(4, "fp16"), SPEC, cfg)  # one clean step first: t = 1
    g = grads(4, "fp16", seed=2)
    if where == "microbatch":
        g[2]["h"][3] = np.float16(np.inf)
    else:  # every micro-batch finite, but their fp16 sum overflows (4 * 30000 > 65504)
        for j in range(4):
            g[j]["w"][0, 0] = np.float16(30000.0)
    s2, info = train_step(s1, g, SPEC, cfg)
    assert info.overflow and info.skipped
    assert s2.t == s1.t == 1 and s2.data_step == 2
    assert s2.scaler.scale == s1.scaler.scale / 2 and s2.scaler.clean_steps == 0
    assert same(s2.master, s1.master)
    for n in s1.opt:
        assert same(s2.opt[n], s1.opt[n])


def test_fp32_nonfinite_raises_unless_skip():
    g = grads(2, "fp32")
    g[1]["b"][0] = np.nan
    cfg = StepConfig(micro_batches=2, groups=TWO)
    with pytest.raises(FloatingPointError, match="non-finite gradient at data step 0"):
        train_step(init_state(master(), SPEC, cfg), g, SPEC, cfg)
    cfg = StepConfig(micro_batches=2, groups=TWO, nonfinite="skip")
    s0 = init_state(master(), SPEC, cfg)
    s1, info = train_step(s0, g, SPEC, cfg)
    assert info.skipped and s1.t == 0 and s1.data_step == 1 and same(s1.master, s0.master)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_scaling_is_one_over_s_times_m(precision):
    """Plain SGD with lr = 1 moves p by exactly the applied gradient (up to the subtraction's
    rounding), which must be mean_j(g_j) / S: check it against the exact float64 mean.
    Bound: the reduced sum of M terms in fp32 (γ_{M-1}·Σ|g|/(S·M)), the multiply by the rounded
    float32 constant 1/(S·M) (2u relative), and p - lr·g rounding (u·|p_new|), all fp32."""
    m, scale = 8, 2.0**10 if precision == "fp16" else 1.0
    cfg = StepConfig(
        optimizer="sgd",
        groups=(Hyper(lr=1.0),) * 2,
        precision=precision,
        micro_batches=m,
        scaler=ScalerConfig(init_scale=scale),
    )
    s0 = init_state(master(), SPEC, cfg)
    g = grads(m, precision, scale=scale)
    s1, info = train_step(s0, g, SPEC, cfg)
    u = UNIT_ROUNDOFF["fp32"]
    for n in SPEC.names:
        stack = np.stack([x[n].astype(np.float64) for x in g])
        mean = stack.sum(0) / (scale * m)
        abs_mean = np.abs(stack).sum(0) / (scale * m)
        moved = s0.master[n].astype(np.float64) - s1.master[n].astype(np.float64)
        tol = gamma(m - 1, u) * abs_mean + 2 * u * abs_mean + u * np.abs(s1.master[n])
        assert np.all(np.abs(moved - mean) <= tol), n
        assert not np.all(np.abs(moved + 10 * tol - mean) <= tol)  # twin: 10x the bound fails
        # twin: a missing 1/M (off by a factor M) fails the same check
        assert not np.all(np.abs(moved * m - mean) <= tol)


def test_clipping_brings_the_norm_to_max_norm():
    """norm is float64 over the layout; after clipping with SGD lr=1, |Δp| ≈ clip_norm.
    Bound: the coefficient is rounded to fp32 (u), each element of g·coef rounds (u) and the
    subtraction p - g rounds (u·|p|, summed in quadrature at most sqrt(n)·u·max|p|)."""
    cfg = StepConfig(optimizer="sgd", groups=(Hyper(lr=1.0),) * 2, micro_batches=2, clip_norm=0.5)
    s0 = init_state(master(), SPEC, cfg)
    g = grads(2, "fp32", scale=10.0)
    s1, info = train_step(s0, g, SPEC, cfg)
    exact = math.sqrt(
        math.fsum(
            float(v) ** 2
            for n in SPEC.names
            for v in ((g[0][n].astype(np.float64) + g[1][n]) / 2).ravel()
        )
    )
    # each element of g = fp32(g0 + g1) * 0.5 is within u (relative) of the exact mean (one
    # rounding; * 0.5 is exact); the float64 squares and tree add ~1e-15. So |norm - exact| <= 2u.
    tol = 2 * UNIT_ROUNDOFF["fp32"] * exact
    assert abs(float(info.norm) - exact) <= tol
    assert not abs(float(info.norm) + 10 * tol - exact) <= tol  # twin: 10x the bound fails
    assert info.clip_coef is not None and info.clip_coef < 1
    moved = np.concatenate(
        [(s0.master[n].astype(np.float64) - s1.master[n]).ravel() for n in SPEC.names]
    )
    u, pmax = UNIT_ROUNDOFF["fp32"], max(float(np.abs(s1.master[n]).max()) for n in SPEC.names)
    tol = 3 * u * 0.5 + math.sqrt(moved.size) * u * pmax
    assert abs(np.linalg.norm(moved) - 0.5) <= tol
    assert not abs(np.linalg.norm(moved) + 10 * tol - 0.5) <= tol  # twin


def test_no_clip_when_norm_is_small():
    cfg = StepConfig(micro_batches=1, groups=TWO, clip_norm=1e6)
    _, info = train_step(init_state(master(), SPEC, cfg), grads(1, "fp32"), SPEC, cfg)
    assert info.clip_coef is None and info.norm > 0


def test_groups_get_their_own_hyperparameters():
    cfg = StepConfig(optimizer="sgd", groups=(Hyper(lr=0.1), Hyper(lr=0.0)), micro_batches=1)
    s0 = init_state(master(), SPEC, cfg)
    s1, _ = train_step(s0, grads(1, "fp32"), SPEC, cfg)
    assert np.array_equal(bits(s1.master["b"]), bits(s0.master["b"]))  # group 1: lr 0
    assert not np.array_equal(bits(s1.master["w"]), bits(s0.master["w"]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"optimizer": "lamb"}, "optimizer"),
        ({"precision": "fp8"}, "precision"),
        ({"precision": "bf16", "reduce_dtype": "fp16"}, "reduce_dtype"),
        ({"world_size": 0}, "world_size"),
        ({"world_size": 4, "micro_batches": 6}, "micro_batches"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"nonfinite": "ignore"}, "nonfinite"),
        ({"groups": ()}, "groups"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StepConfig(**kwargs)


def test_wrong_number_of_microbatches():
    cfg = StepConfig(micro_batches=4, groups=TWO)
    with pytest.raises(ValueError, match="micro_batches=4"):
        train_step(init_state(master(), SPEC, cfg), grads(3, "fp32"), SPEC, cfg)


def test_group_index_out_of_range():
    with pytest.raises(ValueError, match=r"group_of\['b'\]=1: allowed are 0..0"):
        init_state(master(), SPEC, StepConfig())


# -- [Note: unused parameters] ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_unused_parameter_is_skipped_as_torch_optim_skips_grad_none(kind):
    """Steps where no micro-batch has a gradient for "h": the reference leaves it, its states
    and its step count untouched; on its next use its own count (not t) drives the update. The
    same trajectory with "h" updated as a lone parameter on exactly its used steps gives the
    same bits, which is torch.optim's rule (state["step"] per parameter)."""
    hps = (Hyper(lr=1e-2, weight_decay=0.1, momentum=0.9 if kind == "sgd" else 0.0),) * 2
    cfg = StepConfig(optimizer=kind, groups=hps, micro_batches=2)
    state = init_state(master(), SPEC, cfg)
    alone = init_state({"h": state.master["h"]}, ModelSpec.build([[("h", (40,))]]), cfg)
    used_h = [True, False, False, True, False, True]
    for step, use in enumerate(used_h):
        g = grads(2, "fp32", seed=10 + step)
        if not use:
            for x in g:
                del x["h"]
        before = state
        state, info = train_step(state, g, SPEC, cfg)
        assert state.t == step + 1
        assert state.step_of("w") == step + 1  # used every step
        assert state.step_of("h") == sum(used_h[: step + 1])
        if use:
            alone, _ = train_step(alone, [{"h": x["h"]} for x in g], alone_spec(), cfg)
        else:  # nothing of "h" moved, not even by weight decay or momentum
            assert np.array_equal(bits(state.master["h"]), bits(before.master["h"]))
            for k, v in state.opt["h"].items():
                assert np.array_equal(bits(v), bits(before.opt["h"][k])), k
            assert np.array_equal(info.reduced["h"], np.zeros(40, np.float32))
        assert np.array_equal(bits(state.master["h"]), bits(alone.master["h"])), step
    # the old rule (a zero-gradient update on unused steps) moves "h": this test can fail
    old = init_state(master(), SPEC, cfg)
    for step in range(len(used_h)):
        g = grads(2, "fp32", seed=10 + step)
        if not used_h[step]:
            for x in g:
                x["h"] = np.zeros(40, np.float32)
        old, _ = train_step(old, g, SPEC, cfg)
    assert not np.array_equal(bits(old.master["h"]), bits(state.master["h"]))


def alone_spec():
    return ModelSpec.build([[("h", (40,))]])


def test_partly_used_parameter_counts_zeros_where_absent():
    """Absent in some micro-batches only: zeros there (as DDP), and a normal update."""
    cfg = StepConfig(optimizer="adamw", groups=TWO, micro_batches=4, world_size=2)
    g = grads(4, "fp32", seed=3)
    partial = [dict(x) for x in g]
    for j in (0, 3):
        del partial[j]["h"]
    zeros = [dict(x) for x in g]
    for j in (0, 3):
        zeros[j]["h"] = np.zeros(40, np.float32)
    a, ia = train_step(init_state(master(), SPEC, cfg), partial, SPEC, cfg)
    b, ib = train_step(init_state(master(), SPEC, cfg), zeros, SPEC, cfg)
    assert same(a.master, b.master) and float(ia.norm) == float(ib.norm)
    assert a.steps == b.steps == {"w": 1, "b": 1, "h": 1}


def test_unknown_gradient_name_is_refused():
    cfg = StepConfig(groups=TWO, micro_batches=1)
    g = grads(1, "fp32")
    g[0]["nope"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="'nope'"):
        train_step(init_state(master(), SPEC, cfg), g, SPEC, cfg)


def test_overflow_step_advances_no_parameter_count():
    cfg = StepConfig(groups=TWO, precision="fp16", micro_batches=1)
    state = init_state(master(), SPEC, cfg)
    g = grads(1, "fp16")
    g[0]["w"] = np.full((6, 5), np.inf, np.float16)
    state, info = train_step(state, g, SPEC, cfg)
    assert info.skipped and state.t == 0 and state.steps == {"w": 0, "b": 0, "h": 0}
