"""ZeRO++'s quantized collectives as a step means them (Wang et al., arXiv 2306.10209): qwZ, the
weights a stage-3 unit computes with, and qgZ, the gradient sum of each micro-step. Both are
defined on a unit's flat buffer (reference/layout.py) with quantize.py's blocks; the engine
(zero/stages/zeropp.py) must give these bits.

Legend: N ranks, R ranks per node (node-major: rank r on node r // R), K = N/R nodes, B the block,
b the bits, u a unit, L its shard (a multiple of the chunk C, and B divides C), x_r rank r's
buffer of u (N·L elements), q_B(x) = dequantize(quantize(x)) in blocks of B.

[Note: qwZ's values] Every gather of a sharded unit's working parameters for forward or backward
sends each rank's shard quantized, and every rank (the owner too) computes with
    W' = cast_c(q_B(float32(W)))
where W is the unit's compute-dtype buffer and cast_c rounds to the compute dtype (nearest even).
Blocks start at multiples of B in the padded buffer and B divides L, so each shard is whole blocks
and W' does not depend on N: the padding beyond N·L is zero blocks, which quantize exactly. The
owner quantizes its own shard too, so that every rank holds the same W'. Both passes see W' (a
backward gather from hpZ's parts copies the forward's W'), so autograd differentiates the network
it ran. Units that are never gathered (stage 3's persistent units) keep W. Reading parameters
outside a step (gathered_params) gathers the exact W.

[Note: qgZ's sum] A micro-step's reduce-scatter of u becomes two hops, each a sum of quantized
terms by the tree T (reference/tree.py) in float32:
    hop 1 (inside node a):   P_a = T(q_B(x_{aR}), ..., q_B(x_{aR+R-1}))
    hop 2 (across nodes):    S   = T(q_B(P_0), ..., q_B(P_{K-1}))
and rank r keeps its shard of S. A hop over one rank (R = 1, or K = 1) sends nothing and
quantizes nothing: P_a = x_{aR}, or S = P_0. In a hop over more, every term is quantized, the
one a rank keeps for itself too, so that the sum is symmetric in its terms and no shard depends
on which rank owns it. Blocks are B-aligned slices of the buffer, so quantizing the K slices a
rank sends in hop 1, or its shard's partial sum in hop 2, is q_B of the whole buffer restricted
to them. Non-finite values spread over their block as NaN (quantize.py) and reach S, so the
overflow check still skips the step. Without quantization the hops are T over K of T over R,
which is T over N when R is a power of two.

Error: by quantize.py's [Note: quantization error] through each hop,
    |S - Σ_r x_r| <= E_2 + Σ_a E_1(a),
E_1(a) = sum_error_bound of node a's R terms, E_2 = sum_error_bound of the K partials (a hop
over one term adds nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .precision import cast
from .quantize import dequantize, quantize, sum_error_bound
from .tree import StreamingTree, tree_sum


@dataclass(frozen=True, kw_only=True)
class ZeroPP:
    """Which of a step's collectives are quantized, and how."""

    block: int
    qwz_bits: int | None = None
    qgz_bits: int | None = None
    ranks_per_node: int | None = None
    """R; None: every rank on one node."""
    units: tuple[bool, ...] = ()
    """Per unit of the ModelSpec: whether it is sharded, so gathered (stage 3's persistent units
    are not); only those are quantized."""


def roundtrip(x: np.ndarray, *, block: int, bits: int) -> np.ndarray:
    """q_B(x): x (float32) quantized in blocks and dequantized."""
    return dequantize(quantize(x, block=block, bits=bits))


def qwz_values(flat: np.ndarray, *, block: int, bits: int, precision: str) -> np.ndarray:
    """[Note: qwZ's values]: W' of a unit's compute-dtype buffer."""
    return cast(roundtrip(flat.astype(np.float32), block=block, bits=bits), precision)


def _per_node(n: int, per_node: int | None) -> int:
    r = n if per_node is None else per_node
    if r < 1 or n % r:
        raise ValueError(f"ranks_per_node={per_node}: must divide the {n} terms")
    return r


def _hop(xs: Sequence[np.ndarray], block: int, bits: int) -> np.ndarray:
    if len(xs) == 1:
        return xs[0]
    return tree_sum([roundtrip(x, block=block, bits=bits) for x in xs])


def qgz_partials(xs: Sequence[np.ndarray], *, per_node, block: int, bits: int) -> list:
    """Hop 1 of [Note: qgZ's sum]: P_a for every node a (xs: the N ranks' float32 buffers)."""
    r = _per_node(len(xs), per_node)
    with np.errstate(over="ignore", invalid="ignore"):
        return [_hop(xs[a : a + r], block, bits) for a in range(0, len(xs), r)]


def qgz_sum(xs: Sequence[np.ndarray], *, per_node, block: int, bits: int) -> np.ndarray:
    """[Note: qgZ's sum]: S, float32."""
    partials = qgz_partials(xs, per_node=per_node, block=block, bits=bits)
    with np.errstate(over="ignore", invalid="ignore"):
        return _hop(partials, block, bits)


def qgz_error_bound(xs: Sequence[np.ndarray], *, per_node, block: int, bits: int) -> np.ndarray:
    """Per element (float64), the bound E_2 + Σ_a E_1(a) on |S - Σ x_r| of [Note: qgZ's sum],
    times (1 + 2^-40) for the float64 additions of its K + 1 terms (as sum_error_bound's)."""
    r = _per_node(len(xs), per_node)

    def hop(terms):
        if len(terms) == 1:
            return np.zeros(terms[0].size)
        return sum_error_bound(terms, block=block, bits=bits)

    partials = qgz_partials(xs, per_node=per_node, block=block, bits=bits)
    first = sum(hop(xs[a : a + r]) for a in range(0, len(xs), r))
    return (hop(partials) + first) * (1 + 2.0**-40)


def quantized_working(working: Mapping, spec, zpp: ZeroPP, world_size: int, precision: str):
    """The working copy a step computes with under qwZ: every sharded unit's parameters
    replaced by W' ([Note: qwZ's values]); the others, and everything without qwZ, as they are."""
    if zpp.qwz_bits is None:
        return dict(working)
    out = dict(working)
    for lay, sharded in zip(spec.layouts, zpp.units, strict=True):
        if sharded:
            flat = lay.flatten(working, world_size, np.asarray(working[lay.slots[0].name]).dtype)
            q = qwz_values(flat, block=zpp.block, bits=zpp.qwz_bits, precision=precision)
            out.update({k: v.copy() for k, v in lay.unflatten(q).items()})
    return out


def quantized_reduction(grads: Sequence[Mapping], spec, zpp: ZeroPP, world_size: int) -> dict:
    """R by name for the sharded units under qgZ: each micro-step's S ([Note: qgZ's sum]) over
    the ranks' float32 buffers, streamed across micro-steps as reduce_microbatches does.
    grads: every micro-batch's gradients, complete (every name), in the reduction dtype fp32."""
    out = {}
    n = world_size
    for lay, sharded in zip(spec.layouts, zpp.units, strict=True):
        if not sharded:
            continue
        stream = StreamingTree()
        for k in range(len(grads) // n):
            xs = [lay.flatten(g, n, np.float32) for g in grads[k * n : (k + 1) * n]]
            stream.push(
                qgz_sum(xs, per_node=zpp.ranks_per_node, block=zpp.block, bits=zpp.qgz_bits)
            )
        with np.errstate(over="ignore", invalid="ignore"):
            out.update({k: v.copy() for k, v in lay.unflatten(stream.result()).items()})
    return out
