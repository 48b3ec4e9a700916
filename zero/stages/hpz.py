"""ZeRO++'s hpZ for stage 3: a secondary partition of the working parameters inside each node,
so that the backward all-gather stays inside the node (docs/design.md §3.13, "hpZ").

Legend: N ranks, R ranks per node (node-major: rank r on node r // R, zero/ranks/nodes.py), a
unit's padded flat buffer N·L elements, P = N·L/R its secondary part, j = r mod R this rank's
place in its node. When a unit is gathered for its forward, rank r copies part j of the
gathered buffer, [j·P, (j+1)·P), into a buffer of its own (compute dtype, allocated at
construction); the unit's backward all-gather then gathers the R parts over the node's group
instead of the N shards over the world: (R-1)·P elements sent per call, none across nodes.

[Note: hpZ's secondary shards] The parts are copies of the values this micro-step's forward
gathered, so backward sees the same bits either way and training is bitwise that of plain
stage 3. A part is valid only from the forward gather that wrote it to the end of its
micro-step (end_microstep forgets it; so does the update). A unit gathered in backward without
a forward gather of the same micro-step takes the ordinary gather over the world; so does a
frozen unit, which keeps no part. The root keeps none either: it stays gathered from its
forward to the end of backward, so it is never gathered for backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives as C
from ..unit import FlatUnit


class HpZ:
    """The node groups and the secondary parts of one engine's stage-3 units."""

    def __init__(self, ctx, nodes):
        self.ctx, self.counter, self.nodes = ctx, ctx.counter, nodes
        world = dist.get_world_size()
        if ctx.world_size != world:
            raise ValueError(
                f"hpz=True: the engine's group has {ctx.world_size} of the world's {world} "
                "ranks (model parallelism, or a subgroup); hpZ partitions over the world's "
                "nodes, so it is allowed only when the engine's group is the whole world"
            )
        self.per_node, self.j = nodes.per_node, nodes.j  # R, and this rank's place in its node

    # [Note: one node's group] dist.new_group must be called by every rank of the world, for
    # every group, in one order. The groups are created at the first unit's allocation (every
    # rank allocates the same units in the same order), node by node (zero/stages/zeropp.py's
    # NodeGroups); a rank keeps its own. With one node the node's group is the engine's group,
    # the world: then hpZ changes no byte of traffic and only adds the parts' memory.

    def node_group(self):
        return self.nodes.node()

    def part(self, u: FlatUnit) -> slice:
        """This rank's secondary part of u's padded buffer: [j·P, (j+1)·P)."""
        p = u.part.padded_numel // self.per_node
        return slice(self.j * p, (self.j + 1) * p)

    def allocate(self, u: FlatUnit) -> None:
        """A part for u, unless u is the root: it stays gathered from its forward to the end
        of backward (zero/stages/stage3.py), so it is never gathered for backward."""
        self.node_group()
        if not u.name:
            return
        size = u.part.padded_numel // self.per_node
        u.secondary = torch.empty(size, dtype=u.working.dtype, device=u.working.device)  # 1D, P
        u.hpz_fresh = False  # whether it holds this micro-step's forward values

    def keep(self, u: FlatUnit) -> None:
        """u was just gathered for its forward: copy this rank's part ([Note: hpZ's secondary
        shards])."""
        if hasattr(u, "secondary"):
            u.secondary.copy_(u.working[self.part(u)])
            u.hpz_fresh = True

    def forget(self, u: FlatUnit) -> None:
        if hasattr(u, "secondary"):
            u.hpz_fresh = False

    def serves(self, u: FlatUnit, phase: str) -> bool:
        """Whether this gather of u comes from the node's parts: backward, after a forward
        gather of this micro-step."""
        return phase == "param_bwd" and getattr(u, "hpz_fresh", False)

    def padding(self, u: FlatUnit) -> int:
        """Padding elements a node all-gather sends from this rank: those of its part (the
        padded layout's elements outside every parameter), to R - 1 ranks."""
        sl = self.part(u)
        real = sum(
            max(0, min(s.offset + s.numel, sl.stop) - max(s.offset, sl.start))
            for s in u.part.layout.slots
        )
        return (self.per_node - 1) * (sl.stop - sl.start - real)

    def all_gather(self, u: FlatUnit, out: torch.Tensor, tag: dict, async_op: bool) -> C.Pending:
        """out (N·L) <- the node's R parts in node order: (R-1)·P elements sent, intra-node."""
        kw = {"group": self.node_group(), "counter": self.counter, "async_op": async_op}
        return C.all_gather(out, u.secondary, padding=self.padding(u), tag=tag, **kw)
