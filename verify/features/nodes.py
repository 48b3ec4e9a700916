"""Ranks on nodes (ZeroConfig.ranks_per_node, zero/ranks/nodes.py): one machine simulating
N / R nodes of R ranks, node-major, so that the counter splits every collective's bytes into
those staying inside a node and those crossing to another ([Note: traffic per link] in
zero/common/traffic.py). The layout changes where bytes go, never the bits: every cell with it
must stay bitwise, and its bytes per link are checked in every cell (verify.checks.verdict's
link check), here on layouts with more than one node."""

from __future__ import annotations

from .record import Bug, Feature


def _per_node(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"ranks_per_node={text}: allowed is an integer >= 1")
    return value


def plant_links_one_node(p) -> None:
    """The node layout dropped where collectives are counted: every byte counted as staying
    inside the node, whatever the layout. No bit moves; only the per-link check can see it."""
    from zero.ranks import nodes

    real = nodes.place

    def place(rec, group):
        if rec is not None:
            rec.layout = None
        return real(rec, group)

    p.setattr(nodes, "place", place)
    p.everywhere(real, place)


FEATURE = Feature(
    name="ranks_per_node",
    doc="ranks on simulated nodes of R ranks each (ZeroConfig.ranks_per_node=R)",
    config=lambda value: {"ranks_per_node": value},
    parse=_per_node,
    absent=None,
    needs=lambda c: (
        "" if c.world_size % c.ranks_per_node == 0
        else f"R={c.ranks_per_node} must divide the world size {c.world_size}"
    ),
    # 2 × 2 at stage 3 (every collective of ZeRO-3 crosses once per node), 4 × 1 at stage 1 (every
    # rank's bytes cross), 2 × 4 at stage 2 in fast mode
    quick=(
        dict(stage=3, precision="bf16", optimizer="adamw", world_size=4, accumulation=1,
             features=("ranks_per_node=2",), seed=6500),
        dict(stage=1, precision="fp32", optimizer="adam", world_size=4, accumulation=1,
             features=("ranks_per_node=1",), seed=6501),
        dict(stage=2, precision="bf16", optimizer="sgd", world_size=8, accumulation=1,
             mode="fast", features=("ranks_per_node=4",), seed=6502),
    ),
    branches={"ranks on more than one node": lambda c: (
        c.ranks_per_node is not None and c.ranks_per_node < c.world_size
    )},
    bugs=(
        Bug(name="links_one_node", breaks="the node layout ignored when bytes are split by link",
            where="ranks on more than one node", plant=plant_links_one_node, check="traffic",
            observable=lambda c: (
                c.ranks_per_node is not None and c.ranks_per_node < c.world_size
            )),
    ),
)  # fmt: skip
