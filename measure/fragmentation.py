"""GPU memory fragmentation with and without ZeRO-R's contiguous memory (M_D, paper §6.3).

    python -m measure.fragmentation                      # GPT-2-small-like, stage 2, bf16
    python -m measure.fragmentation --layers 24 --stage 3 --vary-seq

Trains a GPT for a few steps on one CUDA device (world size 1, a real single-rank NCCL group),
with activation checkpointing, once with `contiguous_memory=False` and once with True, and
prints side by side what the caching allocator reports (`torch.cuda.memory_stats()`):
allocated bytes, reserved bytes, reserved - allocated (the fragmentation: memory the allocator
holds but cannot hand out as one block), the bytes of inactive split blocks, and allocation
retries, then the ratio on/off. Why M_D should lower it: [Note: contiguous memory] in
zero/contiguous.py. `--vary-seq` gives every micro-batch another sequence length (as variable
length batches do), the case where activations of changing sizes fragment the free memory most.

The two runs share the process: between them every engine tensor is released and the
allocator's cache emptied (`torch.cuda.empty_cache()`), and each run's numbers are taken against
its own baseline, so the second run starts from an empty cache. Numbers come from the allocator
only; on a machine without CUDA there is nothing to measure and the command says so and exits
with status 2.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

STATS = (
    ("allocated", "allocated_bytes.all.current"),
    ("reserved", "reserved_bytes.all.current"),
    ("inactive_split", "inactive_split_bytes.all.current"),
    ("peak_allocated", "allocated_bytes.all.peak"),
    ("peak_reserved", "reserved_bytes.all.peak"),
    ("alloc_retries", "num_alloc_retries"),
)


def _check(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi and value > hi):
        allowed = f"an integer in [{lo}, {hi}]" if hi else f"an integer >= {lo}"
        raise ValueError(f"{name}={value!r}: allowed is {allowed}")


def fragmentation(
    *,
    n_layer: int = 12,
    n_embd: int = 768,
    n_head: int = 12,
    seq: int = 512,
    batch: int = 8,
    micro_batches: int = 4,
    steps: int = 4,
    stage: int = 2,
    vary_seq: bool = False,
    device: str = "cuda",
) -> dict:
    """Measure both configurations; returns {"off": stats, "on": stats, "ratio": on/off, "config"}
    with stats in bytes (retries a count) relative to each run's baseline. ValueError for a bad
    argument, RuntimeError where CUDA is missing (checked after the arguments)."""
    for name, value, lo, hi in (
        ("n_layer", n_layer, 1, None),
        ("n_embd", n_embd, 1, None),
        ("n_head", n_head, 1, None),
        ("seq", seq, 2, None),
        ("batch", batch, 1, None),
        ("micro_batches", micro_batches, 1, None),
        ("steps", steps, 1, None),
        ("stage", stage, 0, 3),
    ):
        _check(name, value, lo, hi)
    if n_embd % n_head:
        raise ValueError(f"n_head={n_head}: must divide n_embd={n_embd}")
    if not isinstance(vary_seq, bool):
        raise ValueError(f"vary_seq={vary_seq!r}: must be True or False")
    if not isinstance(device, str) or torch.device(device).type != "cuda":
        raise ValueError(f"device={device!r}: allowed is a CUDA device ('cuda', 'cuda:0', ...)")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "measure.fragmentation measures the CUDA caching allocator: torch.cuda.is_available() "
            "is False on this machine, so there is nothing to measure"
        )
    config = dict(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        seq=seq,
        batch=batch,
        micro_batches=micro_batches,
        steps=steps,
        stage=stage,
        vary_seq=vary_seq,
    )
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    _single_rank_group()
    off = _measure(False, dev, **config)
    on = _measure(True, dev, **config)
    ratio = {k: (on[k] / off[k] if off[k] else float("nan")) for k in off}
    return {"off": off, "on": on, "ratio": ratio, "config": config, "device": _name(dev)}


def _single_rank_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # world size 1: collectives are real, and trivial
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)


def _name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev)


def _measure(contiguous: bool, dev: torch.device, **cfg) -> dict:
    """One run: stats after the last step (a quiescent point), peaks over the whole run."""
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_stats(dev)
    engine = _train(contiguous, dev, **cfg)  # alive while the stats are read
    torch.cuda.synchronize(dev)
    now = torch.cuda.memory_stats(dev)
    del engine
    out = {k: now.get(key, 0) - base.get(key, 0) for k, key in STATS}
    out["fragmentation"] = out["reserved"] - out["allocated"]
    out["peak_fragmentation"] = out["peak_reserved"] - out["peak_allocated"]
    return out


def _train(
    contiguous, dev, *, n_layer, n_embd, n_head, seq, batch, micro_batches, steps, stage, vary_seq
):
    """Build the engine, train `steps` steps, and return it (its model states still resident)."""
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.models import GPT, GPTConfig, gpt_microbatches

    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    model = GPT(cfg, device="meta")
    zcfg = ZeroConfig(
        stage=stage,
        precision="bf16",
        optimizer="adamw",
        micro_batches=micro_batches,
        units=tuple(model.unit_names()),
        activation_checkpointing=True,
        contiguous_memory=contiguous,
    )
    engine = ZeroEngine(model, zcfg, device=dev, init_seed=0)
    for step in range(steps):
        batches = gpt_microbatches(
            cfg, seed=0, data_step=step, count=micro_batches, batch_size=batch
        )
        for j, (x, y) in enumerate(batches):
            if vary_seq:  # a deterministic length in [seq/2, seq] per micro-batch
                t = seq - (7919 * (step * micro_batches + j)) % (seq // 2 + 1)
                x, y = x[:, :t], y[:, :t]
            _, loss = engine(x.to(dev), y.to(dev))
            engine.backward(loss)
        engine.step()
    return engine


def table(result: dict) -> str:
    """The side-by-side table `python -m measure.fragmentation` prints."""
    mib = 2.0**20
    rows = [f"{'':<20}{'without M_D':>14}{'with M_D':>14}{'on/off':>9}"]
    shown = ("allocated", "reserved", "fragmentation", "inactive_split")
    for k in shown + ("peak_allocated", "peak_reserved", "peak_fragmentation"):
        off, on, r = result["off"][k], result["on"][k], result["ratio"][k]
        rows.append(f"{k + ' (MiB)':<20}{off / mib:>14.1f}{on / mib:>14.1f}{r:>9.3f}")
    off, on = result["off"]["alloc_retries"], result["on"]["alloc_retries"]
    rows.append(f"{'alloc retries':<20}{off:>14d}{on:>14d}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m measure.fragmentation", description=__doc__)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--vary-seq", action="store_true")
    a = p.parse_args(argv)
    try:
        result = fragmentation(
            n_layer=a.layers,
            n_embd=a.embd,
            n_head=a.heads,
            seq=a.seq,
            batch=a.batch,
            micro_batches=a.micro_batches,
            steps=a.steps,
            stage=a.stage,
            vary_seq=a.vary_seq,
        )
    except (RuntimeError, ValueError) as exc:
        print(f"measure.fragmentation: {exc}", file=sys.stderr)
        return 2
    print(f"{result['device']}: {result['config']}")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
