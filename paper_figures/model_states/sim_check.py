"""The NumPy simulation of N ranks against the paper's formulas, for a small model.

For each stage and N, one simulated step in the paper's configuration (bf16 working copy,
gradients reduced in bf16, Adam so K = 12, M = N): the bytes each simulated rank actually holds
are counted from its buffers (reference/simulate.py), and its traffic from its collectives. They
are set beside Figure 1's formula (zero.common.memory.model_state_bytes) and the paper's 2Ψ / 2Ψ /
2Ψ / 3Ψ times (N-1)/N. The simulation pads every unit so that it splits into N chunk-aligned shards,
so the formula is evaluated at the padded Ψ for the exact comparison, and at the real Ψ beside it.

Legend: Ψ = real parameter count, Ψ_pad = padded count at N, N = N_d = world_size.
"""

from __future__ import annotations

import numpy as np

from paper_figures.common import Outputs, SummaryRow, compute_then_render, count_line
from reference import Hyper, ModelSpec, StepConfig, cast
from reference.simulate import World
from zero.common.memory import STAGE_LABELS, model_state_bytes
from zero.common.results import make_record, provenance, write_atomic

NAME = "sim_check"
PAPER_VOLUME = {0: 2, 1: 2, 2: 2, 3: 3}  # ×Ψ·(N-1)/N, the paper's §7 (docs/paper.md §1.4)


def small_model(layers: int = 4, d: int = 64, vocab: int = 96):
    """GPT-shaped units: a root (embeddings, final norm) and one unit per block."""
    root = [("wte", (vocab, d)), ("wpe", (32, d)), ("ln_f.w", (d,)), ("ln_f.b", (d,))]
    blocks = [
        [
            (f"h{i}.ln1.w", (d,)),
            (f"h{i}.attn.qkv", (3 * d, d)),
            (f"h{i}.attn.proj", (d, d)),
            (f"h{i}.ln2.w", (d,)),
            (f"h{i}.mlp.fc", (4 * d, d)),
            (f"h{i}.mlp.proj", (d, 4 * d)),
        ]
        for i in range(layers)
    ]
    return [root, *blocks]


def compute(profile: str) -> dict:
    units = small_model(layers=8 if profile == "full" else 4)
    spec = ModelSpec.build(units, chunk=512)
    rng = np.random.default_rng(0)
    master = {n: rng.standard_normal(s).astype(np.float32) for u in units for n, s in u}
    prov, records = provenance(), []
    for n in (1, 2, 4, 8):
        grads = [
            {name: cast(rng.standard_normal(s) * 1e-2, "bf16") for u in units for name, s in u}
            for _ in range(n)
        ]
        for stage in range(4):
            cfg = StepConfig(
                optimizer="adam",
                groups=(Hyper(),),
                precision="bf16",
                reduce_dtype="bf16",
                world_size=n,
                micro_batches=n,
            )
            world = World(master, spec, cfg, stage=stage, mode="deterministic")
            world.step(grads)
            per_rank = [sum(world.resident_bytes(r).values()) for r in range(n)]
            sent = [world.traffic(r) for r in range(n)]
            config = {
                "model": "small-gpt",
                "stage": stage,
                "world_size": n,
                "micro_batches": n,
                "precision": "bf16",
                "reduce_dtype": "bf16",
                "optimizer": "adam",
                "mode": "deterministic",
            }
            result = {
                "num_params": spec.numel,
                "padded_params": n * sum(world.shard),
                "bytes_per_rank": per_rank,
                "breakdown_rank0": world.resident_bytes(0),
                "elements_sent_per_rank": [e for e, _ in sent],
                "padding_sent_per_rank": [p for _, p in sent],
            }
            records.append(
                make_record(config=config, result=result, kind="sim.memory_comm", provenance=prov)
            )
    return {"section": NAME, "records": records}


def render(payload: dict, out: Outputs):
    rows, matched, total = [], 0, 0
    for rec in payload["records"]:
        c, r = rec["config"], rec["result"]
        n, stage, psi, pad = c["world_size"], c["stage"], r["num_params"], r["padded_params"]
        formula_pad = model_state_bytes(pad, n, stage)
        measured = max(r["bytes_per_rank"])
        mem_ok = all(b == formula_pad for b in r["bytes_per_rank"])
        # the paper's volume, at the padded Ψ per rank and at the real Ψ averaged over ranks
        volume = PAPER_VOLUME[stage] * (n - 1) * pad // n
        real = sum(e - p for e, p in zip(r["elements_sent_per_rank"], r["padding_sent_per_rank"]))
        vol_ok = all(e == volume for e in r["elements_sent_per_rank"]) and (
            real == PAPER_VOLUME[stage] * (n - 1) * psi
        )
        matched += mem_ok + vol_ok
        total += 2
        rows.append(
            f"| {STAGE_LABELS[stage]} | {n} | {psi} | {pad} | {measured} | {formula_pad:.0f} | "
            f"{model_state_bytes(psi, n, stage):.0f} | {'=' if mem_ok else '≠'} | "
            f"{r['elements_sent_per_rank'][0]} | {volume} | {'=' if vol_ok else '≠'} |"
        )
    line = count_line(matched, total, "checks equal the formula")
    text = "\n".join(
        [
            "# The N-rank NumPy simulation against the paper's formulas",
            "",
            "One deterministic step of `reference.simulate.World` per cell, paper configuration",
            "(bf16, gradients reduced in bf16, Adam: K = 12, M = N). *Bytes* are counted from each",
            "simulated rank's own buffers; the formula is Figure 1's, at the padded Ψ (exact) and",
            "at the real Ψ (for scale). *Sent* is rank 0's elements per step; the paper's volume",
            "is",
            "2Ψ (stages 0-2) or 3Ψ (stage 3) times (N-1)/N at the padded Ψ, and the non-padding",
            "elements summed over ranks must equal that factor times (N-1)·Ψ exactly.",
            "",
            "| stage | N | Ψ | Ψ_pad | bytes/rank (measured) | formula(Ψ_pad) | formula(Ψ) | "
            "bytes | sent/rank | paper volume | volume |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            line + ".",
            "",
        ]
    )
    return write_atomic(out.table(NAME), text), f"{matched}/{total} checks"


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)
