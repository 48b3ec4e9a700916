"""ZeRO++'s qwZ (ZeroConfig.qwz_bits, zero/stages/zeropp.py): stage 3's parameter all-gathers for
forward and backward send each shard block-quantized, and every rank computes with the
dequantized values ([Note: qwZ's values], reference/zeropp.py). A qwZ cell's reference side
computes its micro-batch gradients at those values (verify.checks.sides.qwz_working), so the
bits still match in deterministic mode and the lock-step bounds hold in fast mode; its gathers
are expected in bytes by verify.checks.expect.quantized_traffic. How far the quantized values
are from the exact ones is reference/quantize.py's bound, property-tested there
(tests/unit/test_reference_quantize.py, test_reference_zeropp.py): the engine equals the
reference bit for bit, so it inherits it. How far that moves the loss depends on the model:
measured, not bounded (`python -m measure.parts.zeropp_curve`)."""

from __future__ import annotations

from .record import Bug, Feature

BLOCK = 32
"""The cells' quantization block: several blocks per shard of the small models, and blocks
that straddle parameters (ALIGN is 128)."""


def bits_parser(name: str):
    """The parse of a quantizer width feature ("qwz_bits=8"): 4 or 8, else refused by name."""

    def parse(text: str) -> int:
        value = int(text)
        if value not in (4, 8):
            raise ValueError(f"{name}={text}: allowed are 4 and 8")
        return value

    return parse


def plant_qwz_owner_exact(p) -> None:
    """The owner keeps its own shard exact while the others receive it quantized: ranks then
    compute with different weights (the dequantization's copy of the owner's piece skipped)."""
    from zero.stages import zeropp

    real = zeropp.qwz_all_gather

    def gather(ctx, u, out, shard, tag, async_op):
        pending = real(ctx, u, out, shard, tag, async_op)
        own = u.part.own
        return pending.then(lambda res: res.__setitem__(own, shard) or res)

    p.setattr(zeropp, "qwz_all_gather", gather)
    p.everywhere(real, gather)


def plant_qwz_scale_rounded(p) -> None:
    """The scales sent as bfloat16 (a cheaper wire): every dequantized value moves."""
    from zero.stages import zeropp

    real = zeropp.quantize

    def quantize(x, block, bits):
        q, scale = real(x, block, bits)
        return q, scale.to(zeropp.torch.bfloat16).to(zeropp.torch.float32)

    p.setattr(zeropp, "quantize", quantize)


FEATURE = Feature(
    name="qwz_bits",
    doc="ZeRO++'s qwZ: stage 3's parameter all-gathers block-quantized (ZeroConfig.qwz_bits=b)",
    config=lambda value: {"qwz_bits": value, "quant_block": BLOCK},
    parse=bits_parser("qwz_bits"),
    absent=None,
    needs=lambda c: "" if c.stage == 3 else "qwZ quantizes stage 3's all-gathers; needs stage=3",
    # int8 in bf16 and fp32 (two micro-steps: forward and backward gathers each), int4, a fast
    # cell (lock-step, the reference's gradients at the quantized values), hpZ beside it (its
    # parts copy the forward's quantized values) and frozen units (gathered quantized too)
    quick=(
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=2, accumulation=2,
             features=("qwz_bits=8",), seed=6700),
        dict(stage=3, precision="fp32", optimizer="adam", world_size=4, accumulation=1,
             features=("qwz_bits=4",), seed=6701),
        dict(stage=3, precision="bf16", optimizer="sgd", world_size=2, accumulation=1,
             mode="fast", features=("qwz_bits=8",), seed=6702),
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=4, accumulation=2,
             features=("ranks_per_node=2", "hpz", "qwz_bits=8"), seed=6703),
        dict(stage=3, precision="fp32", optimizer="adamw", world_size=2, accumulation=1,
             model="mlp", features=("frozen", "qwz_bits=8"), seed=6704),
    ),
    branches={"qwZ's quantized parameter all-gathers": lambda c: c.qwz_bits is not None},
    bugs=(
        Bug(name="qwz_owner_exact", breaks="qwZ's owner computing with its exact shard",
            where="qwZ at N > 1, gradients from the model", plant=plant_qwz_owner_exact,
            check="state", observable=lambda c: (
                c.qwz_bits is not None and c.world_size > 1 and not c.injected
            )),
        Bug(name="qwz_scale_rounded", breaks="qwZ's scales rounded to bfloat16 on the wire",
            where="qwZ, gradients from the model", plant=plant_qwz_scale_rounded,
            check="state", observable=lambda c: c.qwz_bits is not None and not c.injected),
    ),
)  # fmt: skip
