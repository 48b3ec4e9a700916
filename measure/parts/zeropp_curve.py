"""ZeRO++ against the exact run: the loss of every step and the final parameters, measured.

    python -m measure.parts.zeropp_curve                 # STEPS steps, writes OUT as JSON
    python -m measure.parts.zeropp_curve --steps 5 --out /tmp/curve.json

Two runs of the same stage-3 training on N = 4 gloo ranks simulated as 2 nodes × 2
(ZeroConfig.ranks_per_node = 2), from the same weights on the same data: *exact*, plain stage 3,
and *ZeRO++*, the same with qwZ (int8 weights), hpZ (the backward gather inside the node) and
qgZ (int4 gradients in two hops), blocks of B = 128 (the chunk's size: a block must divide it).
The workload learns: the project's small GPT (measure/parts/zeropp_links.py's MODEL, Ψ = 206K)
continuing arithmetic progressions mod V (zero/workloads/models.py gpt_microbatches), whose loss
falls from about ln V. bf16 compute, gradients reduced in fp32 (qgZ sums dequantized fp32 terms
and refuses a bf16 reduction), Adam, M = N micro-batches per step, deterministic mode.

Recorded: both loss curves (each step's mean over its M micro-batches, as every rank sees it);
the relative difference of the loss per step, |l_q - l_e| / l_e, its max and mean over the
steps; and of the final fp32 master per parameter tensor, ||p_q - p_e|| / ||p_e|| (L2), its max
and mean over the tensors, with the global one over all parameters. Wall seconds per run on
this machine's CPU ranks (gloo), which a 2-core machine shares among its 4 ranks: not a speed.
Nothing here is asserted against a threshold: reference/zeropp.py bounds one collective's
error, not a training run's drift; the numbers are what this run measured.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from measure.parts.zeropp_links import MODEL

OUT = Path("paper_figures/measured/zeropp_curve.json")
KIND = "zeropp.curve"
STEPS = 300
"""Steps of the committed measurement: both runs in a few minutes on 2 busy cores."""
WORLD, PER_NODE, CHUNK, BLOCK, BATCH, LR = 4, 2, 128, 128, 8, 3e-3
"""2 nodes × 2 ranks; 128-element chunks and quantization blocks; 8 sequences per micro-batch;
Adam's learning rate."""
QUANTIZED = {"qwz_bits": 8, "qgz_bits": 4, "hpz": True, "quant_block": BLOCK}
"""ZeRO++: qwZ int8, qgZ int4 (the paper's widths), hpZ."""
PRECISION = "fp32"
"""The compute dtype: fp32, so that the loss carries 24 bits; a bf16 loss is rounded to 2^-8
relative, coarser than most of the differences measured here."""


def _config(n: int, flags: dict):
    from reference.optim import Hyper
    from zero.config import ZeroConfig
    from zero.workloads.models import GPT, GPTConfig

    units = tuple(GPT(GPTConfig(**MODEL), device="meta").unit_names())
    return ZeroConfig(stage=3, precision=PRECISION, reduce_dtype="fp32", optimizer="adam",
                      groups=(Hyper(lr=LR),), micro_batches=n, chunk=CHUNK, units=units,
                      ranks_per_node=PER_NODE, **flags)  # fmt: skip


def one_run(rank: int, n: int, flags: dict, steps: int) -> dict | None:
    """A run of `steps` steps with the ZeroConfig `flags` over the plain stage-3 ones; rank 0
    returns its losses, the full fp32 master by name and its wall seconds (pool worker)."""
    return _run(rank, n, flags, steps)


def _run(rank: int, n: int, flags: dict, steps: int) -> dict | None:
    from zero.engine import ZeroEngine
    from zero.loop import train_steps
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    cfg = GPTConfig(**MODEL)
    engine = ZeroEngine(GPT(cfg, seed=0), _config(n, flags))

    def batch(step: int, j: int):
        return gpt_microbatches(cfg, seed=0, data_step=step, count=j + 1, batch_size=BATCH)[j]

    first, _ = engine.gather_state()
    start = time.perf_counter()
    results = train_steps(engine, batch, steps)
    seconds = time.perf_counter() - start
    master, _ = engine.gather_state()
    if rank:
        return None
    return {
        "loss": [r.loss for r in results],
        "skipped": sum(r.skipped for r in results),
        "master": {k: v.float().cpu().numpy() for k, v in master.items()},
        "first": {k: v.float().cpu().numpy() for k, v in first.items()},
        "seconds": seconds,
    }


def _relative(a, b) -> float:
    import numpy as np

    num = float(np.linalg.norm((a.astype(np.float64) - b.astype(np.float64)).ravel()))
    den = float(np.linalg.norm(b.astype(np.float64).ravel()))
    return num / den if den else (0.0 if num == 0 else math.inf)


def compare(exact: dict, quant: dict) -> dict:
    """The relative differences of the loss per step and of the final master per tensor."""
    import numpy as np

    le, lq = exact["loss"], quant["loss"]
    loss_rel = [abs(q - e) / abs(e) for e, q in zip(le, lq, strict=True)]
    names = sorted(exact["master"])
    per_tensor = {k: _relative(quant["master"][k], exact["master"][k]) for k in names}
    flat = [
        np.concatenate([m[k].ravel() for k in names]) for m in (quant["master"], exact["master"])
    ]
    start = np.concatenate([exact["first"][k].ravel() for k in names])
    return {
        "loss_rel_max": max(loss_rel),
        "loss_rel_mean": sum(loss_rel) / len(loss_rel),
        "loss_rel_last": loss_rel[-1],
        "loss_rel": loss_rel,
        "param_rel_max": max(per_tensor.values()),
        "param_rel_mean": sum(per_tensor.values()) / len(per_tensor),
        "param_rel_global": _relative(*flat),
        "param_rel_to_update": _relative(flat[0] - start, flat[1] - start),
        "param_rel_worst_tensor": max(per_tensor, key=per_tensor.get),
        "identical_losses": le == lq,
    }


def measure(steps: int) -> dict:
    """Both runs on a pool of WORLD gloo ranks; the record (zero.common.results)."""
    from zero.common.results import make_record, provenance
    from zero.ranks.local import get_pool

    pool = get_pool(WORLD)
    exact = pool.run(one_run, {}, steps, timeout_s=3600)[0]
    quant = pool.run(one_run, QUANTIZED, steps, timeout_s=3600)[0]
    config = {"model": MODEL, "world_size": WORLD, "ranks_per_node": PER_NODE, "stage": 3,
              "precision": PRECISION, "reduce_dtype": "fp32", "optimizer": "adam", "lr": LR,
              "micro_batches": WORLD, "batch_size": BATCH, "chunk": CHUNK, "steps": steps,
              "quantized": QUANTIZED, "data": "gpt_microbatches(seed=0): arithmetic progressions",
              "backend": "gloo", "device": "cpu"}  # fmt: skip
    result = {
        "exact": {"loss": exact["loss"], "skipped": exact["skipped"], "seconds": exact["seconds"]},
        "zeropp": {"loss": quant["loss"], "skipped": quant["skipped"], "seconds": quant["seconds"]},
        "ln_vocab": math.log(MODEL["vocab_size"]),
        **compare(exact, quant),
    }
    return make_record(config=config, result=result, kind=KIND, provenance=provenance())


def main(argv: list[str] | None = None) -> int:
    from zero.common.results import write_json

    p = argparse.ArgumentParser(prog="python -m measure.parts.zeropp_curve", description=__doc__)
    p.add_argument("--steps", type=int, default=STEPS, help=f"default {STEPS}")
    p.add_argument("--out", type=Path, default=OUT, help=f"default {OUT}")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    record = measure(args.steps)
    write_json(args.out, record)
    r = record["result"]
    print(f"wrote {args.out}: {args.steps} steps; loss exact {r['exact']['loss'][0]:.4f} -> "
          f"{r['exact']['loss'][-1]:.4f}, ZeRO++ {r['zeropp']['loss'][0]:.4f} -> "
          f"{r['zeropp']['loss'][-1]:.4f}; loss rel. diff max {r['loss_rel_max']:.3g} mean "
          f"{r['loss_rel_mean']:.3g}; final params rel. diff max {r['param_rel_max']:.3g} "
          f"mean {r['param_rel_mean']:.3g} global {r['param_rel_global']:.3g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
