"""ZeRO++'s communication volume by count: ZeRO-3, hpZ, qwZ, qgZ and all three (ZeRO++), per
step, inside a node and between nodes, beside ZeRO++'s claim (3M between nodes -> 0.75M).

Two kinds of rows. *Analytic*, for every scheme: derived below from the definitions, for the
algorithms zero/common/traffic.py's [Note: traffic per link] takes the collectives to use.
*Counted*, for every scheme (ENGINE_FLAGS, the ZeroConfig flags of each): a stage-3 step of a
small GPT on four gloo ranks simulated as two nodes of two (ZeroConfig.ranks_per_node = 2), each
rank's intra- and inter-node bytes read from the engine's counter (link_volume), set beside the
analytic bytes of the same Ψ, N and layout. The counted layout's shards are multiples of its
128-element chunk, and a quantization block must divide the chunk (zero/config.py
check_quantized), so the counted rows (and their analytic twins) use B = COUNTED_BLOCK = 128;
the limits use B = BLOCK = 256.

The derivation. One step at M = N (one micro-step per rank); per unit u of shard length L_u
(padded, N·L_u >= Ψ_u: reference/layout.py), every rank sends:
- forward all-gather, a ring over the world: N-1 shards, (N-1)·e·L_u bytes. qwZ: each owner
  quantizes its shard to int8 in blocks of B with one fp32 scale per block, and the scales travel
  with it ([Note: quantized wire] in zero/stages/zeropp.py): (N-1)·q8(L_u).
- backward all-gather, the same ring (none for the root unit, which stays gathered from its
  forward to the end of backward: docs/design.md §2). qwZ quantizes it too, as the forward's:
  (N-1)·q8(L_u) (reference/zeropp.py [Note: qwZ's values]; DeepSpeed passes its
  quantized-weights flag to backward gathers as well). hpZ: each rank keeps the 1/R slice of the
  forward's gathered unit (k·L_u elements, its secondary shard, in the compute dtype: with qwZ,
  the forward's dequantized W'), and the backward gathers those around a ring inside the node:
  (R-1)·e·k·L_u bytes, all intra-node, not quantized.
- gradient reduce-scatter, the ring over the world: (N-1)·e·L_u. qgZ: an all-to-all in two hops,
  int4: to each of its R-1 node peers one chunk of k·L_u values ((R-1)·q4(k·L_u), intra-node);
  after summing what it received, to the rank of its local index on each of the k-1 other nodes
  one chunk of L_u values ((k-1)·q4(L_u), inter-node).
with qb(n) = ceil(n·b/8) + 4·ceil(n/B) bytes: n values of b bits and one fp32 scale per B.
Links: a ring over the world in node order crosses nodes at each node's last rank, which sends
all its ring bytes inter-node while the other R-1 send theirs intra-node; a ring inside a node
and qgZ's first hop stay inside; qgZ's second hop crosses. A node's inter-node bytes are the sum
over its ranks (every node alike).

In units of M with no padding (N·ΣL = Ψ, B dividing L), a node's inter-node bytes per step are
(N-1)/N per fp16 ring collective; (N-1)/N·(1/2 + 2/B) for each of qwZ's int8 gathers (the
node's last rank sends (N-1)·(L + 4L/B) bytes, N·L = Ψ, M = 2Ψ); 0 for hpZ's backward gather;
and (k-1)/k·(1/4 + 2/B) for qgZ (R ranks, each (k-1)·(L/2 + 4L/B) bytes, R·L = Ψ/k). As N and
k grow:
    ZeRO-3   1 + 1 + 1                               = 3M
    hpZ      1 + 0 + 1                               = 2M
    qwZ      (1/2 + 2/B) + (1/2 + 2/B) + 1           = 2M + 4M/B
    qgZ      1 + 1 + (1/4 + 2/B)                     = 2.25M + 2M/B
    ZeRO++   (1/2 + 2/B) + 0 + (1/4 + 2/B)           = 0.75M + 4M/B
the scale overhead being exactly 4 bytes per B values, 2/B of M per quantized collective
(B = 256: 0.0078M). Intra-node, each rank sends (R-1)/R·M for hpZ's gather and
(R-1)/R·(1/4 + 2/B)·M for qgZ's first hop. Where a row differs from the claim: the scales; the
factors (N-1)/N and (k-1)/k, which only reach 1 at many ranks and nodes (at 2 x 2: 3/4 and 1/2);
padding (Ψ_padded/Ψ); the root unit's one gather (2Ψ_root, not 3Ψ_root); and the claim counts a
node's bytes over its link: the ring puts all of them on one rank, qgZ spreads them over R.
qwZ alone sits below its claim (2.5M: ZeRO-3's with only the forward gather's 1M halved, as the
claim's table credits it) because it quantizes the backward gather too; in ZeRO++ the backward
gather is hpZ's, inside the node, so the two agree there.

Legend: Ψ parameters, e = 2 bytes (bf16/fp16), M = e·Ψ, N ranks, R ranks per node, k = N/R
nodes (ranks node-major), L_u a unit's shard, B the quantization block.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from measure.parts.zeropp_links import (  # noqa: F401 (the figure's names, re-exported)
    ALIGN,
    BLOCK,
    CHUNK,
    COLLECTIVES,
    COUNTED_BLOCK,
    ELEM,
    ENGINE_FLAGS,
    MODEL,
    PAPER_SCALE,
    PER_NODE,
    QGZ_BITS,
    QWZ_BITS,
    SCHEMES,
    USES,
    WORLD,
    Cluster,
    Unit,
    collectives,
    counted_step,
    model_units,
    qbytes,
    step_traffic,
    unit_shards,
)
from paper_figures import paper
from paper_figures.common import Outputs, SummaryRow, compute_then_render, markdown_table
from zero.common.results import make_record, provenance, write_atomic

NAME = "zeropp_volume"


def limit(scheme: str, block: int) -> tuple[Fraction, Fraction, Fraction]:
    """A node's inter-node bytes per collective in M as N and k grow (module docstring)."""
    uses, q = USES[scheme], Fraction(2, block)
    gather = Fraction(QWZ_BITS, 16) + q if "qwZ" in uses else Fraction(1)
    return (
        gather,
        Fraction(0) if "hpZ" in uses else gather,
        Fraction(QGZ_BITS, 16) + q if "qgZ" in uses else Fraction(1),
    )


def claim(scheme: str) -> tuple[float, float, float]:
    """ZeRO++'s claim per collective (M): ZeRO-3's with each technique's collective replaced."""
    volume = list(paper.ZEROPP_VOLUME["ZeRO-3"])
    for technique in USES[scheme]:
        index, value = paper.ZEROPP_TECHNIQUE[technique]
        volume[index] = value
    return tuple(volume)


def compute(profile: str) -> dict:
    del profile  # one small case at every profile: seconds
    from zero.ranks.local import get_pool

    prov = provenance()
    records = []
    for scheme in SCHEMES:
        units = [Unit(1024 * BLOCK, PAPER_SCALE[0] * 1024 * BLOCK)]
        at_scale = step_traffic(scheme, units, Cluster(*PAPER_SCALE))
        lim = limit(scheme, BLOCK)
        result = {
            "limit": [str(f) for f in lim],
            "limit_total": float(sum(lim)),
            "claim": list(claim(scheme)),
            "paper_scale_total": at_scale["node_inter"] / at_scale["m_bytes"],
            "paper_scale_intra": max(i for i, _ in at_scale["ranks"]) / at_scale["m_bytes"],
        }
        config = {"scheme": scheme, "block": BLOCK, "paper_scale": list(PAPER_SCALE)}
        records.append(
            make_record(config=config, result=result, kind="zeropp.limit", provenance=prov)
        )
        exact = step_traffic(scheme, model_units(), Cluster(WORLD, PER_NODE, COUNTED_BLOCK))
        config = {
            "scheme": scheme,
            "model": MODEL,
            "world_size": WORLD,
            "ranks_per_node": PER_NODE,
            "chunk": CHUNK,
            "block": COUNTED_BLOCK,
        }
        records.append(
            make_record(config=config, result=exact, kind="zeropp.analytic", provenance=prov)
        )
    for scheme, flags in ENGINE_FLAGS.items():
        counted = get_pool(WORLD).run(counted_step, PER_NODE, flags, timeout_s=300)
        config = {"scheme": scheme, "flags": flags, "model": MODEL, "world_size": WORLD,
                  "ranks_per_node": PER_NODE, "chunk": CHUNK, "precision": "bf16",
                  "backend": "gloo"}  # fmt: skip
        result = {"ranks": counted}
        records.append(make_record(config=config, result=result, kind="zeropp.counted",
                                   provenance=prov))  # fmt: skip
    return {"section": NAME, "records": records}


def _of(payload: dict, kind: str) -> dict[str, dict]:
    return {r["config"]["scheme"]: r for r in payload["records"] if r["kind"] == kind}


def counted_summary(payload: dict, scheme: str = "ZeRO-3") -> dict:
    """A counted step against its analytic bytes: per rank, and a node's inter-node bytes."""
    rec = _of(payload, "zeropp.counted")[scheme]
    exact = _of(payload, "zeropp.analytic")[scheme]["result"]
    r = exact["ranks"]
    want = [list(r[i % len(r)]) for i in range(rec["config"]["world_size"])]
    got = [x["links"] for x in rec["result"]["ranks"]]
    per_node = rec["config"]["ranks_per_node"]
    return {
        "got": got,
        "want": want,
        "exact": got == want,
        "node_inter": sum(x[1] for x in got[:per_node]),
        "m_bytes": exact["m_bytes"],
        "machine": f"CPU, {rec['provenance'].get('cpu_count', '?')} cores, gloo",
    }


def _fmt(x) -> str:
    return f"{float(x):.4g}"


WHY = {
    "ZeRO-3": "equal as N → ∞; (N-1)/N at 384",
    "hpZ": "equal as N → ∞; (N-1)/N at 384",
    "qwZ": "the backward gather is int8 too (-1/2); +4/B: both gathers' fp32 scales",
    "qgZ": "+2/B: the int4 hops' fp32 scales; (k-1)/k at 384",
    "ZeRO++": "+4/B of fp32 scales; (N-1)/N, (k-1)/k at 384",
}
"""Why a limit row differs from the claim (module docstring)."""
LIMIT_HEADER = ["scheme", "forward all-gather", "backward all-gather", "gradient reduction",
                "inter-node (N → ∞)", "inter-node at 384 GPUs", "ZeRO++'s claim", "ours/claim",
                "intra-node, busiest rank, at 384", "differs because"]  # fmt: skip
EXACT_HEADER = ["scheme", "kind", "per rank: intra / inter (bytes)", "node inter-node (bytes)",
                "node inter-node (×M)", "ZeRO++'s claim"]  # fmt: skip


def _limit_rows(payload: dict) -> list[list[str]]:
    rows = []
    for scheme, rec in _of(payload, "zeropp.limit").items():
        res = rec["result"]
        theirs = sum(res["claim"])
        parts = [f"{_fmt(Fraction(f))} ({f})" if "/" in f else f for f in res["limit"]]
        rows.append([scheme, *parts, _fmt(res["limit_total"]), _fmt(res["paper_scale_total"]),
                     f"{theirs:g}M", _fmt(res["limit_total"] / theirs),
                     _fmt(res["paper_scale_intra"]), WHY[scheme]])  # fmt: skip
    return rows


def _exact_rows(payload: dict) -> list[list[str]]:
    rows = []
    for scheme, rec in _of(payload, "zeropp.analytic").items():
        res, theirs = rec["result"], f"{sum(claim(scheme)):g}M"
        per = "; ".join(f"{a:,} / {b:,}" for a, b in res["ranks"])
        ratio = _fmt(res["node_inter"] / res["m_bytes"])
        rows.append([scheme, "analytic", per, f"{res['node_inter']:,}", ratio, theirs])
    counted = _of(payload, "zeropp.counted")
    for scheme in SCHEMES:
        theirs = f"{sum(claim(scheme)):g}M"
        if scheme not in counted:
            rows.append([scheme, "counted: not yet built (no engine path)", *"–––", theirs])
            continue
        c = counted_summary(payload, scheme)
        got = "; ".join(f"{a:,} / {b:,}" for a, b in c["got"]) + " (ranks 0-3)"
        ratio = _fmt(c["node_inter"] / c["m_bytes"])
        same = "=" if c["exact"] else "≠"
        kind = f"counted ({c['machine']}), {same} analytic"
        rows.append([scheme, kind, got, f"{c['node_inter']:,}", ratio, theirs])
    return rows


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    m = _of(payload, "zeropp.analytic")["ZeRO-3"]["result"]["m_bytes"]
    lines = [
        "# ZeRO++'s communication volume by count (per step)",
        "",
        "**Analytic** (derived in paper_figures/zeropp_volume.py): a node's inter-node bytes per",
        "step in units of M (the model's bytes in bf16/fp16), by collective, as N and the node",
        "count k grow and at 384 GPUs (24 nodes × 16), beside ZeRO++'s claim; and the busiest",
        f"rank's intra-node bytes. Blocks of B = {BLOCK} values, one fp32 scale each.",
        "",
        *markdown_table(LIMIT_HEADER, _limit_rows(payload)),
        "",
        f"The counted GPT ({MODEL['n_layer']} blocks, n_embd {MODEL['n_embd']}, "
        f"Ψ = {m // ELEM:,}, M = {m:,} bytes) on 2 nodes × 2 ranks, one step at M = N: bytes",
        "per rank, intra / inter, for each rank of a node (every node alike), and a node's",
        "inter-node bytes. Exact: padding, the root unit's single gather and the factors",
        "(N-1)/N = 3/4 and (k-1)/k = 1/2 included, which is why they sit below the claim.",
        f"Quantized: qwZ int{QWZ_BITS}, qgZ int{QGZ_BITS}, blocks of B = {COUNTED_BLOCK} (the",
        f"block must divide the {CHUNK}-element chunk); counted rows: the engine's counter.",
        "",
        *markdown_table(EXACT_HEADER, _exact_rows(payload)),
        "",
    ]
    counted = [counted_summary(payload, s) for s in _of(payload, "zeropp.counted")]
    exact = sum(c["exact"] for c in counted)
    for scheme, c in zip(_of(payload, "zeropp.counted"), counted):
        lines += [f"Counted {scheme} equals the analytic bytes on every rank: {c['exact']} "
                  f"(analytic per rank {c['want']}).", ""]  # fmt: skip
    path = write_atomic(out.table(NAME), "\n".join(lines))
    return path, f"{exact}/{len(counted)} counted schemes = analytic on every rank"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: ZeRO-3's and ZeRO++'s inter-node volume, analytic and counted."""
    lim = {s: r["result"] for s, r in _of(payload, "zeropp.limit").items()}
    rows = []
    for scheme in ("ZeRO-3", "ZeRO++"):
        res, theirs = lim[scheme], sum(claim(scheme))
        ours = (f"{_fmt(res['limit_total'])}M as N → ∞, {_fmt(res['paper_scale_total'])}M at "
                f"384 GPUs (B = {BLOCK})")  # fmt: skip
        rows.append([f"ZeRO++ volume, {scheme}: a node's inter-node bytes per step (×M)",
                     f"{theirs:g}M", ours, _fmt(res["limit_total"] / theirs),
                     "analytic (paper_figures/zeropp_volume.py)", "–"])  # fmt: skip
    for scheme in _of(payload, "zeropp.counted"):
        c, theirs = counted_summary(payload, scheme), sum(claim(scheme))
        ratio, same = c["node_inter"] / c["m_bytes"], "=" if c["exact"] else "≠"
        rows.append([f"ZeRO++ volume, {scheme} at 2 nodes × 2 ranks (×M; (N-1)/N = 3/4)",
                     f"{theirs:g}M", f"{_fmt(ratio)}M ({same} analytic, every rank)",
                     _fmt(ratio / theirs), "counted (engine's counter, 2 simulated nodes)",
                     c["machine"]])  # fmt: skip
    missing = [s for s in SCHEMES if s not in _of(payload, "zeropp.counted")]
    if missing:
        theirs = " / ".join(f"{sum(claim(s)):g}M" for s in missing)
        rows.append([f"ZeRO++ volume, {' / '.join(missing)} counted", theirs,
                     "not yet built", "–", "no engine path yet", "–"])  # fmt: skip
    return rows
