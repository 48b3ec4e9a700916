"""python -m measure.largest: the largest GPT one machine trains, per tier of the optimizer states.

    python -m measure.largest --host-gib 20                        # every tier, this machine
    python -m measure.largest --host-gib 20 --tiers disk --dir /data --steps 3
    python -m measure.largest --shape 30 2560 --tiers disk --dir /data   # one model, no search
    python -m measure.largest --host-gib 100 --device cuda --json largest.json   # on a GPU

Tiers (docs/zero_r.md, "Tiers"): "none" (states beside the parameters), "memory"
(offload_optimizer: master and moments in host memory) and "disk" (offload_dir: in files). For a
host budget it walks a ladder of GPT shapes (12·L·d² + V·d parameters), estimates each tier's
host bytes per parameter, and trains (stage 3, bf16, N = 1, built on the meta device, one
sequence per step) the largest shape the estimate admits, each in a fresh process; one that
fails (killed for memory, or an error) is recorded and the next smaller one tried. Each record:
parameters, construction seconds (and per billion parameters), seconds per step, RSS after
construction and its peak (and per parameter), memory_split()'s bytes per placement, the GPU's
peak on CUDA, and for the disk tier the disk bytes each step read and wrote by the process's own
I/O counters (/proc/self/io) beside the engine's count (kind 'disk') and the disk's bandwidth,
measured here first by writing and reading back a file of --probe-gib under --dir.

Every option is checked before any work (the probe, a process, a file): a bad one is one line,
`python -m measure.largest: error: FIELD=VALUE: what is allowed`, and exit status 2. A tier
whose every shape tried failed (or whose one --shape failed) ends the run with one line naming
the shape and why, and exit status 1, after the --json report of what was tried is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

from measure.fake_rank import check_device
from zero.common import cli

VOCAB, BLOCK = 8192, 128
LADDER = [(12, 768), (16, 1024), (24, 1536), (24, 2048), (32, 2560), (32, 3072), (40, 4096),
          (48, 5120), (60, 6144)]  # fmt: skip
"""(layers, width) of the shapes tried, smallest first; heads of 128."""
BYTES_PER_PARAM = {"none": 20.0, "memory": 18.0, "disk": 6.5}
"""Host bytes per parameter each tier is expected to hold at stage 3, bf16, N = 1, on a CPU
(host and device one memory): none, the bf16 working copy 2 + fp32 gradient 4 + master 4 + m 4 +
v 4 + 2 of transients; memory, the same but the transients bounded by units; disk, the working
copy 2 + gradient 4 + a few units' states. Only to choose what to try: the run measures."""


def params_of(layers: int, width: int) -> int:
    """The GPT's parameter count (zero/workloads/models.py: tied head, biases, LayerNorms)."""
    block = 12 * width * width + 13 * width
    return layers * block + VOCAB * width + BLOCK * width + 2 * width


def disk_bandwidth(directory: str, gib: float) -> dict:
    """Write then read back `gib` GiB under `directory`, each through the page cache with the
    file synced and dropped from it in between: MB/s each way."""
    path = Path(directory) / f"zero-bandwidth-{os.getpid()}.bin"
    chunk = b"\1" * CHUNK
    n = probe_bytes(gib) // CHUNK
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(n):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        wrote = time.perf_counter() - t0
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.read(fd, len(chunk)):
            pass
        read = time.perf_counter() - t0
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    mb = n * len(chunk) / 1e6
    return {
        "bytes": n * len(chunk),
        "write_MB_s": round(mb / wrote, 1),
        "read_MB_s": round(mb / read, 1),
    }


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def run_one(
    layers: int,
    width: int,
    tier: str,
    steps: int,
    device: str,
    directory: str,
    reduce_dtype: str | None = None,
) -> dict:
    """One model trained `steps` steps in this process; its record."""
    import torch
    import torch.distributed as dist

    from measure.resident import peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method="tcp://127.0.0.1:"
                            f"{29600 + os.getpid() % 1000}", rank=0, world_size=1)  # fmt: skip
    cfg = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=layers, n_head=width // 128,
                    n_embd=width)  # fmt: skip
    release_free_memory()
    reset_peak_rss()
    base = rss_bytes()
    model = GPT(cfg, device="meta")
    psi = sum(p.numel() for p in model.parameters())
    zcfg = ZeroConfig(
        stage=3, precision="bf16", reduce_dtype=reduce_dtype, micro_batches=1,
        units=tuple(model.unit_names()), chunk=4096,
        offload_optimizer=tier != "none", offload_dir=directory if tier == "disk" else None,
    )  # fmt: skip
    t0 = time.perf_counter()
    eng = ZeroEngine(model, zcfg, init_seed=0, device=device)
    built = time.perf_counter() - t0
    if tier == "disk":
        eng.placement.offload.settle()
    release_free_memory()
    rss_built, peak_built = rss_bytes() - base, peak_rss_bytes() - base
    split = {at: sum(v.values()) for at, v in eng.memory_split().items()}
    times, io = [], []
    for s in range(steps):
        ((x, y),) = gpt_microbatches(cfg, seed=0, data_step=s, count=1, batch_size=1)
        before, t0 = _io(), time.perf_counter()
        _, loss = eng(x.to(device), y.to(device))
        eng.backward(loss)
        eng.step()
        if tier == "disk":
            eng.placement.offload.settle()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        after = _io()
        counted = {op: sum(r.nbytes for r in eng.counter.of_step(s, "disk") if r.op == op)
                   for op in ("disk_read", "disk_write")}  # fmt: skip
        io.append(
            {
                "read_bytes": after["read_bytes"] - before["read_bytes"],
                "write_bytes": after["write_bytes"] - before["write_bytes"],
                **counted,
            }
        )
    release_free_memory()
    out = {
        "layers": layers, "width": width, "params": psi, "tier": tier, "device": device,
        "reduce_dtype": reduce_dtype or "fp32",
        "construct_s": round(built, 2), "construct_s_per_billion": round(built / psi * 1e9, 1),
        "step_s": [round(t, 2) for t in times],
        "rss_built_bytes": rss_built, "rss_built_per_param": round(rss_built / psi, 2),
        "peak_rss_bytes": peak_rss_bytes() - base,
        "peak_rss_per_param": round((peak_rss_bytes() - base) / psi, 2),
        "rss_after_bytes": rss_bytes() - base, "split_bytes": split,
        "split_per_param": {k: round(v / psi, 2) for k, v in split.items()},
        "peak_built_bytes": peak_built, "io_per_step": io,
    }  # fmt: skip
    if device == "cuda":
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def attempt(layers, width, tier, args) -> dict:
    """run_one in a fresh process (a run killed for memory is a record, not our death)."""
    cmd = [sys.executable, "-m", "measure.largest", "--one", str(layers), str(width), tier,
           "--steps", str(args.steps), "--device", args.device, "--dir", args.dir,
           *(["--reduce-dtype", args.reduce_dtype] if args.reduce_dtype else [])]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == 0:
        try:
            return json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            why = f"exit status 0 without a record on stdout: {done.stdout.strip()[-200:]!r}"
    else:
        why = _why(done.returncode, done.stderr)
    return {"layers": layers, "width": width, "tier": tier, "failed": why[:300],
            "returncode": done.returncode}  # fmt: skip


def _why(returncode: int, stderr: str) -> str:
    """A failed child in one line: its last line on stderr, else how it ended."""
    lines = stderr.strip().splitlines()
    if lines:
        return " ".join(lines[-1].split())
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        memory = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return f"killed by {name}{memory}"
    return f"exit status {returncode}"


def search(tier: str, args) -> list[dict]:
    """The ladder's shapes whose estimate fits the budget, largest first, until one trains."""
    budget = args.host_gib * (1 << 30)
    fits = [s for s in LADDER if params_of(*s) * BYTES_PER_PARAM[tier] <= budget]
    tried = []
    for layers, width in reversed(fits):
        rec = attempt(layers, width, tier, args)
        tried.append(rec)
        print(json.dumps(rec), flush=True)
        if "failed" not in rec:
            break
    return tried


PROG = "python -m measure.largest"
TIERS = ("none", "memory", "disk")
HEAD = 128
"""The heads' width: a shape's width is a whole number of heads."""
CHUNK = 64 << 20
"""The disk probe's write size (bytes)."""


def parser() -> argparse.ArgumentParser:
    p = cli.new_parser(PROG, __doc__.split("\n")[0])
    p.add_argument(
        "--host-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="host memory budget to search under, GiB: a finite number at least the "
        "smallest shape's estimate in every tier asked for (ignored with "
        "--shape)",
    )
    p.add_argument(
        "--tiers",
        nargs="+",
        default=list(TIERS),
        choices=TIERS,
        help="the tiers to measure, each at most once (default: none memory disk)",
    )
    p.add_argument(
        "--shape",
        nargs=2,
        type=int,
        metavar=("LAYERS", "WIDTH"),
        default=None,
        help="train this one GPT instead of searching: LAYERS >= 1, WIDTH a positive "
        f"multiple of {HEAD} (the heads are {HEAD} wide)",
    )
    p.add_argument(
        "--steps", type=int, default=2, help="training steps per model, >= 1 (default: 2)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model trains; cuda needs a visible CUDA device (default: cpu)",
    )
    p.add_argument(
        "--dir",
        default=".",
        help="the disk tier's directory and the probe's: existing or creatable, "
        "writable, with room for --probe-gib (default: .; unused without the "
        "disk tier)",
    )
    p.add_argument(
        "--probe-gib",
        type=float,
        default=1.0,
        metavar="GIB",
        help="size of the file written and read back under --dir to measure the "
        "disk's bandwidth, GiB: a finite number > 0 (default: 1)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="the gradients' dtype (bf16 halves the host gradient: 2 bytes/param; default: fp32)",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the report (the probe and every record tried) here: a writable file path",
    )
    p.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)
    return p


def check_shape(layers: int, width: int) -> None:
    """LAYERS >= 1 and WIDTH a whole number of heads; else a ValueError naming shape."""
    if layers < 1:
        why = f"LAYERS {layers} < 1"
    elif width < HEAD or width % HEAD:
        why = f"WIDTH {width} is not a positive multiple of {HEAD}"
    else:
        return
    raise ValueError(
        f"shape=[{layers}, {width}]: {why}; allowed is LAYERS >= 1 and WIDTH a positive multiple "
        f"of {HEAD} (the heads are {HEAD} wide)"
    )


def probe_bytes(gib: float) -> int:
    """What disk_bandwidth writes for `gib`: whole chunks, at least one (exactly: a float
    times 2**30 may overflow)."""
    return max(1, int(Fraction(gib) * (1 << 30)) // CHUNK) * CHUNK


def _nearest_existing(path) -> Path:
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return p


def check(args) -> None:
    """Every option, before any work: a ValueError naming the first bad one."""
    if args.host_gib is None and args.shape is None:
        raise ValueError(
            "host_gib=None: allowed is --host-gib (a budget to search under) or --shape (one "
            "model to train)"
        )
    if args.host_gib is not None:
        if not cli.is_real(args.host_gib) or args.host_gib <= 0:
            raise ValueError(f"host_gib={args.host_gib}: allowed is a finite number > 0 (GiB)")
        if args.shape is None:
            least = params_of(*LADDER[0])
            for tier in args.tiers:
                need = math.ceil(least * BYTES_PER_PARAM[tier] / (1 << 30) * 100) / 100
                if args.host_gib < need:
                    raise ValueError(
                        f"host_gib={args.host_gib}: below the estimate of the smallest shape "
                        f"({LADDER[0][0]}x{LADDER[0][1]}, {least / 1e6:.0f}M parameters) in tier "
                        f"{tier!r}; allowed is at least {need} (or --shape)"
                    )
    if len(set(args.tiers)) != len(args.tiers):
        raise ValueError(f"tiers={args.tiers}: allowed is each of {', '.join(TIERS)} at most once")
    if args.shape is not None:
        check_shape(*args.shape)
    if args.steps < 1:
        raise ValueError(f"steps={args.steps}: allowed is a whole number >= 1")
    if not cli.is_real(args.probe_gib) or args.probe_gib <= 0:
        raise ValueError(f"probe_gib={args.probe_gib}: allowed is a finite number > 0 (GiB)")
    if args.json is not None:
        cli.check_writable("json", args.json, file=True)
    if "disk" in args.tiers:
        cli.check_writable("dir", args.dir)
        st = os.statvfs(_nearest_existing(args.dir))
        free, need = st.f_bavail * st.f_frsize, probe_bytes(args.probe_gib)
        if free < need:
            raise ValueError(
                f"dir={args.dir!r}: {free} bytes free, the disk probe (probe_gib="
                f"{args.probe_gib}) writes {need}; allowed is a folder with room for it (or a "
                f"smaller --probe-gib)"
            )
    check_device(args.device)


def failed_line(tier: str, records: list[dict]) -> str | None:
    """None if a shape of `tier` trained; else one line: the shape that failed last, and why."""
    if any("failed" not in r for r in records):
        return None
    if not records:
        return f"tier {tier!r}: no shape tried"
    last = records[-1]
    shape = f"{last['layers']}x{last['width']}"
    psi = params_of(last["layers"], last["width"])
    size = f"{psi / 1e9:.2f}B" if psi >= 1e9 else f"{psi / 1e6:.0f}M"
    size += " parameters"
    where = f"shape {shape} ({size})"
    if len(records) > 1:
        where = f"all {len(records)} shapes tried, the smallest {shape} ({size}),"
    return f"tier {tier!r}: {where} failed (exit status {last.get('returncode')}): {last['failed']}"


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.one:
        layers, width, tier = int(args.one[0]), int(args.one[1]), args.one[2]
        check_shape(layers, width)
        rec = run_one(layers, width, tier, args.steps, args.device, args.dir, args.reduce_dtype)
        print(json.dumps(rec))
        return 0
    check(args)  # before any work: the probe, a process, a file
    if "disk" in args.tiers:
        os.makedirs(args.dir, exist_ok=True)
    # the probe under a key of its own: the disk tier's records are report["disk"]
    probe = disk_bandwidth(args.dir, args.probe_gib) if "disk" in args.tiers else None
    report = {"disk_bandwidth": probe}
    print(json.dumps(report), flush=True)
    for tier in args.tiers:
        if args.shape is not None:
            rec = attempt(*args.shape, tier, args)
            print(json.dumps(rec), flush=True)
            report[tier] = [rec]
        else:
            report[tier] = search(tier, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    failed = [line for t in args.tiers if (line := failed_line(t, report[t])) is not None]
    if failed:
        print(f"{PROG}: error: measurement failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    cli.run(main, PROG)
