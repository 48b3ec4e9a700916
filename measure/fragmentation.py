"""GPU memory fragmentation with and without ZeRO-R's contiguous memory (M_D, paper §6.3).

    python -m measure.fragmentation                      # GPT-2-small-like, stage 2, bf16
    python -m measure.fragmentation --layers 24 --stage 3 --vary-seq

Trains a GPT for a few steps on one CUDA device (world size 1, a real single-rank NCCL group),
with activation checkpointing, once with `contiguous_memory=False` and once with True, and
prints side by side what the caching allocator reports (`torch.cuda.memory_stats()`):
allocated bytes, reserved bytes, reserved - allocated (the fragmentation: memory the allocator
holds but cannot hand out as one block), the bytes of inactive split blocks, and allocation
retries, then the ratio on/off. Why M_D should lower it: [Note: contiguous memory] in
zero/zero_r/contiguous.py. `--vary-seq` gives every micro-batch another sequence length (as variable
length batches do), the case where activations of changing sizes fragment the free memory most.

The two runs share the process: between them every engine tensor is released and the allocator's
cache emptied (`torch.cuda.empty_cache()`), and each run's numbers are taken against its own
baseline, so the second run starts from an empty cache. Numbers come from the allocator only; on a
machine without CUDA there is nothing to measure and the command says so and exits with status 2.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import asdict, dataclass

import torch

from zero.common import cli
from zero.config import STAGES

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


@dataclass(frozen=True, kw_only=True)
class FragmentationConfig:
    """The GPT trained and how; every field is an option of `python -m measure.fragmentation`."""

    n_layer: int = 12
    """Transformer blocks of the GPT (each block one unit)."""
    n_embd: int = 768
    """Hidden width; a multiple of n_head."""
    n_head: int = 12
    """Attention heads."""
    seq: int = 512
    """Tokens per sequence (the longest with vary_seq), at least 2."""
    batch: int = 8
    """Sequences per micro-batch."""
    micro_batches: int = 4
    """Micro-batches per step (world size 1: all on this device)."""
    steps: int = 4
    """Optimizer steps of each of the two runs."""
    stage: int = 2
    """ZeRO stage 0-3."""
    vary_seq: bool = False
    """Give every micro-batch another sequence length in [seq/2, seq] (variable-length batches)."""
    device: str = "cuda"
    """The CUDA device measured ('cuda', 'cuda:0', ...)."""

    def __post_init__(self):
        for name, lo, hi in (
            ("n_layer", 1, None),
            ("n_embd", 1, None),
            ("n_head", 1, None),
            ("seq", 2, None),
            ("batch", 1, None),
            ("micro_batches", 1, None),
            ("steps", 1, None),
            ("stage", 0, 3),
        ):
            _check(name, getattr(self, name), lo, hi)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head={self.n_head}: must divide n_embd={self.n_embd}")
        if not isinstance(self.vary_seq, bool):
            raise ValueError(f"vary_seq={self.vary_seq!r}: must be True or False")
        if not isinstance(self.device, str) or torch.device(self.device).type != "cuda":
            raise ValueError(
                f"device={self.device!r}: allowed is a CUDA device ('cuda', 'cuda:0', ...)"
            )


def fragmentation(cfg: FragmentationConfig | None = None, **fields) -> dict:
    """Measure both configurations of `cfg` (or of FragmentationConfig(**fields)); returns
    {"off": stats, "on": stats, "ratio": on/off, "config"} with stats in bytes (retries a count)
    relative to each run's baseline. ValueError for a bad field, RuntimeError where CUDA is
    missing (checked after the fields)."""
    cfg = FragmentationConfig(**fields) if cfg is None else cfg
    if not torch.cuda.is_available():
        raise RuntimeError(
            "measure.fragmentation measures the CUDA caching allocator: torch.cuda.is_available() "
            "is False on this machine, so there is nothing to measure"
        )
    config = asdict(cfg)
    dev = indexed(config.pop("device"), torch.cuda.current_device)
    torch.cuda.set_device(dev)
    _single_rank_group()
    off = _measure(False, dev, **config)
    on = _measure(True, dev, **config)
    ratio = {k: (on[k] / off[k] if off[k] else float("nan")) for k in off}
    return {"off": off, "on": on, "ratio": ratio, "config": config, "device": _name(dev)}


def indexed(name: str, current) -> torch.device:
    """The CUDA device `name` with its index: 'cuda' alone means the current device, current()
    (torch.cuda.set_device and the allocator's statistics need an index)."""
    dev = torch.device(name)
    return dev if dev.index is not None else torch.device(dev.type, current())


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
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

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
    cfg, _ = cli.parse(
        FragmentationConfig, argv, prog="python -m measure.fragmentation",
        description=__doc__.split("\n\n")[0],
        aliases={"n_layer": ("--layers",), "n_embd": ("--embd",), "n_head": ("--heads",)},
        choices={"stage": STAGES},
    )  # fmt: skip
    try:
        result = fragmentation(cfg)
    except (RuntimeError, ValueError) as exc:
        print(f"measure.fragmentation: {exc}", file=sys.stderr)
        return 2
    print(f"{result['device']}: {result['config']}")
    print(table(result))
    return 0


if __name__ == "__main__":
    cli.run(main, "python -m measure.fragmentation")
