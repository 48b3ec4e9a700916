"""ZeRO++'s quantized collectives for stage 3 (ZeroConfig.qwz_bits, qgz_bits): the bits of
reference/zeropp.py, on torch.distributed (docs/design.md §3.13).

Legend: N ranks, R ranks per node (node-major, zero/ranks/nodes.py), K = N/R nodes, j = r mod R
a rank's place in its node and a = r // R its node, L a unit's shard, B the block, b the bits.

[Note: quantized wire] A quantized piece of n elements travels as one byte buffer: its n values,
b bits each (int8 as is; int4 two to a byte, the even element in the low nibble), then its n/B
float32 scales as bytes. One collective per hop carries both, and its counted elements are
these bytes (CommRecord dtype uint8). The pieces are whole blocks (B divides every shard), so
q and the scales of a piece are those of the whole buffer restricted to it.

- qwZ, a gather for forward or backward: each rank quantizes its shard, the N pieces are
  all-gathered ((N-1)·(b·L/8 + 4L/B) bytes sent), and every rank dequantizes all of them, its own
  included, into the unit's buffer in the compute dtype ([Note: qwZ's values]).
- qgZ, a micro-step's gradient reduction: hop 1 sends node peer j' the K shards it will own
  (those of ranks j' + R·k) with one all-to-all over the node's R ranks, and sums the R received
  pieces by the tree; hop 2 quantizes those K partial shards and sends shard k to node k with
  one all-to-all over the K ranks of local index j, then sums the K received ([Note: qgZ's
  sum]). Hop 1 sends (R-1)·(b·K·L/8 + 4K·L/B) bytes, all inside the node (phase "grad_node");
  hop 2 (K-1)·(b·L/8 + 4L/B), all across nodes ("grad_across"). A hop over one rank is skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.quantize import QMAX
from reference.tree import tree_sum

from .. import collectives as C

F32_MAX = torch.finfo(torch.float32).max


def quantize(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scales float32) of a float32 vector of whole blocks: reference/quantize.py's
    [Note: block quantization], operation for operation (one rounding each)."""
    qmax = QMAX[bits]
    xb = x.view(-1, block)
    m = xb.abs().amax(dim=1)  # NaN where a block holds one (amax propagates it), inf where inf
    scale = m / qmax
    live = torch.isfinite(scale) & (scale > 0)
    t = torch.where(live[:, None], xb / torch.where(live, scale, 1.0)[:, None], 0.0)
    return torch.round(t).clamp_(-qmax, qmax).to(torch.int8).view(-1), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """clamp(q·s, -F, F) per block, float32 (NaN through a block whose scale is not finite)."""
    d = q.to(torch.float32).view(-1, block) * scale[:, None]
    return d.clamp_(-F32_MAX, F32_MAX).view(-1)


def encode(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """x (float32, rows of whole blocks: 1-D or [pieces, n]) -> uint8 [pieces, n·b/8 + 4n/B]
    ([Note: quantized wire])."""
    rows = x.view(-1, x.shape[-1]) if x.dim() > 1 else x.view(1, -1)
    n = rows.shape[1]
    q, scale = quantize(rows.reshape(-1), block, bits)
    q = q.view(rows.shape[0], n)
    if bits == 4:
        u = q.view(torch.uint8) & 0xF
        q = (u[:, 0::2] | (u[:, 1::2] << 4)).view(torch.int8)
    s = scale.view(rows.shape[0], n // block).contiguous().view(torch.uint8)
    return torch.cat([q.view(torch.uint8), s], dim=1)


def decode(buf: torch.Tensor, n: int, block: int, bits: int) -> torch.Tensor:
    """uint8 [pieces, n·b/8 + 4n/B] -> float32 [pieces, n] (dequantized)."""
    qbytes = n * bits // 8
    q = buf[:, :qbytes]
    if bits == 4:
        lo, hi = (q & 0xF).to(torch.int16), (q >> 4).to(torch.int16)
        nib = torch.stack([lo, hi], dim=2).view(buf.shape[0], n)
        q = torch.where(nib >= 8, nib - 16, nib).to(torch.int8)
    else:
        q = q.contiguous().view(torch.int8)
    scale = buf[:, qbytes:].contiguous().view(torch.float32).reshape(-1)
    return dequantize(q.reshape(-1), scale, block).view(buf.shape[0], n)


def refuse_subgroup(ctx) -> None:
    """qwZ and qgZ where the engine's group is not the whole world: refused by name."""
    for name in ("qgz_bits", "qwz_bits"):
        if getattr(ctx.config, name) and ctx.world_size != dist.get_world_size():
            raise ValueError(
                f"{name}={getattr(ctx.config, name)}: the engine's group has {ctx.world_size} "
                f"of the world's {dist.get_world_size()} ranks (model parallelism, or a "
                "subgroup); ZeRO++'s quantized collectives are built and verified over the "
                "world's nodes only, so they are allowed only when the engine's group is the "
                "whole world"
            )


class NodeGroups:
    """The process groups of a node layout: this rank's node (R ranks) and its column (the K
    ranks of local index j). [Note: one node's group] in zero/stages/hpz.py: every rank creates
    every group, in one order, at the first unit's allocation."""

    def __init__(self, ctx):
        self.ctx = ctx
        layout = ctx.counter.layout  # the world's nodes (zero/ranks/nodes.py), set at _join
        n = ctx.world_size
        self.per_node = n if layout is None else layout.ranks_per_node  # R
        self.nodes = n // self.per_node  # K
        self.j, self.a = ctx.rank % self.per_node, ctx.rank // self.per_node
        self._node = self._column = None
        self._made = False

    def _make(self) -> None:
        if self._made:
            return
        R, K, me = self.per_node, self.nodes, self.ctx.rank
        self._node = self._column = self.ctx.group if K == 1 or R == 1 else None
        if 1 < R < self.ctx.world_size:
            for k in range(K):
                g = dist.new_group(list(range(k * R, (k + 1) * R)))
                if k == me // R:
                    self._node = g
            for j in range(R):
                g = dist.new_group(list(range(j, self.ctx.world_size, R)))
                if j == me % R:
                    self._column = g
        self._made = True

    def node(self):
        """The node's group (the engine's group when there is one node)."""
        self._make()
        return self._node

    def column(self):
        """The K ranks of this local index, one per node (the engine's group when R = 1)."""
        self._make()
        return self._column

    make = _make


def qwz_all_gather(ctx, u, out, shard, tag: dict, async_op: bool) -> C.Pending:
    """out (N·L, compute dtype) <- W' of every rank's shard ([Note: quantized wire])."""
    cfg, n = ctx.config, ctx.world_size
    block, bits, L = cfg.quant_block, cfg.qwz_bits, shard.numel()
    mine = encode(shard.to(torch.float32), block, bits).view(-1)
    gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=shard.device)
    pad = u.part.padding_gathered * bits // 8  # the padding's values (int4: rounded down)
    kw = {"group": ctx.group, "counter": ctx.counter, "async_op": async_op}
    pending = C.all_gather(gathered, mine, padding=pad, tag=tag, **kw)
    return pending.then(lambda g: out.copy_(decode(g.view(n, -1), L, block, bits).view(-1)))


def _all_to_all(send: torch.Tensor, group, counter, tag: dict, async_op: bool) -> C.Pending:
    """uint8 [D, w] -> [D, w]: row d to member d, row s received from member s."""
    d = send.shape[0]
    rec = C.count_call(counter, "all_to_all", (d - 1) * send.shape[1], 0, send, **tag)
    recv = torch.empty_like(send)
    work = C.launch(dist.all_to_all_single, recv, send, group=group, async_op=async_op, rec=rec)
    return C.Pending(work, lambda: recv, rec, (send,), group)


def qgz_reduce_scatter(ctx, nodes: NodeGroups, flat: torch.Tensor, tag: dict, async_op: bool):
    """This rank's shard (L, float32) of [Note: qgZ's sum] over the world's N·L buffers, as a
    Pending: hop 1 is launched now (asynchronously when async_op); hop 2 needs hop 1's sum, so
    it runs when the reduction is waited."""
    cfg, counter = ctx.config, ctx.counter
    block, bits = cfg.quant_block, cfg.qgz_bits
    R, K, L = nodes.per_node, nodes.nodes, flat.numel() // ctx.world_size
    shards = flat.view(K, R, L)  # shard of rank k·R + j' at [k, j']
    inside, across = {**tag, "phase": "grad_node"}, {**tag, "phase": "grad_across"}

    def hop2(partial: torch.Tensor, asynchronous: bool) -> C.Pending:
        send = encode(partial, block, bits)  # row k to node k
        pending = _all_to_all(send, nodes.column(), counter, across, asynchronous)
        return pending.then(lambda got: tree_sum(list(decode(got, L, block, bits).unbind(0))))

    if R == 1:  # one rank per node: hop 1 is skipped
        if K == 1:  # one rank: nothing travels (counted as the reduce-scatter of 0 elements)
            rec = C.count_call(counter, "reduce_scatter", 0, 0, flat, **tag)
            return C.Pending(None, lambda: flat.clone(), rec)
        return hop2(shards[:, 0, :], async_op)
    send = encode(shards.transpose(0, 1).reshape(R, K * L), block, bits)  # row j' to peer j'
    pending = _all_to_all(send, nodes.node(), counter, inside, async_op)

    def second(got: torch.Tensor) -> torch.Tensor:
        partial = tree_sum(list(decode(got, K * L, block, bits).unbind(0))).view(K, L)
        return partial[0].clone() if K == 1 else hop2(partial, False).wait()

    return pending.then(second)
