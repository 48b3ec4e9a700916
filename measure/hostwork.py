"""python -m measure.hostwork: the host work of one training step, counted, not timed, by phase.

    python -m measure.hostwork                       # GPT of 24 units at about 4M, 101M and 355M
    python -m measure.hostwork --widths 64 128 --layers 2 --stages 0 3 --deterministic

On a GPU the host must stay ahead of the device; host work that grows with the model's size
stops it doing so ([Note: host work flat in Ψ]). Counts are deterministic, so tests assert them
and this command prints them. Legend: Ψ parameters; calls = Python function calls; ops = aten
operators dispatched; reads = device→host reads (item, tolist, bool/float/int of a tensor, .cpu(),
.numpy()), each a host↔device synchronisation on CUDA; makes = tensors made from host data
with a device argument (torch.tensor(..., device=d)), each a blocking copy on CUDA. A .to(d) is
not counted: on a CPU its target cannot be told from the host.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = frozenset(
    {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"}
)
"""Tensor methods that copy device values to the host: on CUDA each waits for the stream."""
MAKES = frozenset({"tensor", "as_tensor", "from_numpy"})
"""Factories from host data: on CUDA, with a device, a blocking host→device copy."""
PHASES = ("forward", "backward", "step")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# [Note: host work flat in Ψ] At a fixed number of units, everything the engine does per step
# on the host (Python calls, operators dispatched, device→host reads) must not depend on how many
# elements the units hold: on a GPU the kernels take microseconds per million elements, and a
# Python loop over chunks or blocks takes milliseconds per thousand. So the engine loops over
# units, runs and parameter groups, never over elements, chunks or fixed-size blocks, and reads
# the device once per step (the control exchange, zero/control.py).
# tests/distributed/test_hostwork.py counts one step at two widths with the same units and
# asserts equal counts.


@dataclass
class Counts:
    """One phase's host work."""

    calls: int = 0
    ops: int = 0
    reads: int = 0
    makes: int = 0
    read_sites: collections.Counter = field(default_factory=collections.Counter)
    """(kind, file:function) of each read and make, the first frame outside torch."""


def _site() -> str:
    f = sys._getframe(2)
    while f is not None and (
        os.sep + "torch" + os.sep in f.f_code.co_filename or f.f_code.co_filename == __file__
    ):
        f = f.f_back
    if f is None:
        return "?"
    here = os.path.relpath(f.f_code.co_filename, _REPO)
    return f"{here}:{f.f_code.co_name}"


class _Functions(TorchFunctionMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.counts.reads += 1
            self.counts.read_sites[(name, _site())] += 1
        elif name in MAKES and kwargs.get("device") is not None:
            self.counts.makes += 1
            self.counts.read_sites[(name, _site())] += 1
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def python_calls(counts: Counts):
    """Count Python function calls made on this thread inside the block. The heartbeat reads of
    a collective's wait that outlasts a slice (zero/ranks/watchdog.py's _name_silent, once per
    SLICE_S of waiting) and the timed waits of point-to-point gathers (one per slice) are not
    counted, nor anything they call: their number follows how long the wait took on a loaded
    machine, not the model, and would make the count a timing."""
    from zero import collectives
    from zero.ranks import watchdog

    # and a point-to-point gather's timed wait ([Note: no timed point-to-point waits] in
    # zero/collectives.py), entered again after every slice the gather outlasts
    works = collectives._Works
    waiting = {watchdog._name_silent.__code__, works.wait.__code__, works.is_completed.__code__}
    inside = [0]  # depth inside a heartbeat read

    def profile(frame, event, arg):
        if event == "call":
            if inside[0] or frame.f_code in waiting:
                inside[0] += 1
            else:
                counts.calls += 1
        elif event == "return" and inside[0]:
            inside[0] -= 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


@contextlib.contextmanager
def torch_work(counts: Counts):
    """Count dispatched aten operators, device→host reads and tensors made from host data."""
    with _Functions(counts), _Dispatch(counts):
        yield counts


def count_step(engine, batch, *, loss_of=lambda out: out[1]) -> dict[str, Counts]:
    """Counts of one step (forward, backward, step) at M = N: the step is run twice, once under
    the Python profile hook and once under the torch modes, so neither inflates the other.
    Python's cyclic garbage collector is paused while counting: when it runs depends on every
    thread's allocations (the heartbeat thread's too), and the finalizers it calls would count
    as the step's calls on a loaded machine and not on an idle one."""
    out: dict[str, Counts] = {p: Counts() for p in PHASES}
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for counter in (python_calls, torch_work):
            with counter(out["forward"]):
                result = engine(*batch)
            with counter(out["backward"]):
                engine.backward(loss_of(result))
            with counter(out["step"]):
                engine.step()
    finally:
        if collecting:
            gc.enable()
    return out


def gpt_engine(
    width: int,
    layers: int,
    stage: int,
    deterministic: bool,
    *,
    precision="bf16",
    device="cpu",
    options=None,
):
    """A 24-unit (or `layers`-unit) GPT-2-shaped model of width d in one engine at N = 1, on
    this process's one-rank gloo group (or on every rank of the world there is, one micro-batch
    each), with a one-token-wide batch (the counts do not depend on the batch; the optimizer's
    elements do not depend on it either). options: more ZeroConfig fields (ZeRO++'s, HSDP's)."""
    import torch.distributed as dist

    from reference.optim import Hyper
    from zero.config import ZeroConfig, decay_matrices_only
    from zero.engine import ZeroEngine
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    heads = max(1, width // 64)
    gpt = GPTConfig(vocab_size=50304, block_size=8, n_layer=layers, n_head=heads, n_embd=width)
    model = GPT(gpt, device=torch.device(device), seed=0)
    config = ZeroConfig(
        stage=stage,
        precision=precision,
        deterministic=deterministic,
        optimizer="adamw",
        groups=(Hyper(lr=3e-4, weight_decay=0.1), Hyper(lr=3e-4)),
        group_of=decay_matrices_only,
        micro_batches=dist.get_world_size(),
        units=tuple(model.unit_names()),
        overlap=True,
        **(options or {}),
    )
    engine = ZeroEngine(model, config)
    (batch,) = gpt_microbatches(gpt, seed=dist.get_rank(), data_step=0, count=1, batch_size=1)
    return engine, tuple(x.to(device) for x in batch)


def one_rank_group(device="cpu"):
    """A one-rank group for this process (NCCL on CUDA, else gloo), if none exists yet;
    returns a closer."""
    import torch.distributed as dist

    if dist.is_initialized():
        return lambda: None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    return dist.destroy_process_group


def measure(
    width, layers, stage, deterministic, *, warmup=1, device="cpu", options=None
) -> tuple[int, dict[str, Counts]]:
    """(Ψ, per-phase counts) of one step after `warmup` steps (the first step allocates)."""
    engine, batch = gpt_engine(width, layers, stage, deterministic, device=device, options=options)
    psi = sum(p.numel() for p in engine.module.parameters())
    for _ in range(warmup):
        engine.backward(engine(*batch)[1])
        engine.step()
    return psi, count_step(engine, batch)


def format_rows(rows) -> str:
    head = "| stage | mode | d | Ψ | phase | Python calls | aten ops | reads | makes |"
    lines = [head, "|" + "---|" * 9]
    for stage, mode, width, psi, counts in rows:
        for phase in PHASES:
            c = counts[phase]
            lines.append(
                f"| {stage} | {mode} | {width} | {psi / 1e6:.1f}M | {phase} | {c.calls} | "
                f"{c.ops} | {c.reads} | {c.makes} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m measure.hostwork", description=__doc__)
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 3], choices=range(4))
    ap.add_argument("--deterministic", action="store_true", help="deterministic mode, not fast")
    ap.add_argument("--sites", action="store_true", help="list where each read happens")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the counts of the CUDA path")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    close = one_rank_group(args.device)
    rows = []
    mode = "deterministic" if args.deterministic else "fast"
    try:
        for stage in args.stages:
            for width in args.widths:
                psi, counts = measure(
                    width, args.layers, stage, args.deterministic, device=args.device
                )
                rows.append((stage, mode, width, psi, counts))
                print(f"stage {stage} d {width}: Ψ = {psi:,}", flush=True)
    finally:
        close()
    print(format_rows(rows))
    if args.sites:
        for stage, _, width, _, counts in rows:
            for phase in PHASES:
                for (kind, site), k in sorted(counts[phase].read_sites.items()):
                    print(f"stage {stage} d {width} {phase}: {k} × {kind} at {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
