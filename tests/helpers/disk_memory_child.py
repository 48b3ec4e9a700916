"""One rank training an MLP whose master and Adam states exceed what it is allowed to hold, for
tests/distributed/test_disk_bounded.py: what its resident set and the kernel's I/O counters say.

`python -m tests.helpers.disk_memory_child STORE OFFLOAD_DIR|- STEPS`: joins a one-rank gloo
world through the file STORE, fixes glibc's mmap threshold (MMAP_THRESHOLD: freed tensors go
back to the kernel, so RSS follows the live bytes), trains a small engine of the same
configuration (the code pages and first allocations of a step are then in the baseline, not in
what is measured), and from a quiescent baseline (gc + malloc_trim, VmHWM reset) builds the large
engine (CONFIG: stage 3, bf16, N = 1, on the meta device; offload_optimizer=True, and offload_dir
unless it is "-": the control, the states in host memory) and trains STEPS steps. It prints one
JSON line: the shapes of the module's layers, /proc/self/status's RssAnon, RssFile, RssShmem,
VmRSS at the baseline, after construction and after every step (each quiescent), VmHWM at the
end (the peak since the baseline, construction included), the largest RssAnon and RssFile a
sampler thread saw (read every SAMPLE_S: a lower bound on each one's peak), and /proc/self/io's
counters around every step. The disk tier's write-backs are waited for (settle) before a step's
counters are read, so each step's window holds its own I/O. Nothing here reads the engine's own
accounting (memory_split, its traffic counter).
"""

import ctypes
import ctypes.util
import json
import sys
import threading
import time

import torch
import torch.distributed as dist

from measure.resident import release_free_memory, reset_peak_rss
from zero.common import cli
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.workloads.models import MLP, MLPConfig, mlp_microbatches

BIG = MLPConfig(d_in=128, d_hidden=768, d_out=128, n_layer=57)
"""56 hidden units of 768 x 768 + 768 parameters and a root of 768 x 128 + 128: 32.7M
parameters, 392 MB of fp32 master + two Adam moments, 7.1 MB of them per hidden unit."""
SMALL = MLPConfig(d_in=128, d_hidden=128, d_out=128, n_layer=4)
"""The warm-up engine: the same kinds of layers and every code path of a step, in a few MB."""
CONFIG = dict(
    stage=3, precision="bf16", reduce_dtype="bf16", optimizer="adamw", micro_batches=1, chunk=256
)
"""bf16 gradients, as measure.largest's disk row (docs/zero_r.md, "Tiers"). chunk: 768 x 769,
128 x 768 + 768 and 128 x 768 are whole chunks of 256 (the root's 128-element bias adds 128)."""
BATCH = 8
SAMPLE_S = 0.005
FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM")
MMAP_THRESHOLD = 128 * 1024
"""glibc's default mmap threshold, held fixed: left alone, it rises with each freed block up to
32 MiB, and freed unit-sized tensors below it stay resident in the heap (measure/resident.py,
[Note: malloc keeps freed blocks]), which is the allocator's memory, not the engine's. Both the
disk run and the control take this setting."""
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def fix_malloc() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1, "glibc's mallopt refused"
    assert libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD) == 1, "glibc's mallopt refused"


def status() -> dict[str, int]:
    """FIELDS of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def build(cfg: MLPConfig, directory: str | None) -> tuple[MLP, ZeroEngine]:
    model = MLP(cfg, device="meta")
    config = ZeroConfig(
        **CONFIG, units=tuple(model.unit_names()), offload_optimizer=True, offload_dir=directory
    )
    return model, ZeroEngine(model, config, init_seed=0, device="cpu")


def step(eng: ZeroEngine, cfg: MLPConfig, s: int) -> None:
    ((x, y),) = mlp_microbatches(cfg, seed=0, data_step=s, count=1, batch_size=BATCH)
    _, loss = eng(x, y)
    eng.backward(loss)
    eng.step()
    if eng.config.offload_dir is not None:
        eng.placement.offload.settle()


class Sampler(threading.Thread):
    """The largest RssAnon and RssFile seen, read every SAMPLE_S until stopped."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            now = status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], now[k])
            time.sleep(SAMPLE_S)


def main(argv) -> int:
    store, directory, steps = argv
    directory = None if directory == "-" else directory
    fix_malloc()
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    torch.set_num_threads(1)  # two such processes run at once on two cores
    _, small = build(SMALL, directory)
    for s in range(2):
        step(small, SMALL, s)
    del small
    release_free_memory()
    assert reset_peak_rss(), "/proc/self/clear_refs is not writable: VmHWM cannot be reset"
    base = status()
    sampler = Sampler()
    sampler.start()
    model, eng = build(BIG, directory)
    if directory is not None:
        eng.placement.offload.settle()
    release_free_memory()
    built, rows = status(), []
    for s in range(int(steps)):
        before, t0 = io(), time.perf_counter()
        step(eng, BIG, s)
        seconds, after = time.perf_counter() - t0, io()
        release_free_memory()
        rows.append({"seconds": seconds, "io": {k: after[k] - before[k] for k in after},
                     "status": status()})  # fmt: skip
    sampler.stop.set()
    sampler.join()
    print(json.dumps({
        "layers": [[list(p.shape) for p in layer.parameters()] for layer in model.layers],
        "units": list(model.unit_names()), "base": base, "built": built, "steps": rows,
        "hwm": status()["VmHWM"], "sampled": sampler.peak,
    }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    cli.run(main, "disk_memory_child", sys.argv[1:])
