"""Notebook 08's logic: the bytes each rank sends inside its node and across nodes, for stages 0-3
and ZeRO++'s schemes (counted by the engine, and derived), and the quantization error of qwZ and
qgZ on real weights and gradients against its bound (reference/quantize.py, reference/zeropp.py).

Legend: N ranks, R ranks per node (node-major), k = N/R nodes, L a unit's shard (padded), e = 2
bytes (bf16), B the quantization block, M = e·Ψ bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from measure.parts import zeropp_links as zv

N, R = zv.WORLD, zv.PER_NODE
BLOCK = zv.COUNTED_BLOCK
SCHEMES = ("stage 0", "stage 1", "stage 2", *zv.SCHEMES)
"""Stages 0-2 (plain, M = N, deterministic), then stage 3's: ZeRO-3, hpZ, qwZ, qgZ, ZeRO++."""
FLAGS = {**{f"stage {s}": {"stage": s} for s in (0, 1, 2)}, **zv.ENGINE_FLAGS}
"""Each scheme's ZeroConfig flags over measure/parts/zeropp_links.py's counted_step's."""
CURVE = Path(__file__).resolve().parents[2] / "paper_figures" / "measured" / "zeropp_curve.json"


def analytic(scheme: str) -> list[tuple[int, int]]:
    """(intra, inter) bytes each local rank of a node sends in one step, derived.

    Stages 0-2 (deterministic, M = N): two ring collectives over the world per unit, root
    included (a reduce-scatter of the gradients and an all-gather, of the gradients at stage 0
    and of the updated parameters at 1-2), each (N-1)·e·L, all of it across nodes from a node's
    last rank and inside the node from the others. Stage 3's schemes: zeropp_volume's
    derivation, at blocks of B."""
    units = zv.model_units(N)
    if scheme.startswith("stage"):
        ring = 2 * (N - 1) * zv.ELEM * sum(u.shard for u in units)
        return [(ring, 0)] * (R - 1) + [(0, ring)]
    return zv.step_traffic(scheme, units, zv.Cluster(N, R, BLOCK))["ranks"]


def counted(scheme: str) -> list[tuple[int, int]]:
    """(intra, inter) bytes each of the N gloo ranks sent in one step, from the engine's
    counter (zeropp_links.counted_step, ranks_per_node = R)."""
    from zero.ranks.local import get_pool

    got = get_pool(N).run(zv.counted_step, R, FLAGS[scheme], timeout_s=240)
    return [tuple(r["links"]) for r in got]


def m_bytes() -> int:
    """M = e·Ψ of the counted GPT."""
    return zv.ELEM * sum(u.numel for u in zv.model_units(N))


def volume_table(rows: dict) -> str:
    """rows: scheme -> (counted per rank, analytic per local rank). A table of the node's bytes."""
    from .common import markdown_table

    m, lines = m_bytes(), []
    for scheme, (got, want) in rows.items():
        node = got[:R]
        inter = sum(b for _, b in node)
        intra = max(a for a, _ in node)
        same = "yes" if got == [tuple(x) for x in want] * (N // R) else "NO"
        lines.append([scheme, f"{inter:,}", f"{inter / m:.3f}", f"{intra:,}", f"{intra / m:.3f}",
                      same])  # fmt: skip
    header = ["scheme", "node → other nodes (B)", "(×M)", "busiest rank, inside (B)", "(×M)",
              "counted = analytic on every rank"]  # fmt: skip
    return markdown_table(header, lines)


def padded_flat(tensors) -> np.ndarray:
    """float32 tensors as one vector, each zero-padded to a multiple of B (as the layout aligns
    every parameter to 128 elements, so blocks never straddle two)."""
    parts = []
    for t in tensors:
        x = np.asarray(t.detach().float().cpu().numpy(), dtype=np.float32).ravel()
        parts += [x, np.zeros(-x.size % BLOCK, dtype=np.float32)]
    return np.concatenate(parts)


def qwz_error(x: np.ndarray, bits: int) -> dict:
    """qwZ's error on the weights x: |x - q_B(x)| against reference/quantize.py's error_bound,
    and the engine's quantizer (zero/stages/zeropp.py encode/decode) against the reference's."""
    import torch

    from reference.quantize import error_bound
    from reference.zeropp import roundtrip
    from zero.stages.zeropp import decode, encode

    q = roundtrip(x, block=BLOCK, bits=bits)
    err = np.abs(x.astype(np.float64) - q.astype(np.float64))
    bound = error_bound(x, block=BLOCK, bits=bits)
    engine = decode(encode(torch.from_numpy(x), BLOCK, bits), x.size, BLOCK, bits).numpy().ravel()
    return {
        "ratio": err / bound,
        "worst": float(np.max(err / bound)),
        "rel_l2": float(np.linalg.norm(err) / np.linalg.norm(x)),
        "engine_same_bits": bool(np.array_equal(engine.view(np.uint32), q.view(np.uint32))),
    }


def rank_gradients(seed: int = 0, batch_size: int = 8) -> list[np.ndarray]:
    """The N ranks' fp32 gradients of the counted GPT at its initial weights, one micro-batch
    each (gpt_microbatches, data step 0), as padded flat vectors."""
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    cfg = GPTConfig(**zv.MODEL)
    model = GPT(cfg, seed=seed)
    out = []
    for idx, targets in gpt_microbatches(
        cfg, seed=seed, data_step=0, count=N, batch_size=batch_size
    ):
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        out.append(padded_flat(p.grad for p in model.parameters()))
    return out


def qgz_error(xs: list[np.ndarray], bits: int) -> dict:
    """qgZ's two-hop sum S (reference/zeropp.py qgz_sum, which the engine reproduces bit for bit)
    against the exact sum (float64), beside its bound qgz_error_bound."""
    from reference.zeropp import qgz_error_bound, qgz_sum

    s = qgz_sum(xs, per_node=R, block=BLOCK, bits=bits).astype(np.float64)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    err = np.abs(s - exact)
    bound = qgz_error_bound(xs, per_node=R, block=BLOCK, bits=bits)
    live = bound > 0
    return {
        "ratio": err[live] / bound[live],
        "worst": float(np.max(err[live] / bound[live])),
        "rel_l2": float(np.linalg.norm(err) / np.linalg.norm(exact)),
        "exact_where_no_bound": bool(np.all(err[~live] == 0)),
    }


def load_curve(path: Path = CURVE) -> dict:
    """The committed loss-curve measurement (measure/parts/zeropp_curve.py)."""
    return json.loads(path.read_text(encoding="utf-8"))
