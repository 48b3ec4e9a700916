"""One process as rank r of an N-rank job: the fake world, for measuring what one rank holds.

    python -m zero.simulate --params 7.5e9 --world-size 64 --rank 0 --stage 3 --steps 1

The process joins a fake process group (torch's FakeStore: collectives return at once and keep
shapes; values are meaningless), builds the GPT of `gpt_config_for(params)` on the meta device,
and lets the engine materialise only this rank's shards, unit by unit, with initialisation skipped
(zeros). Then it runs real steps. Memory is *measured outside the engine*: the process's resident
set (RSS, from /proc/self/statm) before the model is built, after construction, and after each
step, beside the analytic model of zero/memory.py and the engine's own accounting. Peaks (the
largest unit during construction, a gathered unit and activations during a step) are reported
apart from the quiescent point after a step.

Legend: Ψ parameters of the model, N = N_d world size, K = 12 (mixed-precision Adam).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; falls back to the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def simulate_rank(
    *,
    params: float,
    world_size: int,
    rank: int,
    stage: int,
    steps: int,
    seq: int = 64,
    batch: int = 1,
    vocab_size: int = 50257,
) -> dict:
    """Build and step rank `rank` of a fake world; returns measurements (bytes)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    from .config import ZeroConfig
    from .engine import ZeroEngine
    from .memory import model_state_breakdown
    from .models import GPT, gpt_config_for

    cfg, count = gpt_config_for(params, vocab_size=vocab_size)
    cfg = type(cfg)(**{**cfg.__dict__, "block_size": max(seq, 16)})
    count = GPT(cfg, device="meta").num_params()
    baseline = rss_bytes()
    model = GPT(cfg, device="meta")
    zcfg = ZeroConfig(
        stage=stage,
        precision="bf16",
        reduce_dtype="bf16",
        optimizer="adam",
        micro_batches=world_size,
        units=tuple(model.unit_names()),
        nonfinite="skip",
    )
    t0 = time.perf_counter()
    engine = ZeroEngine(model, zcfg, device="cpu", init_seed=None)
    built = rss_bytes()
    construction_peak = peak_rss_bytes()
    padded = sum(u.part.padded_numel for u in engine.units)
    analytic = model_state_breakdown(num_params=padded, world_size=world_size, stage=stage)
    tokens = torch.zeros((batch, seq), dtype=torch.long)
    after = []
    for _ in range(steps):
        for _k in range(zcfg.micro_batches // world_size):
            _, loss = engine(tokens, tokens)
            engine.backward(loss)
        engine.step()
        after.append(rss_bytes())
    return {
        "config": {
            "params_requested": params,
            "num_params": count,
            "world_size": world_size,
            "rank": rank,
            "stage": stage,
            "steps": steps,
            "seq": seq,
            "batch": batch,
            "layers": cfg.n_layer,
            "hidden": cfg.n_embd,
            "precision": "bf16",
            "reduce_dtype": "bf16",
            "optimizer": "adam",
        },
        "full_fp32_weights_bytes": 4 * count,
        "rss_baseline": baseline,
        "rss_after_construction": built - baseline,
        "rss_after_steps": [a - baseline for a in after],
        "rss_peak": peak_rss_bytes() - baseline,
        "construction_peak": construction_peak - baseline,
        "engine_report": engine.memory_report(),
        "analytic_model_states": analytic.total,
        "analytic_paper_formula": 16 * count / world_size if stage == 3 else None,
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zero.simulate", description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=7.5e9)
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = simulate_rank(
        params=a.params,
        world_size=a.world_size,
        rank=a.rank,
        stage=a.stage,
        steps=a.steps,
        seq=a.seq,
    )
    gb = 1e9
    print(
        f"GPT {out['config']['num_params'] / 1e9:.2f}B params ({out['config']['layers']} layers,"
        f" hidden {out['config']['hidden']}); whole fp32 weights "
        f"{out['full_fp32_weights_bytes'] / gb:.1f} GB"
    )
    print(
        f"rank {a.rank} of {a.world_size}, stage {a.stage}: analytic model states "
        f"{out['analytic_model_states'] / gb:.3f} GB; measured RSS after construction "
        f"{out['rss_after_construction'] / gb:.3f} GB, after step(s) "
        f"{[round(x / gb, 3) for x in out['rss_after_steps']]} GB; peak "
        f"{out['rss_peak'] / gb:.3f} GB"
    )
    if a.json:
        from .results import make_record, provenance, write_json

        write_json(
            a.json,
            make_record(
                config=out["config"], result=out, kind="simulate.rank", provenance=provenance()
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
