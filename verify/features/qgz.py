"""ZeRO++'s qgZ (ZeroConfig.qgz_bits, zero/stages/zeropp.py): stage 3's gradient reduce-scatter
becomes two all-to-alls of block-quantized gradients, inside the node and then across nodes,
each summed by the tree ([Note: qgZ's sum], reference/zeropp.py). A deterministic cell is
checked bit for bit against the quantized reference step (train_step's zeropp); a fast cell
against the EXACT step, in lock-step, within a bound that adds qgZ's derived error to the
reduced gradient's (verify.checks.lockstep.qgz_errors) and carries it through the optimizer:
that is the one-step bound between the quantized run and the exact one. Its hops are expected
in bytes, each on its link (verify.checks.expect.quantized_traffic, the verdict's link check)."""

from __future__ import annotations

from .qwz import BLOCK, bits_parser
from .record import Bug, Feature, Pair


def plant_qgz_one_hop(p) -> None:
    """The second hop's sum taken over the received pieces without dequantizing their scales
    (all scales taken as the first piece's): the sum over nodes moves."""
    from zero.stages import zeropp

    real = zeropp.decode

    def decode(buf, n, block, bits):
        if buf.shape[0] > 1:
            qbytes = n * bits // 8
            buf = buf.clone()
            buf[1:, qbytes:] = buf[:1, qbytes:]
        return real(buf, n, block, bits)

    p.setattr(zeropp, "decode", decode)


def plant_int4_unpacked(p) -> None:
    """int4 values sent one to a byte, unpacked: the same bits, twice the values' bytes."""
    from zero.stages import zeropp

    torch, real_decode = zeropp.torch, zeropp.decode

    def encode(x, block, bits):
        rows = x.view(-1, x.shape[-1]) if x.dim() > 1 else x.view(1, -1)
        q, scale = zeropp.quantize(rows.reshape(-1), block, bits)
        n = rows.shape[1]
        s = scale.view(rows.shape[0], n // block).contiguous().view(torch.uint8)
        return torch.cat([q.view(rows.shape[0], n).view(torch.uint8), s], dim=1)

    def decode(buf, n, block, bits):
        if bits == 4:
            q = buf[:, :n].contiguous().view(torch.int8).reshape(-1)
            scale = buf[:, n:].contiguous().view(torch.float32).reshape(-1)
            return zeropp.dequantize(q, scale, block).view(buf.shape[0], n)
        return real_decode(buf, n, block, bits)

    p.setattr(zeropp, "encode", encode)
    p.setattr(zeropp, "decode", decode)


def _int4_sent(c) -> bool:
    return c.world_size > 1 and 4 in (c.qgz_bits, c.qwz_bits)


FEATURE = Feature(
    name="qgz_bits",
    doc="ZeRO++'s qgZ: stage 3's gradient reduction as two quantized all-to-alls (qgz_bits=b)",
    config=lambda value: {"qgz_bits": value, "quant_block": BLOCK},
    parse=bits_parser("qgz_bits"),
    absent=None,
    needs=lambda c: (
        "" if c.stage == 3 and c.reduce_dtype in (None, "fp32")
        else "qgZ reduces stage 3's gradients in float32; needs stage=3 and reduce_dtype fp32"
    ),
    # int4 on 2 x 2 (both hops), 4 x 1 (hop 2 only) and 1 x 4 (hop 1 only), int8 on 2 x 4,
    # two fast cells (the bound against the exact step), and ZeRO++ whole: qwZ, hpZ and qgZ
    quick=(
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=4, accumulation=2,
             features=("ranks_per_node=2", "qgz_bits=4"), seed=6800),
        dict(stage=3, precision="fp32", optimizer="adam", world_size=4, accumulation=1,
             features=("ranks_per_node=1", "qgz_bits=4"), seed=6801),
        dict(stage=3, precision="fp32", optimizer="sgd", world_size=4, accumulation=1,
             features=("qgz_bits=4",), seed=6802),
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=8, accumulation=1,
             features=("ranks_per_node=4", "qgz_bits=8"), seed=6803),
        dict(stage=3, precision="fp32", optimizer="adamw", world_size=4, accumulation=2,
             mode="fast", features=("ranks_per_node=2", "qgz_bits=4"), seed=6804),
        dict(stage=3, precision="bf16", optimizer="sgd", world_size=4, accumulation=1,
             mode="fast", features=("ranks_per_node=2", "qgz_bits=8"), seed=6805),
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=4, accumulation=2,
             features=("ranks_per_node=2", "hpz", "qwz_bits=8", "qgz_bits=4"), seed=6806),
        # ZeRO++ beside ZeRO-R and the others: the reduced shard offloaded (to memory, to disk),
        # the gradient arena, activation checkpointing (a recomputed forward gathers quantized
        # again), frozen units (gathered quantized, never reduced)
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=4, accumulation=2,
             features=("offload", "ranks_per_node=2", "qwz_bits=8", "qgz_bits=4"), seed=6810),
        dict(stage=3, precision="fp32", optimizer="adam", world_size=4, accumulation=1,
             features=("offload", "disk", "ranks_per_node=2", "qgz_bits=4"), seed=6811),
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=4, accumulation=1,
             features=("checkpointing", "contiguous", "ranks_per_node=2", "qwz_bits=8",
                       "qgz_bits=4"), seed=6812),
        dict(stage=3, precision="fp32", optimizer="adamw", world_size=4, accumulation=1,
             model="mlp", features=("frozen", "ranks_per_node=2", "hpz", "qwz_bits=4",
                                    "qgz_bits=8"), seed=6813),
        # one rank: nothing travels, qwZ still quantizes (its values do not depend on N)
        dict(stage=3, precision="fp32", optimizer="adam", world_size=1, accumulation=2,
             features=("qwz_bits=8", "qgz_bits=4"), seed=6807),
    ),
    resume=(
        # ZeRO++ saved and loaded at the same node shape (its bits depend on N and R)
        ({4}, dict(n1=4, s1=3, n2=4, s2=3, precision="bf16", optimizer="adamw",
                   features=("ranks_per_node=2", "hpz", "qwz_bits=8", "qgz_bits=4"))),
    ),
    pairs=(
        Pair("qgZ × offload", "the quantized sum's shard offloaded to host memory", "cells",
             lambda c: c.qgz_bits is not None and c.offload),
        Pair("qgZ × disk tier", "the quantized sum's shard beside state files", "cells",
             lambda c: c.qgz_bits is not None and c.disk),
        Pair("qwZ × checkpointing", "a recomputed forward gathers quantized again", "cells",
             lambda c: c.qwz_bits is not None and c.checkpointing),
        Pair("qgZ × contiguous", "the quantized sum's shard in the gradient arena", "cells",
             lambda c: c.qgz_bits is not None and c.contiguous),
        Pair("qwZ × frozen", "frozen units gathered quantized, never reduced", "cells",
             lambda c: c.qwz_bits is not None and c.frozen),
        Pair("qwZ × hpZ", "hpZ's parts copy the forward's quantized values", "cells",
             lambda c: c.qwz_bits is not None and c.hpz),
        Pair("ZeRO++ × resume", "saved and loaded with quantized collectives", "resume",
             lambda r: "qgz_bits=4" in r.features),
    ),
    branches={"qgZ's two quantized all-to-alls": lambda c: c.qgz_bits is not None},
    bugs=(
        Bug(name="qgz_scales_of_first", breaks="qgZ's hop 2 dequantized with one node's scales",
            where="qgZ on more than one node", plant=plant_qgz_one_hop, check="state",
            observable=lambda c: (
                c.qgz_bits is not None and c.mode == "deterministic"
                and (c.ranks_per_node or c.world_size) < c.world_size
            )),
        Bug(name="int4_unpacked", breaks="int4 values sent one to a byte",
            where="qgZ or qwZ in int4 at N > 1", plant=plant_int4_unpacked, check="traffic",
            observable=_int4_sent),
    ),
)  # fmt: skip
