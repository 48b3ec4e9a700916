"""python -m measure.gpu_bench: one bf16 AdamW training step at N = 1, timed system by system:
a plain PyTorch loop (bf16 working copy, fp32 master), DDP, FSDP2 and our stages 0-3 (SYSTEMS).

    torchrun --standalone --nproc-per-node 1 -m measure.gpu_bench --json bench_gpu.json
    python -m measure.gpu_bench --model tiny --device cpu --steps 2 --warmup 1   # CPU dry run
    python -m measure.gpu_bench --from-json bench_gpu.json                       # the table again

Workload: zero.workloads.models.GPT (default L 24, d 1024, 16 heads, V 50304, T 1024: Ψ = 354.9M), B
sequences per step, the same batches for every system (gpt_microbatches), AdamW lr 3e-4 with weight
decay 0.1 on matrices. Legend: ms/step the whole step (forward, backward, update; CUDA events,
perf_counter on a CPU), median [min-max] over the timed steps; update ms the update alone; MFU model
FLOPs (measure/mfu.py) ÷ step time ÷ measured peak; ×roofline the update over [Note: the update's
roofline]; peak GiB torch.cuda.max_memory_allocated over the timed steps (none on a CPU). Records:
kind KIND; systems in measure/gpu_systems.py, tables in measure/gpu_bench_table.py."""

# [Note: the update's roofline] AdamW's update is memory-bound. Per parameter it reads the fp32
# master p, the gradient g (counted as fp32, 4 B, whatever dtype it arrives in), m and v: 16 B;
# and writes p, m and v: 12 B. A system whose update also refreshes a bf16 working copy from the
# master (ours, plain) writes 2 B more: 30 B per parameter; DDP and FSDP2 keep fp32 parameters
# and cast in forward, so 28 B. Nothing else is counted (casting or scaling the gradient, the
# norm's read, kernel launches), so roofline_ms = bytes × Ψ ÷ the measured device-to-device copy
# bandwidth (bytes read + bytes written ÷ seconds) is a floor no update can beat.

from __future__ import annotations

import argparse
import gc
import os
import socket
import time
import traceback
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from zero.common import cli
from zero.common.results import make_record, provenance, read_json, write_json
from zero.ranks import launch
from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

from . import mfu
from .gpu_bench_table import format_all
from .gpu_systems import LR, OURS, SEED, SYSTEMS, WEIGHT_DECAY, build

KIND = "bench.gpu_step"
"""The results-record kind of one system's measurement."""
PRESETS = {
    # GPT-2 medium's shape (vocabulary padded to 50304): 354.9M parameters
    "medium": {"vocab": 50304, "seq": 1024, "layers": 24, "embd": 1024, "heads": 16, "batch": 8},
    # seconds on a CPU: the dry run
    "tiny": {"vocab": 256, "seq": 32, "layers": 2, "embd": 64, "heads": 2, "batch": 2},
}


def update_bytes(system: str) -> int:
    """Bytes per parameter the update must move ([Note: the update's roofline])."""
    return 28 if system == "ddp" or system.startswith("fsdp2") else 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Marks within a step: CUDA events on a GPU (read after the step's closing sync), so a mark
    is when the GPU reaches it; time.perf_counter on a CPU, whose kernels run synchronously."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)


def copy_bandwidth(device: torch.device, *, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes read + bytes written per second, the best of `repeats` timed copies of one fp32
    tensor into another: 1 GiB on CUDA (HBM, not a cache), 64 MiB on a CPU (the dry run)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages
    clock, best = Clock(device), float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = clock.mark()
        dst.copy_(src)
        t1 = clock.mark()
        _sync(device)
        best = min(best, clock.ms(t0, t1) / 1e3)
    return 2.0 * src.numel() * 4 / best


def time_system(name, gpt, batches, device, *, warmup: int, meshes: dict) -> dict:
    """Build `name`, run one step per batch, and time the steps after the first `warmup`."""
    system, clock, cuda = build(name, gpt, device, meshes), Clock(device), device.type == "cuda"
    step_ms, update_ms, losses = [], [], []
    gc.collect()
    gc.disable()  # a collection pause would be charged to whichever system ran into it
    try:
        for i, (x, y) in enumerate(batches):
            if i == warmup and cuda:  # the states exist now: the peak of steady steps
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = clock.mark()
            loss = system.forward_backward(x, y)
            u0 = clock.mark()
            system.update()
            _sync(device)  # every stream done: the step ends when its last kernel does
            t1 = clock.mark()
            _sync(device)
            losses.append(float(loss.detach().float()))
            if i >= warmup:
                step_ms.append(clock.ms(t0, t1))
                update_ms.append(clock.ms(u0, t1))
    finally:
        gc.enable()
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {"step_ms": step_ms, "update_ms": update_ms, "losses": losses, "peak": peak}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _result(name: str, t: dict, *, gpt, batch: int, psi: int, peak: float, bw: float) -> dict:
    a = np.asarray(t["step_ms"], dtype=np.float64)
    p25, median, p75 = (float(v) for v in np.percentile(a, [25, 50, 75]))
    update = float(np.median(t["update_ms"]))
    flops = mfu.step_flops(gpt, batch)
    roofline_ms = 1e3 * update_bytes(name) * psi / bw  # [Note: the update's roofline]
    return {
        "status": "ok",
        "median_ms": median,
        "p25_ms": p25,
        "p75_ms": p75,
        "iqr_ms": p75 - p25,
        "min_ms": float(a.min()),
        "max_ms": float(a.max()),
        "step_ms": t["step_ms"],
        "update_ms": t["update_ms"],
        "update_median_ms": update,
        "flops_per_step": flops,
        "peak_flops": peak,
        "copy_bandwidth": bw,
        "mfu": mfu.utilisation(flops, median / 1e3, peak)["mfu"],
        "roofline_bytes_per_param": update_bytes(name),
        "roofline_ms": roofline_ms,
        "update_over_roofline": update / roofline_ms,
        "peak_allocated_bytes": t["peak"],
        "peak_memory": "torch.cuda.max_memory_allocated over the timed steps"
        if t["peak"] is not None
        else "not measured on a CPU (null)",
        "losses": t["losses"],
    }


# ---------------------------------------------------------------------------------------------
# The process group and the driver


def join_world(device: torch.device) -> None:
    """Under torchrun, its world (which must be of one rank); otherwise a world of one, made
    here: NCCL on CUDA, gloo on a CPU, rendezvous on a free local port."""
    if launch.under_torchrun():
        if os.environ.get("WORLD_SIZE") != "1":
            raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}: allowed is 1")
        if device.type == "cuda":
            launch.init_from_env()
            return
        launch.check_launch_env(os.environ)
        dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=0, world_size=1)


def run(args: argparse.Namespace, say=print) -> list[dict]:
    """Every system of args in turn, in this process; one record each (status "ok" or "error")."""
    device = torch.device(args.device)
    gpt = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
        n_embd=args.embd, n_head=args.heads,
    )  # fmt: skip
    psi = GPT(gpt, device="meta").num_params()
    peak = mfu.measure_peak_flops(device)
    bw = copy_bandwidth(device)
    _free(device)
    say(f"Ψ = {psi:,}; peak {peak / 1e12:.3g} TFLOP/s; copy {bw / 1e9:.4g} GB/s on {device}")
    batches = [
        tuple(t.to(device) for t in gpt_microbatches(gpt, seed=SEED, data_step=s, count=1,
                                                      batch_size=args.batch)[0])
        for s in range(args.warmup + args.steps)
    ]  # fmt: skip
    prov, meshes, records = provenance(), {}, []
    for name in args.systems:
        config = {
            "benchmark": "gpu_step",
            "system": name,
            "family": "ours" if name in OURS else "peer",
            "stage": int(name[6]) if name in OURS else None,
            "mode": ("deterministic" if name.endswith("-det") else "fast")
            if name in OURS
            else None,
            "gpt": asdict(gpt),
            "num_params": psi,
            "batch_size": args.batch,
            "seq_len": args.seq,
            "precision": "bf16",
            "optimizer": "adamw",
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "weight_decay_on": "matrices (ndim >= 2); none on biases and norms",
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": dist.get_backend(),
            "world_size": 1,
            "steps": args.steps,
            "warmup": args.warmup,
            "seed": SEED,
            "peak_dtype": str(mfu.PEAK_DTYPE[device.type]).removeprefix("torch."),
        }
        t0 = time.perf_counter()
        try:
            t = time_system(name, gpt, batches, device, warmup=args.warmup, meshes=meshes)
            result = _result(name, t, gpt=gpt, batch=args.batch, psi=psi, peak=peak, bw=bw)
        except Exception as exc:  # one failing system must not lose the others
            result = {
                "status": "error",
                "error": cli.error_line(exc)[:500] or type(exc).__name__,
                "traceback": traceback.format_exc(limit=8)[-4000:],
                "peak_flops": peak,
                "copy_bandwidth": bw,
            }
        _free(device)
        records.append(make_record(config=config, result=result, kind=KIND, provenance=prov))
        shown = f"{result['median_ms']:.2f} ms" if result["status"] == "ok" else result["error"]
        say(f"  {name}: {shown} ({time.perf_counter() - t0:.1f} s)")
        if args.json:
            write_json(args.json, {"section": KIND, "records": records})
    return records


def parse(argv=None) -> argparse.Namespace:
    p = cli.new_parser("python -m measure.gpu_bench", __doc__.split("\n\n")[0])
    p.add_argument("--model", choices=PRESETS, default="medium", help="a preset shape and batch")
    for flag, what in (
        ("batch", "sequences per step (B)"),
        ("layers", "transformer blocks (L)"),
        ("embd", "residual width (d)"),
        ("heads", "attention heads"),
        ("vocab", "vocabulary (V)"),
        ("seq", "tokens per sequence (T)"),
    ):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"{what}; default: the preset's")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--from-json", default=None, help="print the table of a results file only")
    args = p.parse_args(argv)
    for k, v in PRESETS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("batch", "layers", "embd", "heads", "vocab", "seq", "steps"):
        if getattr(args, k) < 1:
            raise ValueError(f"{k}={getattr(args, k)!r}: allowed are integers >= 1")
    if args.warmup < 0:
        raise ValueError(f"warmup={args.warmup!r}: allowed are integers >= 0")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type not in ("cuda", "cpu"):
        raise ValueError(f"device={args.device!r}: allowed are cuda and cpu")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={args.device!r}: CUDA is not available here")
    if args.device == "cuda":  # this rank's GPU (torchrun's LOCAL_RANK), named by its index
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if len(set(args.systems)) != len(args.systems):
        raise ValueError(f"systems={args.systems!r}: allowed are distinct names")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.from_json:
        if not os.path.isfile(args.from_json):
            raise ValueError(f"from_json={args.from_json!r}: no such file")
        print(format_all(read_json(args.from_json)["records"]))
        return 0
    if args.json is not None:
        cli.check_writable("json", args.json, file=True)  # before the timing, not after it
    lead = os.environ.get("RANK", "0") == "0"
    say = print if lead else (lambda *a: None)
    started = time.time()
    join_world(torch.device(args.device))
    try:
        records = run(args, say=lambda *a: say(*a, flush=True))
    finally:
        dist.destroy_process_group()
    say(f"{time.time() - started:.0f} s\n")
    say(format_all(records))
    return 0 if all(r["result"]["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    cli.run(main, "python -m measure.gpu_bench")
