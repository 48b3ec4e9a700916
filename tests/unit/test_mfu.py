"""measure.mfu: the model FLOPs of a bench step, the peak measurement and the MFU arithmetic.

MFU's value is a measurement and is never asserted; what is asserted is what it is made of.
"""

import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from measure import mfu
from measure.bench import MODELS
from zero.workloads.models import GPT, gpt_microbatches


@pytest.mark.parametrize("name", sorted(MODELS))
def test_step_flops_equal_torchs_counter_on_the_bench_models(name):
    """One rank's micro-batch of each bench workload, counted by FlopCounterMode over forward and
    backward (attention in the math backend, whose matmuls the counter sees). On the meta
    device: the counter reads shapes only, and the large model's step costs no compute."""
    w = MODELS[name]
    model = GPT(w.gpt, seed=0, device="meta")
    x, y = gpt_microbatches(w.gpt, seed=0, data_step=0, count=1, batch_size=w.batch_size)[0]
    x, y = x.to("meta"), y.to("meta")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(x, y)
        loss.backward()
    assert counter.get_total_flops() == mfu.step_flops(w.gpt, w.batch_size)


def test_peak_is_at_least_the_average_rate_of_its_own_products():
    """The peak is the best timing, so it is at least the rate of all timed products together
    (2n³ FLOPs each): a FLOP count too large by any factor > 1 still passes, one too small or a
    peak from the slowest timing fails whenever the timings differ."""
    n, repeats, per = 96, 4, 3
    t0 = time.perf_counter()
    peak = mfu.measure_peak_flops("cpu", size=n, repeats=repeats, per_repeat=per)
    elapsed = time.perf_counter() - t0  # includes the warm-up product: the bound is loose
    assert peak >= repeats * per * 2 * n**3 / elapsed


def test_utilisation_arithmetic():
    got = mfu.utilisation(6e9, 0.5, 24e9)
    assert got == {"achieved_flops": 12e9, "mfu": 0.5}


@pytest.mark.parametrize(
    "kwargs, field",
    [({"size": 0}, "size"), ({"repeats": 0}, "repeats"), ({"per_repeat": True}, "per_repeat")],
)
def test_bad_peak_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        mfu.measure_peak_flops("cpu", **kwargs)


def test_bad_utilisation_input_is_named():
    with pytest.raises(ValueError, match="seconds=0"):
        mfu.utilisation(1.0, 0, 1.0)


def test_peak_dtypes_are_the_documented_ones():
    assert mfu.PEAK_DTYPE == {"cuda": torch.bfloat16, "cpu": torch.float32}
