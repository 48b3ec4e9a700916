"""ZeRO++'s volume per link, analytic and counted, for paper_figures/zeropp_volume.py (which
derives every formula here in its docstring), notebooks/teaching/nodes.py and
measure/parts/zeropp_curve.py: the schemes and their engine flags, the counted GPT and layout,
a step's bytes per local rank and link by the stated algorithms ([Note: traffic per link] in
zero/common/traffic.py), and one counted stage-3 step on the engine.

Legend: N ranks, R per node (node-major), k = N/R nodes, L a unit's shard (padded), B the
quantization block, e bytes per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEMES = ("ZeRO-3", "hpZ", "qwZ", "qgZ", "ZeRO++")
USES = {
    "ZeRO-3": (),
    "hpZ": ("hpZ",),
    "qwZ": ("qwZ",),
    "qgZ": ("qgZ",),
    "ZeRO++": ("qwZ", "hpZ", "qgZ"),
}
MODEL = {"vocab_size": 64, "block_size": 32, "n_layer": 4, "n_head": 2, "n_embd": 64}
"""The counted GPT: comm_volume's (four blocks and a root of 3% of Ψ)."""
WORLD, PER_NODE, CHUNK, BLOCK, ELEM = 4, 2, 128, 256, 2
"""The counted layout: 2 nodes x 2 ranks; 128-element chunks; bf16. BLOCK: the limits' qwZ/qgZ
block."""
COUNTED_BLOCK = 128
"""The counted layout's block: it must divide the 128-element chunk (zero/config.py)."""
QWZ_BITS, QGZ_BITS = 8, 4
"""ZeRO++'s widths: int8 weights, int4 gradients."""
ALIGN = 128
"""Every parameter's offset in its unit is a multiple of 128 elements (reference/layout.py)."""
COLLECTIVES = ("forward all-gather", "backward all-gather", "gradient reduction")
_QWZ = {"qwz_bits": QWZ_BITS, "quant_block": COUNTED_BLOCK}
_QGZ = {"qgz_bits": QGZ_BITS, "quant_block": COUNTED_BLOCK, "reduce_dtype": "fp32"}
ENGINE_FLAGS: dict[str, dict] = {
    "ZeRO-3": {},
    "hpZ": {"hpz": True},
    "qwZ": _QWZ,
    "qgZ": _QGZ,
    "ZeRO++": {"hpz": True, **_QWZ, **_QGZ},
}
"""Every scheme's ZeroConfig flags over counted_step's (which reduce in bf16): each is counted
and set beside its analytic row. qgZ reduces quantized float32 gradients, so it asks
reduce_dtype='fp32' (zero/config.py refuses bf16); its wire bytes do not depend on it."""
PAPER_SCALE = (384, 16)
"""384 GPUs (ZeRO++'s evaluation) taken as 24 nodes of 16 (docs/paper.md §3)."""


@dataclass(frozen=True)
class Cluster:
    """N ranks, R per node (node-major), quantization blocks of B, e bytes per element."""

    world: int
    per_node: int
    block: int = BLOCK
    elem: int = ELEM

    def __post_init__(self):
        if self.world < 1 or self.per_node < 1 or self.world % self.per_node or self.block < 1:
            raise ValueError(f"{self}: needs N, R, B >= 1 with R dividing N")

    @property
    def nodes(self) -> int:
        return self.world // self.per_node


@dataclass(frozen=True)
class Unit:
    """A unit's shard length L (padded), real parameters, and whether backward gathers it again
    (False: the root unit, gathered once per micro-step)."""

    shard: int
    numel: int
    twice: bool = True


def qbytes(n: int, bits: int, block: int) -> int:
    """Bytes of n values at `bits` bits (packed) plus one fp32 scale per block of `block`."""
    return math.ceil(n * bits / 8) + 4 * math.ceil(n / block)


def _ring(sent: int, c: Cluster, *, world: bool) -> list[tuple[int, int]]:
    """(intra, inter) per local rank of a node: a ring, each member sending `sent` bytes to the
    next; over the world the node's last rank's next is on the next node (when k > 1)."""
    if world and c.nodes > 1:
        return [(sent, 0)] * (c.per_node - 1) + [(0, sent)]
    return [(sent, 0)] * c.per_node


def collectives(scheme: str, u: Unit, c: Cluster) -> dict[str, list[tuple[int, int]]]:
    """One unit's bytes per collective: (intra, inter) for each local rank of a node."""
    uses, n, r, k, e = USES[scheme], c.world, c.per_node, c.nodes, c.elem
    gather = (n - 1) * (qbytes(u.shard, QWZ_BITS, c.block) if "qwZ" in uses else e * u.shard)
    out = {COLLECTIVES[0]: _ring(gather, c, world=True)}
    if not u.twice:
        out[COLLECTIVES[1]] = [(0, 0)] * r
    elif "hpZ" in uses:
        out[COLLECTIVES[1]] = _ring((r - 1) * e * k * u.shard, c, world=False)
    else:
        out[COLLECTIVES[1]] = _ring(gather, c, world=True)
    if "qgZ" in uses:
        q = QGZ_BITS
        hop = ((r - 1) * qbytes(k * u.shard, q, c.block), (k - 1) * qbytes(u.shard, q, c.block))
        out[COLLECTIVES[2]] = [hop] * r
    else:
        out[COLLECTIVES[2]] = _ring((n - 1) * e * u.shard, c, world=True)
    return out


def step_traffic(scheme: str, units: list[Unit], c: Cluster) -> dict:
    """A step's bytes: per local rank (intra, inter), per collective the node's inter-node bytes,
    the node's totals, and M = e·Ψ."""
    ranks = [[0, 0] for _ in range(c.per_node)]
    node_inter = dict.fromkeys(COLLECTIVES, 0)
    for u in units:
        for name, per in collectives(scheme, u, c).items():
            node_inter[name] += sum(inter for _, inter in per)
            for i, (intra, inter) in enumerate(per):
                ranks[i][0] += intra
                ranks[i][1] += inter
    return {
        "ranks": [tuple(x) for x in ranks],
        "node_inter_by_collective": node_inter,
        "node_inter": sum(inter for _, inter in ranks),
        "node_intra": sum(intra for intra, _ in ranks),
        "m_bytes": c.elem * sum(u.numel for u in units),
    }


def unit_shards(shapes: dict[str, int], unit_names: list[str], n: int, chunk: int) -> list[Unit]:
    """The units of a model from its parameters' sizes (name -> numel, in order) by
    reference/layout.py's rule, derived here apart from the engine: each offset aligned to
    ALIGN, the extent rounded up to whole chunks, L = ceil(chunks / N)·chunk. A parameter is in
    the unit whose name prefixes it, else in the root (gathered once)."""
    groups: dict[str, list[int]] = {name: [] for name in [*unit_names, ""]}
    for pname, numel in shapes.items():
        owner = next((u for u in unit_names if pname.startswith(u + ".")), "")
        groups[owner].append(numel)
    units = []
    for name, sizes in groups.items():
        extent = sum(math.ceil(s / ALIGN) * ALIGN for s in sizes)
        chunks = math.ceil(extent / chunk)
        units.append(Unit(math.ceil(chunks / n) * chunk, sum(sizes), twice=bool(name)))
    return units


def model_units(n: int = WORLD) -> list[Unit]:
    from zero.workloads.models import GPT, GPTConfig

    model = GPT(GPTConfig(**MODEL), seed=0)
    shapes = {name: p.numel() for name, p in model.named_parameters()}
    return unit_shards(shapes, model.unit_names(), n, CHUNK)


def counted_step(rank: int, n: int, ranks_per_node: int, flags: dict | None = None) -> dict:
    """One stage-3 step of the MODEL GPT (bf16, M = N) with the ZeroConfig `flags` of a scheme
    (ENGINE_FLAGS, over the defaults here); this rank's counted bytes per link. Runs in a pool
    worker."""
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    cfg = GPTConfig(**MODEL)
    model = GPT(cfg, seed=0)
    base = {"stage": 3, "precision": "bf16", "reduce_dtype": "bf16", "optimizer": "adam",
            "micro_batches": n, "chunk": CHUNK, "units": tuple(model.unit_names()),
            "ranks_per_node": ranks_per_node}  # fmt: skip
    engine = ZeroEngine(model, ZeroConfig(**{**base, **(flags or {})}))
    batches = gpt_microbatches(cfg, seed=0, data_step=0, count=n, batch_size=2)
    _, loss = engine(*batches[rank])
    engine.backward(loss)
    engine.step()
    step = engine.counter.step - 1
    records = engine.counter.of_step(step)
    return {
        "links": list(engine.counter.link_volume(step)),
        "nbytes": sum(r.nbytes for r in records),
        "ops": sorted({r.op for r in records}),
    }
