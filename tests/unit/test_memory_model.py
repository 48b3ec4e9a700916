"""The analytic memory model (zero.common.memory) against the paper's formulas and docs/design.md
§3's rules.

Expected values are the paper's formulas (Figure 1, docs/paper.md §1.1) and docs/design.md §3's
rules, written here again in exact arithmetic, independently of zero.common.memory.

Legend: Ψ = num_params, N = N_d = world_size, K = the optimizer-state multiplier, M/N = accumulation
(micro-steps per step)."""

import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero.common.memory import (
    MemoryBreakdown,
    asymptotic_reduction,
    bytes_per_param,
    max_model_params,
    model_state_breakdown,
    model_state_bytes,
    optimizer_k,
    reduction_factor,
)

REPO = Path(__file__).resolve().parents[2]

PSI = st.integers(min_value=0, max_value=10**15)
WORLD = st.integers(min_value=1, max_value=1 << 20)
STAGE = st.integers(min_value=0, max_value=3)


def paper_formula(psi: int, n: int, stage: int, k: int = 12) -> float:
    """Figure 1's per-device bytes, exactly, rounded once."""
    psi, k = Fraction(psi), Fraction(k)
    return float(
        {
            0: (2 + 2 + k) * psi,
            1: 2 * psi + 2 * psi + k * psi / n,
            2: 2 * psi + (2 + k) * psi / n,
            3: (2 + 2 + k) * psi / n,
        }[stage]
    )


# --- the paper's configuration -------------------------------------------------------------------


@given(psi=PSI, n=WORLD, stage=STAGE)
def test_breakdown_total_is_the_paper_formula(psi, n, stage):
    total = model_state_breakdown(num_params=psi, world_size=n, stage=stage).total
    assert total == paper_formula(psi, n, stage)
    assert total == model_state_bytes(psi, n, stage)


@given(psi=PSI, n=WORLD, stage=STAGE, k=st.sampled_from([0, 4, 8, 12, 16]))
def test_model_state_bytes_any_k(psi, n, stage, k):
    assert model_state_bytes(psi, n, stage, k=k) == paper_formula(psi, n, stage, k)


def test_figure1_bytes():
    # 7.5B at N_d = 64: 120 GB, 31.40625 GB, 16.640625 GB, 1.875 GB (Figure 1 prints 1.9).
    expected = [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert [model_state_bytes(7.5e9, 64, s) for s in range(4)] == expected


def test_breakdown_categories_paper_config():
    b = model_state_breakdown(num_params=1024, world_size=4, stage=1)
    assert b == MemoryBreakdown(params=2048, grads=2048, master=1024, optimizer=2048)
    b = model_state_breakdown(num_params=1024, world_size=4, stage=2)
    assert b == MemoryBreakdown(params=2048, grads=512, master=1024, optimizer=2048)
    b = model_state_breakdown(num_params=1024, world_size=4, stage=3)
    assert b == MemoryBreakdown(params=512, grads=512, master=1024, optimizer=2048)


def test_bytes_per_param_and_reductions():
    assert [bytes_per_param(64, s) for s in range(4)] == [16, 4 + 12 / 64, 2 + 14 / 64, 0.25]
    assert [asymptotic_reduction(s, world_size=64) for s in range(4)] == [1, 4, 8, 64]
    assert asymptotic_reduction(1, k=8) == 3  # (4 + K)/4
    assert reduction_factor(64, 3) == 64
    assert reduction_factor(1, 2) == 1  # one rank partitions nothing
    with pytest.raises(ValueError, match="world_size"):
        asymptotic_reduction(3)


# --- other precisions and optimizers -------------------------------------------------------------


@given(psi=PSI, n=WORLD)
def test_pure_fp32_adam_is_16_psi_at_stage_0(psi, n):
    fp32 = dict(param_bytes=4, grad_bytes=4, master_bytes=0)
    b = model_state_breakdown(num_params=psi, world_size=n, stage=0, **fp32)
    assert (b.params, b.grads, b.master, b.optimizer) == (4 * psi, 4 * psi, 0, 8 * psi)
    assert b.total == 16 * psi
    b3 = model_state_breakdown(num_params=psi, world_size=n, stage=3, **fp32)
    assert b3.total == float(Fraction(16 * psi, n))


@pytest.mark.parametrize(("states", "k"), [(2, 12), (1, 8), (0, 4)])
def test_k_from_optimizer_states(states, k):
    # Mixed-precision Adam K = 12, SGD with momentum K = 8, plain SGD K = 4 (docs/design.md §2).
    assert optimizer_k(optimizer_states=states) == k
    for n, stage in [(1, 0), (7, 1), (64, 2), (1000, 3)]:
        b = model_state_breakdown(
            num_params=123_456_789, world_size=n, stage=stage, optimizer_states=states
        )
        assert b.total == paper_formula(123_456_789, n, stage, k)
        assert b.total == model_state_bytes(123_456_789, n, stage, k=k)


@given(
    psi=PSI,
    n=WORLD,
    stage=STAGE,
    param_bytes=st.sampled_from([2, 4]),
    grad_bytes=st.sampled_from([2, 4]),
    master_bytes=st.sampled_from([0, 4]),
    states=st.sampled_from([0, 1, 2]),
    state_bytes=st.sampled_from([2, 4]),
    accumulation=st.integers(1, 64),
    deterministic=st.booleans(),
)
def test_breakdown_general_rules(
    psi,
    n,
    stage,
    param_bytes,
    grad_bytes,
    master_bytes,
    states,
    state_bytes,
    accumulation,
    deterministic,
):
    # docs/design.md §3 in exact arithmetic: each category is numel·bytes, over N where partitioned.
    def over(partitioned: bool) -> Fraction:
        return Fraction(psi, n if partitioned else 1)

    partial_sums = (accumulation.bit_length() - 1) if deterministic else 0
    expected = {
        "params": param_bytes * over(stage == 3),
        "grads": grad_bytes * over(stage >= 2) + partial_sums * grad_bytes * over(True),
        "master": master_bytes * over(stage >= 1),
        "optimizer": states * state_bytes * over(stage >= 1),
    }
    b = model_state_breakdown(
        num_params=psi,
        world_size=n,
        stage=stage,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        master_bytes=master_bytes,
        optimizer_states=states,
        state_bytes=state_bytes,
        accumulation=accumulation,
        deterministic=deterministic,
    )
    assert b.to_dict() == {
        **{key: float(value) for key, value in expected.items()},
        "total": float(sum(expected.values())),  # rounded once, not a sum of rounded parts
    }


def test_pure_fp32_k_is_8():
    assert optimizer_k(master_bytes=0) == 8


# --- the deterministic mode's partial sums -------------------------------------------------------


def max_popcount_below(n: int) -> int:
    """Peak number of extra partial sums of a binary counter streaming n micro-steps."""
    return max((bin(j).count("1") for j in range(1, n)), default=0)


@pytest.mark.parametrize(
    ("accumulation", "extra"), [(1, 0), (2, 1), (4, 2), (8, 3), (3, 1), (5, 2)]
)
@pytest.mark.parametrize("stage", range(4))
def test_grads_extra_partial_sums(accumulation, extra, stage):
    assert max_popcount_below(accumulation) == extra  # the rule's floor(log2) is the counter's peak
    psi, n, grad_bytes = 4096, 8, 4
    base = psi * grad_bytes / (n if stage >= 2 else 1)
    shard = psi * grad_bytes / n
    common = dict(num_params=psi, world_size=n, stage=stage, grad_bytes=grad_bytes)
    det = model_state_breakdown(**common, accumulation=accumulation, deterministic=True)
    fast = model_state_breakdown(**common, accumulation=accumulation, deterministic=False)
    assert det.grads == base + extra * shard
    assert fast.grads == base
    # Nothing but the gradients depends on accumulation or mode.
    assert (det.params, det.master, det.optimizer) == (fast.params, fast.master, fast.optimizer)


@given(psi=st.integers(0, 10**12), n=WORLD, stage=STAGE, padding=st.integers(0, 10**6))
def test_padding_adds_exactly(psi, n, stage, padding):
    padded = model_state_breakdown(num_params=psi, world_size=n, stage=stage, padding=padding)
    assert padded == model_state_breakdown(num_params=psi + padding, world_size=n, stage=stage)
    assert padded.total == paper_formula(psi + padding, n, stage)


def test_hand_built_breakdown_total():
    b = MemoryBreakdown(params=1.0, grads=2.0, master=3.0, optimizer=4.5)
    assert b.total == 10.5
    assert b.to_dict() == {"params": 1, "grads": 2, "master": 3, "optimizer": 4.5, "total": 10.5}


# --- Table 2's inversion -------------------------------------------------------------------------


def test_max_model_params_table2_mp1():
    # docs/paper.md §1.3: 32/16 = 2B, 32/(4+12/64) = 7.64B, 32/(2+14/64) = 14.42B, 32/(16/64) =
    # 128B.
    got = [max_model_params(32e9, 64, s) / 1e9 for s in range(4)]
    assert [round(x, 2) for x in got] == [2.0, 7.64, 14.42, 128.0]


@given(
    memory=st.floats(min_value=1.0, max_value=1e15, allow_nan=False, allow_infinity=False),
    n=WORLD,
    stage=STAGE,
)
def test_max_model_params_inverts_model_state_bytes(memory, n, stage):
    psi = max_model_params(memory, n, stage)
    # Ψ is rounded once to a float (relative error <= 2^-53, at most ulp(m)/2 after scaling by
    # the exact bytes per parameter), then model_state_bytes rounds once more (<= ulp/2 of its
    # result, which may sit one binade above m). So the round trip is within 1.5 ulp(m); allow 2.
    tol = 2 * math.ulp(memory)
    assert abs(model_state_bytes(psi, n, stage) - memory) <= tol
    assert not abs(model_state_bytes(psi, n, stage) + 10 * tol - memory) <= tol  # twin


@pytest.mark.parametrize("mp", [1, 2, 4, 8, 16])
def test_max_model_params_scales_with_mp(mp):
    # Multiplying by a power of two is exact, so the scaling is exact too.
    for stage in range(4):
        assert max_model_params(32e9, 64, stage, mp=mp) == mp * max_model_params(32e9, 64, stage)


# --- invalid input -------------------------------------------------------------------------------


def breakdown(**changes):
    """A call of model_state_breakdown with one argument changed from a valid configuration."""
    return lambda: model_state_breakdown(
        **{"num_params": 8, "world_size": 2, "stage": 0, **changes}
    )


BAD_CALLS = [
    ("stage", lambda: model_state_bytes(1e9, 8, 4), "4"),
    ("stage", lambda: model_state_bytes(1e9, 8, -1), "-1"),
    ("stage", lambda: model_state_bytes(1e9, 8, True), "True"),
    ("world_size", lambda: model_state_bytes(1e9, 0, 1), "0"),
    ("world_size", lambda: model_state_bytes(1e9, 2.5, 1), "2.5"),
    ("num_params", lambda: model_state_bytes(-1, 8, 1), "-1"),
    ("num_params", lambda: model_state_bytes(float("nan"), 8, 1), "nan"),
    ("k", lambda: model_state_bytes(1e9, 8, 1, k=-12), "-12"),
    ("memory_bytes", lambda: max_model_params(-1.0, 64, 1), "-1.0"),
    ("mp", lambda: max_model_params(32e9, 64, 1, mp=0), "0"),
    ("accumulation", breakdown(accumulation=0), "0"),
    ("padding", breakdown(padding=-4), "-4"),
    ("optimizer_states", breakdown(optimizer_states=1.5), "1.5"),
    ("grad_bytes", breakdown(grad_bytes=-2), "-2"),
    ("master_bytes", breakdown(master_bytes=float("inf")), "inf"),
    ("deterministic", breakdown(deterministic="yes"), "'yes'"),
    ("world_size", breakdown(world_size=0), "0"),
    ("stage", breakdown(stage=7), "7"),
]


@pytest.mark.parametrize(("field", "call", "value"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_invalid_input_names_field_value_and_allowed(field, call, value):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{field}={value} ")
    assert "expected" in message


def test_memory_module_imports_neither_torch_nor_numpy():
    code = "import sys, zero.common.memory; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"
