"""Gradient injection: gradients drawn at will, fed straight into the engine's gradient path.

Backward only ever produces the gradients a model produces. Injection skips it
(ZeroEngine.inject_gradients) so that partitioning, communication, the overflow path and the
optimizer see what no model would give them: subnormals, values a hair below the fp16 maximum,
exact zeros of both signs, inf and NaN on one rank only. A cell's gradients are a pure function
of a `GradientDraw` (seed, exponent range, special values at chosen places), so every rank
materialises the same M micro-batches for the reference, and a hypothesis-drawn GradientDraw is
shipped to the ranks as a small picklable value (the draws happen in the parent; docs/design.md §4).

Legend: M micro-batches per step, j one of them (run by rank j mod N at micro-step j div N),
S the loss scale. Injected gradients are those of the *scaled* loss (what backward of S·loss
leaves in .grad), in the compute dtype.

Models without a forward: `ParamModel` is a bag of parameters in units (submodules), with shapes
from a `PLANS` entry. "even" shapes have element counts divisible by 24 (so by every N in
{1, 2, 3, 4, 8}); "uneven" ones are products of primes above 3, so numel % N != 0 for every N > 1
and parameters straddle shard boundaries at every unit size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from reference.precision import DTYPES, cast
from zero.workloads.models import stable_seed

# unit name -> shapes; the root unit ("") holds what is listed under "".
PLANS: dict[str, dict[str, tuple[tuple[int, ...], ...]]] = {
    "even": {
        "a": ((24, 32), (96,)),
        "b": ((48, 16), (24,), (8, 3, 16)),
        "": ((72,), (24, 8)),
    },
    "uneven": {
        "a": ((37, 29), (13,)),
        "b": ((5, 7, 7), (1,), (131,)),
        "c": ((61, 17),),
        "": ((11,), (7, 11)),
    },
}

# The largest finite value of each compute dtype and its smallest subnormal.
FINITE_MAX = {
    "fp32": float(np.finfo(np.float32).max),
    "bf16": 3.3895313892515355e38,
    "fp16": 65504.0,
}
SMALLEST_SUBNORMAL = {"fp32": 2.0**-149, "bf16": 2.0**-133, "fp16": 2.0**-24}
FP16_MAX = 65504.0


class ParamModel(nn.Module):
    """Parameters only, in one submodule per unit of the plan; values N(0, 1/4) from
    (seed, name), so they are the same on every rank and at every world size."""

    def __init__(self, plan: str, *, seed: int = 0):
        super().__init__()
        if plan not in PLANS:
            raise ValueError(f"plan={plan!r}: allowed are {sorted(PLANS)}")
        self.plan = plan
        for unit, shapes in PLANS[plan].items():
            holder = self if unit == "" else nn.Module()
            for i, shape in enumerate(shapes):
                name = f"{unit}.p{i}" if unit else f"p{i}"
                g = torch.Generator().manual_seed(stable_seed("param-model", seed, name))
                holder.register_parameter(
                    f"p{i}", nn.Parameter(0.5 * torch.randn(shape, generator=g))
                )
            if unit:
                self.add_module(unit, holder)

    def unit_names(self) -> list[str]:
        return [u for u in PLANS[self.plan] if u]


@dataclass(frozen=True, kw_only=True)
class GradientDraw:
    """Everything that decides a cell's injected gradients.

    Bulk values are ±2^(e + f) with e an integer drawn per element from `exponents` and f
    uniform in [0, 1), clipped to the compute dtype's largest finite value, with a random sign
    and a `zeros` fraction of exact zeros. `specials` then overwrite single elements:
    (step, micro-batch j, parameter index, element index, value as float.hex(), which keeps
    inf, NaN and subnormals exact in JSON). Indices wrap around (modulo) the real counts.
    """

    seed: int = 0
    exponents: tuple[int, int] = (-6, 2)
    zeros: float = 0.0
    specials: tuple[tuple[int, int, int, int, str], ...] = ()

    def __post_init__(self):
        lo, hi = self.exponents
        if lo > hi:
            raise ValueError(f"exponents={self.exponents}: need low <= high")
        if not 0.0 <= self.zeros <= 1.0:
            raise ValueError(f"zeros={self.zeros}: must be in [0, 1]")
        for s in self.specials:
            float.fromhex(s[4])  # a malformed value fails here, naming itself

    def materialise(
        self, step: int, names: list[str], shapes: dict[str, tuple], m: int, precision: str
    ) -> list[dict[str, np.ndarray]]:
        """The M micro-batch gradients of `step`: [{name: array in the compute dtype}]."""
        rng = np.random.default_rng([self.seed, step])
        lo, hi = self.exponents
        top = FINITE_MAX[precision]
        out = []
        for _ in range(m):
            g = {}
            for name in names:
                n = math.prod(shapes[name])
                mag = np.exp2(rng.integers(lo, hi + 1, n) + rng.random(n))
                x = np.minimum(mag, top) * rng.choice(np.array([-1.0, 1.0]), n)
                if self.zeros:
                    x[rng.random(n) < self.zeros] = 0.0
                g[name] = cast(x.reshape(shapes[name]), precision)
            out.append(g)
        for s, j, p, e, value in self.specials:
            if s != step:
                continue
            name = names[p % len(names)]
            flat = out[j % m][name].reshape(-1)
            flat[e % flat.size] = DTYPES[precision].type(float.fromhex(value))
        return out


def draw_for(kind: str, precision: str, *, seed: int, world_size: int, micro_batches: int):
    """The matrix's three kinds of injected gradients, as GradientDraws.

    random     magnitudes 2^-6 .. 2^3, no specials; in fp16 2^8 .. 2^15: gradients of a loss
               scaled by S = 2^16, so that after unscaling they are as large as in the other
               precisions and clipping still has something to clip.
    extreme    magnitudes from the compute dtype's smallest subnormal up to the fp16 maximum
               (for every precision: the fp16 range is where mixed precision lives), 10% exact
               zeros, and exact specials: 65504, the smallest subnormal, -0.0, on several
               micro-batches and so on several ranks.
    nonfinite  as random, plus +inf in step 0 on the last micro-batch (so on rank N-1 only) and
               NaN in step 2 on micro-batch 0 (rank 0): two skipped steps, steps 1 and 3 clean.
    """
    last = micro_batches - 1
    bulk = (8, 14) if precision == "fp16" else (-6, 2)
    if kind == "random":
        return GradientDraw(seed=seed, exponents=bulk)
    if kind == "extreme":
        low = int(math.log2(SMALLEST_SUBNORMAL[precision]))
        tiny, big = SMALLEST_SUBNORMAL[precision].hex(), FP16_MAX.hex()
        specials = tuple(
            (step, j, p, e, v)
            for step in range(4)
            for j, p, e, v in (
                (0, 0, 0, big),
                (last, 1, 3, big),
                (world_size // 2, 2, 5, tiny),
                (last, 0, 7, (-0.0).hex()),
            )
        )
        return GradientDraw(seed=seed, exponents=(low, 15), zeros=0.1, specials=specials)
    if kind == "nonfinite":
        specials = ((0, last, 0, 11, float("inf").hex()), (2, 0, 1, 3, float("nan").hex()))
        return GradientDraw(seed=seed, exponents=bulk, specials=specials)
    raise ValueError(f"gradients={kind!r}: allowed are 'random', 'extreme', 'nonfinite'")


def to_torch(x: np.ndarray) -> torch.Tensor:
    """A NumPy array of fp32/fp16/bf16 (ml_dtypes) as a torch tensor with the same bits."""
    if x.dtype == DTYPES["bf16"]:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))
