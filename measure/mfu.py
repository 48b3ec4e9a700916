"""Model FLOPs utilisation (MFU): the FLOP/s a training step achieves ÷ the peak FLOP/s that the
rank's device is measured to reach.

    achieved = model FLOPs of one rank's step ÷ the step's seconds
    peak     = the best of a few timed n×n×n matrix products (2n³ FLOPs each) on the same
               device, in PEAK_DTYPE of that device
    MFU      = achieved ÷ peak

Model FLOPs are the formula's (zero.workloads.models.gpt_flops, which tests prove equal to torch's
FlopCounterMode over our GPT's forward and backward): the FLOPs the model needs, not what the
kernels happen to run, so a system that recomputes activations does not raise its MFU by doing it.

[Note: the peak a rank can reach] Every rank measures its peak at the same moment as the others,
on the threads it trains with. On a GPU that is the GPU's own peak. On a CPU it is the share of
the machine a rank gets while its peers work too: with more ranks than cores each rank's peak
falls with its share, and the MFU stays the fraction of what the rank could have done. The peak
is taken in bf16 on CUDA (the usual definition: tensor-core bf16, whatever the step's precision)
and in fp32 on a CPU, where bf16 matrix products are not the fast path; a record names which.
"""

from __future__ import annotations

import time

import torch

from zero.workloads.models import GPTConfig, gpt_flops

PEAK_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
"""The dtype whose peak MFU divides by, per device type ([Note: the peak a rank can reach])."""

PEAK_SIZE = {"cuda": 8192, "cpu": 512}
"""n of the n×n×n product: large enough to reach the device's plateau, small enough to take
milliseconds (8192: 1.1 TFLOP, about 2 ms on an H100; 512: 0.27 GFLOP, a few ms on one core)."""


def step_flops(gpt: GPTConfig, batch_size: int) -> float:
    """Model FLOPs of forward + backward of one micro-batch of `batch_size` sequences (one rank's
    step at M = N), without recomputation."""
    return gpt_flops(
        batch_size, gpt.block_size, gpt.n_layer, gpt.n_embd, gpt.vocab_size, recompute=False
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    size: int | None = None,
    repeats: int = 5,
    per_repeat: int = 4,
) -> float:
    """FLOP/s of the best of `repeats` timings of `per_repeat` n×n×n products (after one untimed
    warm-up), each 2n³ FLOPs. The best, not the median: the peak is what the device can do, and
    interruptions only ever slow a timing down."""
    device = torch.device(device)
    dtype = dtype or PEAK_DTYPE[device.type]
    n = PEAK_SIZE[device.type] if size is None else size
    for name, value, low in (
        ("size", n, 1),
        ("repeats", repeats, 1),
        ("per_repeat", per_repeat, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}: allowed are integers >= {low}")
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    torch.mm(a, b, out=out)  # warm-up: kernel selection, first-touch of the pages
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(per_repeat):
            torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / per_repeat)
    return 2.0 * n**3 / best


def utilisation(flops: float, seconds: float, peak: float) -> dict[str, float]:
    """The record's fields: achieved FLOP/s and MFU of `flops` done in `seconds` on a device
    whose measured peak is `peak` FLOP/s."""
    if not (flops > 0 and seconds > 0 and peak > 0):
        raise ValueError(
            f"flops={flops!r}, seconds={seconds!r}, peak={peak!r}: allowed are values > 0"
        )
    achieved = flops / seconds
    return {"achieved_flops": achieved, "mfu": achieved / peak}
