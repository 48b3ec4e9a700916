"""Casts against torch (an implementation nobody here wrote) and the loss scaler's sequence."""

import ml_dtypes
import numpy as np
import pytest
import torch

from reference.precision import (
    ScalerConfig,
    ScalerState,
    bits,
    cast,
    scaler_init,
    scaler_update,
)

TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}


def edge_values(name):
    """Subnormals, the largest finite values, values that overflow, ties and signed zeros."""
    fi = ml_dtypes.finfo(ml_dtypes.bfloat16) if name == "bf16" else np.finfo(np.float16)
    tiny, big, eps = float(fi.smallest_subnormal), float(fi.max), float(fi.eps)
    vals = [
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        tiny,
        -tiny,
        tiny / 2,
        tiny * 1.5,
        tiny * 2.5,
        big,
        -big,
        big * (1 + eps / 4),
        big * (1 + eps),
        1 + eps / 2,
        1 + 1.5 * eps,
        1 + eps / 2 * 1.0001,
        float(fi.smallest_normal),
        float(fi.smallest_normal) * (1 - eps / 2),
        65504.0,
        65520.0,
        3.3895313892515355e38,
        3.4e38,
    ]
    return np.array(vals, np.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # edge values, on purpose
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # random bit NaNs
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_casts_match_torch_bitwise(name):
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            edge_values(name),
            (rng.standard_normal(200_000) * 2.0 ** rng.integers(-40, 40, 200_000)),
            rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        ]
    ).astype(np.float32)
    finite = ~np.isnan(x)
    ours = cast(x, name)
    theirs = torch.from_numpy(x).to(TORCH[name]).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bits(ours)[finite], theirs[finite])
    # NaN payloads differ between libraries (torch 0xFFFF, ml_dtypes 0x7FC0): compare NaN-ness
    back = torch.from_numpy(x).to(TORCH[name]).float().numpy()
    assert np.array_equal(np.isnan(ours.astype(np.float32)), np.isnan(back))
    # and the way back up is exact in both
    assert np.array_equal(bits(ours.astype(np.float32))[finite], back.view(np.uint32)[finite])


def test_ties_round_to_even():
    # 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: even mantissa wins (1.0)
    assert cast(np.float32(1 + 2**-8), "bf16").astype(np.float32) == 1.0
    # 1 + 3*2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even)
    assert cast(np.float32(1 + 3 * 2**-8), "bf16").astype(np.float32) == 1 + 2**-6
    assert cast(np.float32(1 + 2**-11), "fp16").astype(np.float32) == 1.0


def test_scaler_documented_sequence():
    cfg = ScalerConfig(init_scale=2.0**16, growth_interval=3, min_scale=2.0**14)
    s = scaler_init(cfg)
    assert s == ScalerState(scale=65536.0, clean_steps=0)
    s = scaler_update(s, True, cfg)  # overflow: halve, reset
    assert s == ScalerState(scale=32768.0, clean_steps=0)
    for expected in (1, 2):
        s = scaler_update(s, False, cfg)
        assert s == ScalerState(scale=32768.0, clean_steps=expected)
    s = scaler_update(s, False, cfg)  # third clean step: double, reset
    assert s == ScalerState(scale=65536.0, clean_steps=0)
    s = scaler_update(s, False, cfg)
    s = scaler_update(s, True, cfg)  # overflow resets the clean-step counter too
    assert s == ScalerState(scale=32768.0, clean_steps=0)
    for _ in range(3):
        s = scaler_update(s, True, cfg)
    assert s.scale == 2.0**14  # the floor holds


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"init_scale": 0}, "init_scale"),
        ({"backoff": 1.5}, "backoff"),
        ({"growth": 1.0}, "growth"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"min_scale": -1}, "min_scale"),
    ],
)
def test_scaler_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ScalerConfig(**kwargs)


def test_cast_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="allowed are"):
        cast(np.zeros(2, np.float32), "fp8")
