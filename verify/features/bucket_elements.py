"""ZeRO-R's C_B (ZeroConfig.bucket_elements): reduce-scatters in pieces of at most this many
elements, through constant-size buffers (zero/zero_r/buckets.py)."""

from __future__ import annotations

from .record import Bug, Feature, Pair


def plant_half_width_pieces(p) -> None:
    """C_B pieces half as wide as allowed: twice the reduce-scatter calls."""
    from zero.zero_r.buckets import ConstantBuffers

    original = ConstantBuffers.__init__

    def init(self, elements, world_size):
        original(self, elements, world_size)
        self.width = max(1, self.width // 2)

    p.setattr(ConstantBuffers, "__init__", init)


def plant_piece_drops_boundary(p) -> None:
    """Each C_B piece's last column is not reduced."""
    from zero.zero_r.buckets import ConstantBuffers

    original = ConstantBuffers.reduce_scatter

    def reduce_scatter(self, ctx, u, fn, flat, grads, tag):
        n = ctx.world_size

        def dropping(buf, **kw):
            cols = buf.view(n, -1)
            if cols.shape[1] > 1:  # each piece's last column is lost at the boundary
                cols[:, -1] = 0
            return fn(buf, **kw)

        return original(self, ctx, u, dropping, flat, grads, tag)

    p.setattr(ConstantBuffers, "reduce_scatter", reduce_scatter)


def _elements(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"bucket_elements={text}: allowed is an integer >= 1")
    return value


FEATURE = Feature(
    name="bucket_elements",
    doc="ZeRO-R's C_B: reduce-scatters in pieces of at most this many elements",
    config=lambda value: {"bucket_elements": value},
    parse=_elements,
    absent=None,
    branches={"bucket_elements (C_B pieces)": lambda c: c.bucket_elements is not None},
    pairs=(
        Pair("C_B × stage 2-3", "pieces filled straight from the parameters' gradients",
             "cells", lambda c: c.bucket_elements is not None and c.stage >= 2),
    ),
    bugs=(
        # the counted reduce-scatter calls of C_B cells
        Bug(name="half_width_pieces", breaks="C_B pieces half as wide as allowed",
            where="bucket_elements set (reduce-scatter calls)", plant=plant_half_width_pieces,
            observable=lambda c: c.bucket_elements is not None, check="traffic"),
        # the dropped column changes R, and so the reported norm of the first step
        Bug(name="piece_drops_boundary", breaks="C_B: each piece's last column is not reduced",
            where="deterministic, bucket_elements set", plant=plant_piece_drops_boundary,
            observable=lambda c: c.mode == "deterministic" and c.bucket_elements is not None,
            check="reported"),
    ),
)  # fmt: skip
