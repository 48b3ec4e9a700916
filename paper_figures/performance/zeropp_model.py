"""ZeRO++'s speedup over ZeRO-3 as the performance model predicts it: a model, not a measurement.

One GPU's step takes t = compute + (1 - overlap)·communication + optimizer, the terms and the
fitted parameters of throughput_model.py (fitted on the ZeRO paper's Figure 4, V100s), with the
communication over two link classes (throughput_model.two_link_seconds): the busiest rank's
intra-node bytes over its NVSwitch or NVLink, then a node's inter-node bytes over the node's
link. The bytes per link are paper_figures/zeropp_volume.py's for ZeRO-3 and for ZeRO++ (qwZ,
hpZ and qgZ together, blocks of 256) at the cluster's N and R, the model taken as one unit of Ψ
(no padding, gathered twice). The speedup is t(ZeRO-3) / t(ZeRO++). qwZ quantizes the backward
gather as well as the forward one (zeropp_volume's derivation), but within ZeRO++ the backward
gather is hpZ's, bf16 inside the node, so ZeRO++'s bytes are those of the claim's table plus the
scales: (N-1)/N·(1/2 + 2/B) + (k-1)/k·(1/4 + 2/B) of M across nodes (the engine counts the same
bytes at 2 x 2: tests/distributed/test_zeropp_counted.py).

Two sets of clusters:
- ZeRO++'s own (docs/paper.md §3.2): 384 V100s, here 24 nodes of 16 (DGX-2, NVSwitch 300 GB/s
  per GPU), 100, 200, 400 and 800 Gbps per node; GPT models of 18B-138B at 1K and 2K tokens per
  GPU, beside the TFLOP/s the blog prints above its bars.
- Two clusters of 8 V100s per node (NVLink, 300 GB/s per GPU: six 50 GB/s links): 2 nodes and
  48 nodes (384 GPUs), 100 and 200 Gbps per node, the 18B model. Nothing reported to compare.

Assumptions (each a place where the model can be wrong): the two link classes do not overlap
each other, and the fitted overlap (0 in the committed fit) applies to all of it; quantization
and dequantization cost no time (which flatters ZeRO++); hpZ's secondary copy costs no memory
that would change the batch; one micro-batch per step; the 18B model's shape is the ZeRO++
tutorial's (40 layers, hidden 6144), the others gpt_config_for's (the ZeRO paper's shapes);
sequences of 1,024 tokens (1K tokens per GPU: one sequence).

Legend: Ψ parameters, N GPUs, R GPUs per node, M = 2Ψ bytes (fp16).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

from paper_figures import paper, zeropp_volume
from paper_figures.common import Outputs, SummaryRow, compute_then_render, markdown_table
from paper_figures.performance import throughput_model as perfmodel
from zero.common.results import make_record, provenance, write_atomic

NAME = "zeropp_model"
KIND = "zeropp_model.point"
BLOCK = zeropp_volume.BLOCK
SHAPES = {"18B": (40, 6144)}
"""Layers and hidden size where ZeRO++ prints them (the tutorial's 18B GPT-2)."""
CLUSTERS = ((2, 8), (48, 8))
"""(nodes, GPUs per node) of the clusters nothing is reported for."""
MACHINE = "V100s as stated (DGX-2 nodes of 16: our assumption), links as reported"


def shape(label: str) -> tuple[int, int]:
    """(layers, hidden) of a model named like "49B"."""
    if label in SHAPES:
        return SHAPES[label]
    from zero.workloads.models import gpt_config_for

    cfg, _ = gpt_config_for(float(label[:-1]) * 1e9)
    return cfg.n_layer, cfg.n_embd


def link_bytes(scheme: str, psi: int, gpus: int, per_node: int) -> tuple[int, int]:
    """(the busiest rank's intra-node bytes, a node's inter-node bytes) of one step."""
    units = [zeropp_volume.Unit(math.ceil(psi / gpus), psi)]
    t = zeropp_volume.step_traffic(scheme, units, zeropp_volume.Cluster(gpus, per_node, BLOCK))
    return max(intra for intra, _ in t["ranks"]), t["node_inter"]


def terms(scheme: str, *, label: str, tokens: int, gpus: int, hw, p) -> dict[str, float]:
    """Seconds per step of each term, and the TFLOP/s per GPU, of one scheme."""
    layers, hidden = shape(label)
    psi = perfmodel.num_params(layers, hidden)
    flops = perfmodel.step_flops(tokens // perfmodel.SEQ, layers, hidden)
    x = tokens * hidden  # B·s·h: the GEMM size of throughput_model
    compute = flops / (hw.peak_flops * p.peak_fraction * x / (x + p.half_work))
    intra, inter = link_bytes(scheme, psi, gpus, hw.gpus_per_node)
    comm = perfmodel.two_link_seconds(intra, inter, p, hw)
    optimizer = perfmodel.OPTIMIZER_BYTES * psi / gpus / hw.hbm_bytes_s
    step = compute + (1 - p.overlap) * comm + optimizer
    return {
        "num_params": psi,
        "intra_bytes": intra,
        "inter_bytes": inter,
        "compute_s": compute,
        "comm_s": comm,
        "optimizer_s": optimizer,
        "step_s": step,
        "tflops": flops / step / 1e12,
    }


def point(
    *,
    label: str,
    tokens: int,
    gpus: int,
    per_node: int,
    gbps: int,
    p,
    prov,
    bar: paper.ZeroppBar | None,
) -> dict:
    """One cluster and model: both schemes' terms, the model's speedup, the reported bars."""
    hw = replace(paper.HARDWARE, gpus_per_node=per_node, node_bytes_s=gbps * 1e9 / 8)
    base = terms("ZeRO-3", label=label, tokens=tokens, gpus=gpus, hw=hw, p=p)
    plus = terms("ZeRO++", label=label, tokens=tokens, gpus=gpus, hw=hw, p=p)
    config = {
        "model": label,
        "tokens_per_gpu": tokens,
        "gpus": gpus,
        "gpus_per_node": per_node,
        "gbps": gbps,
        "block": BLOCK,
        "hardware": asdict(hw),
        "figure": bar.figure if bar else None,
    }
    result = {
        "zero3": base,
        "zeropp": plus,
        "speedup": base["step_s"] / plus["step_s"],
        "reported": asdict(bar) if bar else None,
        "source": "model, not measured",
    }
    return make_record(config=config, result=result, kind=KIND, provenance=prov)


def build_records() -> list[dict]:
    p, prov = perfmodel.fit(), provenance()
    per_node = paper.HARDWARE.gpus_per_node
    records = [
        point(
            label=b.model,
            tokens=b.tokens_per_gpu,
            gpus=paper.ZEROPP_GPUS,
            per_node=per_node,
            gbps=b.gbps,
            p=p,
            prov=prov,
            bar=b,
        )
        for b in paper.ZEROPP_BARS
    ]
    records += [
        point(
            label="18B",
            tokens=tokens,
            gpus=nodes * gpn,
            per_node=gpn,
            gbps=gbps,
            p=p,
            prov=prov,
            bar=None,
        )
        for nodes, gpn in CLUSTERS
        for gbps in (100, 200)
        for tokens in (1024, 2048)
    ]
    return records


def compute(profile: str) -> dict:
    del profile  # the same everywhere: a second
    return {"section": NAME, "records": build_records()}


def reported_speedup(bar: dict) -> float:
    """The arrow's printed speedup where there is one, else the ratio of the printed labels."""
    return bar["arrow"] or bar["zeropp_tflops"] / bar["zero3_tflops"]


def errors(payload: dict) -> list[float]:
    """(model - reported) / reported speedup, per reported bar."""
    return [
        r["result"]["speedup"] / reported_speedup(r["result"]["reported"]) - 1
        for r in payload["records"]
        if r["result"]["reported"]
    ]


def _rows(payload: dict) -> tuple[list[list[str]], list[list[str]]]:
    theirs, ours = [], []
    for r in payload["records"]:
        c, res = r["config"], r["result"]
        bar = res["reported"]
        model = f"{res['zero3']['tflops']:.1f} → {res['zeropp']['tflops']:.1f}"
        if bar:
            got = f"{bar['zero3_tflops']:g} → {bar['zeropp_tflops']:g}"
            theirs.append(
                [
                    f"blog Fig. {c['figure']}",
                    c["model"],
                    f"{c['tokens_per_gpu'] // 1024}K",
                    f"{c['gbps']}",
                    got,
                    f"{reported_speedup(bar):.2f}×",
                    model,
                    f"{res['speedup']:.2f}×",
                    f"{res['speedup'] / reported_speedup(bar):.2f}",
                ]
            )
        else:
            nodes = c["gpus"] // c["gpus_per_node"]
            ours.append(
                [
                    f"{nodes} × {c['gpus_per_node']}",
                    c["model"],
                    f"{c['tokens_per_gpu'] // 1024}K",
                    f"{c['gbps']}",
                    f"{res['zero3']['inter_bytes'] / 2 / res['zero3']['num_params']:.3f}M → "
                    f"{res['zeropp']['inter_bytes'] / 2 / res['zeropp']['num_params']:.3f}M",
                    model,
                    f"{res['speedup']:.2f}×",
                ]
            )
    return theirs, ours


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    theirs, ours = _rows(payload)
    err = errors(payload)
    best = max(
        (r for r in payload["records"] if r["result"]["reported"]),
        key=lambda r: r["result"]["speedup"],
    )
    lines = [
        "# ZeRO++'s speedup over ZeRO-3: model, not measured",
        "",
        "paper_figures/performance/zeropp_model.py: the performance model (fitted on the ZeRO",
        "paper's Figure 4) with two link classes and the per-link bytes of",
        "paper_figures/zeropp_volume.py; the assumptions are in its docstring and",
        "docs/perfmodel.md. Reported: ZeRO++'s blog, 384 V100s (TFLOP/s per GPU as printed above",
        "the bars, ZeRO-3 → ZeRO++; the speedup from its arrow where printed, else the labels'",
        f"ratio). The paper's abstract: up to {paper.ZEROPP_HEADLINE}× at 384 GPUs; the model's",
        f"largest at the reported points: {best['result']['speedup']:.2f}× "
        f"({best['config']['model']}, {best['config']['gbps']} Gbps, "
        f"{best['config']['tokens_per_gpu'] // 1024}K tokens).",
        "",
        *markdown_table(
            [
                "figure",
                "model",
                "tokens/GPU",
                "Gbps/node",
                "reported TFLOP/s",
                "reported speedup",
                "model TFLOP/s",
                "model speedup",
                "model/reported",
            ],
            theirs,
        ),
        "",
        f"Mean |model/reported - 1| over the {len(err)} reported points: "
        f"{100 * sum(map(abs, err)) / len(err):.0f}%.",
        "",
        "Clusters of 8 V100s per node (NVLink 300 GB/s per GPU), 18B model: a node's inter-node",
        "bytes per step (×M) and the model's prediction; nothing reported to compare.",
        "",
        *markdown_table(
            [
                "nodes × GPUs",
                "model",
                "tokens/GPU",
                "Gbps/node",
                "inter-node (×M)",
                "model TFLOP/s",
                "model speedup",
            ],
            ours,
        ),
        "",
    ]
    path = write_atomic(out.table(NAME), "\n".join(lines))
    return path, f"speedup: model/reported mean |error| {100 * sum(map(abs, err)) / len(err):.0f}%"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: the headline, and each reported figure's range of speedups."""
    recs = [r for r in payload["records"] if r["result"]["reported"]]
    best = max(r["result"]["speedup"] for r in recs)
    rows = [
        [
            "ZeRO++ speedup over ZeRO-3, up to (384 GPUs)",
            f"{paper.ZEROPP_HEADLINE}×",
            f"{best:.2f}× (model)",
            f"{best / paper.ZEROPP_HEADLINE:.3f}",
            "model, not measured (paper_figures/performance/zeropp_model.py)",
            MACHINE,
        ]
    ]
    for figure in sorted({r["config"]["figure"] for r in recs}):
        at = [r for r in recs if r["config"]["figure"] == figure]
        theirs = [reported_speedup(r["result"]["reported"]) for r in at]
        mine = [r["result"]["speedup"] for r in at]
        ratio = [m / t for m, t in zip(mine, theirs)]
        gbps = ", ".join(sorted({str(r["config"]["gbps"]) for r in at}, key=int))
        rows.append(
            [
                f"ZeRO++ speedup, blog Fig. {figure} ({gbps} Gbps, {len(at)} bars)",
                f"{min(theirs):.2f}-{max(theirs):.2f}×",
                f"{min(mine):.2f}-{max(mine):.2f}× (model)",
                f"{min(ratio):.2f}-{max(ratio):.2f} (per bar)",
                "model, not measured",
                MACHINE,
            ]
        )
    return rows
