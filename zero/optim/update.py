"""SGD, Adam and AdamW on flat fp32 shards, run by parameter-group runs.

Deterministic mode executes reference/optim.py's sequence ([Note: op-ordered optimizers] there),
with the reference's bits: Adam and AdamW in one Triton kernel on CUDA or one compiled loop on
the CPU where they run (triton_kernels.py, native.py), else in primitive torch ops with the
step's float32 scalars ([Note: correctly rounded sqrt]). Fast mode hands the same shard to
torch's own kernels (the fused Adam/AdamW on CPU and CUDA), whose bound against the reference
is verify/checks/bounds.optimizer_step_error.

Padding elements are zeros with zero gradients and zero states; every optimizer here maps them
to zeros again (0·x = 0, 0/eps = 0), so a run may include alignment gaps. Parameters that had
no gradient in a step are left out of its runs ([Note: skipping unused parameters]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.optim import adam as torch_adam
from torch.optim import adamw as torch_adamw
from torch.optim import sgd as torch_sgd

from reference import optim as ref_optim
from reference.optim import Hyper

from ..partition import Run
from . import native as optim_native
from . import triton_kernels as optim_triton
from .plain import torch_kwargs

STATE_NAMES = ref_optim.state_names


def step_scalars(kind: str, hp: Hyper, t: int) -> dict[str, np.float32]:
    """Step t's float32 scalars, the reference's: the one source of both kernels below (the
    compiled loop and the torch ops), so a change here reaches whichever one runs."""
    return ref_optim.step_scalars(kind, hp, t)


def _scalars(kind: str, hp: Hyper, t: int) -> dict[str, torch.Tensor]:
    # 0-dim float32 tensors on the host: a Python float would be rounded by the kernel's own
    # rules; a 0-dim tensor of the same dtype is multiplied as it is, on any device, as a
    # kernel argument ([Note: host scalars] in zero/collectives.py)
    return {
        k: torch.tensor(float(v), dtype=torch.float32) for k, v in step_scalars(kind, hp, t).items()
    }


def _sqrt(v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = sqrt(v), correctly rounded to float32 ([Note: correctly rounded sqrt])."""
    if v.device.type == "cpu":
        np.sqrt(v.numpy(), out=out.numpy())  # the reference's own operation, on shared memory
        return out
    return torch.sqrt(v, out=out)  # CUDA's float32 sqrt is IEEE correctly rounded by default


# [Note: correctly rounded sqrt] torch's float32 sqrt on CPU is not correctly rounded
# (MACHINE_NOTES: off by 1 ulp on ~18% of inputs). The reference takes NumPy's float32 sqrt,
# which is the processor's IEEE sqrt instruction (correctly rounded, like CUDA's default sqrt),
# so on CPU the engine calls the same NumPy function on the tensor's memory. (It went through
# float64 before, whose sqrt rounds back to float32 exactly too: the same bits in three passes,
# the float64 sqrt the slowest of the step's operations; measure/optim_speed.py compares them.)


def deterministic_step(kind, hp: Hyper, t: int, p, g, state: dict[str, torch.Tensor]) -> None:
    """reference.optim.step, in place on tensors p (fp32 master), g and state (views allowed),
    by the first of the module docstring's paths that runs."""
    if kind != "sgd":
        on, s = bool(hp.weight_decay), step_scalars(kind, hp, t)
        moments = (state["exp_avg"], state["exp_avg_sq"])
        if optim_triton.adam_runs(kind, [(0, p.numel(), s, on)], p, g, *moments):
            return
        if optim_native.adam(kind, on, s, p, g, *moments):
            return
    torch_ops_step(kind, hp, t, p, g, state)


def torch_ops_step(kind, hp: Hyper, t: int, p, g, state: dict[str, torch.Tensor]) -> None:
    """deterministic_step in primitive torch ops, for SGD and where no kernel runs: the step's
    float32 scalars, block by block ([Note: in-place blocks])."""
    s = _scalars(kind, hp, t)
    block = op_block(p)
    ws = _Workspace(min(block, p.numel()), p.device, kind, hp)
    for lo in range(0, p.numel(), block):
        sl = slice(lo, lo + block)
        if kind == "sgd":
            buf = state["momentum_buffer"][sl] if hp.momentum else None
            _sgd_block(hp, s, t, p[sl], g[sl], buf, ws)
        else:
            _adam_block(
                kind, hp, s, p[sl], g[sl], state["exp_avg"][sl], state["exp_avg_sq"][sl], ws
            )


def op_block(p: torch.Tensor) -> int:
    """The torch ops' block: BLOCK on the CPU, where it keeps the operands in cache; the
    whole run elsewhere, where a loop over blocks would be host work that grows with the
    shard ([Note: host work flat in Ψ], measure/hostwork.py)."""
    return BLOCK if p.device.type == "cpu" else max(1, p.numel())


BLOCK = 1 << 18
"""[Note: in-place blocks] The deterministic update runs in blocks of 256K elements, in place,
each operation the reference's own, on the whole block, in the reference's order: an
elementwise op rounds the same whether it writes a new tensor, its operand or a workspace, and
+ and · are commutative in IEEE arithmetic, so no bit changes. A block's operands and the
workspace (1 MiB per fp32 array) stay in cache across the fourteen passes, where whole-shard
tensors would stream through memory on every pass (about twice the time on a 3.7M-element
shard); the workspace is allocated once per call, not per block. Smaller blocks pay more
Python per element. measure/optim_speed.py times the choice (2^17-2^19 were level, and 2^16
slower, on the 2-core machine) against the kernel before these notes."""


class _Workspace:
    """Block-sized scratch tensors, reused by every block of one call."""

    def __init__(self, n: int, device, kind: str, hp: Hyper):
        self.tmp = torch.empty(n, dtype=torch.float32, device=device)
        self.g = torch.empty(n, dtype=torch.float32, device=device) if hp.weight_decay else None
        self.d = torch.empty(n, dtype=torch.float32, device=device)


def _sgd_block(hp: Hyper, s, t: int, p, g, buf, ws: _Workspace) -> None:
    n = p.numel()
    if hp.weight_decay:  # g + s(wd)·p, into the workspace: g may be the caller's gradient
        g = torch.mul(p, s["wd"], out=ws.g[:n]).add_(g)
    if hp.momentum:
        if t == 1:
            buf.copy_(g)
        else:  # buf·s(mom) + g·s(1 - dampening)
            buf.mul_(s["mom"]).add_(torch.mul(g, s["one_minus_damp"], out=ws.tmp[:n]))
        if hp.nesterov:  # g + s(mom)·buf
            g = torch.mul(buf, s["mom"], out=ws.tmp[:n]).add_(g)
        else:
            g = buf
    p.sub_(torch.mul(g, s["lr"], out=ws.d[:n]))


def _adam_block(kind, hp: Hyper, s, p, g, m, v, ws: _Workspace) -> None:
    n = p.numel()
    tmp, d = ws.tmp[:n], ws.d[:n]
    if kind == "adamw":
        if hp.weight_decay:
            p.mul_(s["decay"])
    elif hp.weight_decay:  # g + s(wd)·p, into the workspace: g may be the caller's gradient
        g = torch.mul(p, s["wd"], out=ws.g[:n]).add_(g)
    m.mul_(s["b1"]).add_(torch.mul(g, s["one_minus_b1"], out=tmp))
    v.mul_(s["b2"]).add_(torch.mul(g, g, out=tmp).mul_(s["one_minus_b2"]))
    _sqrt(v, d).mul_(s["inv_sqrt_bc2"]).add_(s["eps"])
    p.sub_(torch.div(m, d, out=d).mul_(s["step_size"]))


def fast_step(kind, hp: Hyper, t: int, ps, gs, states: list[dict[str, torch.Tensor]]) -> None:
    """torch's own functional kernels (not bitwise; bounded) on the runs ps (fp32 master
    slices) with gradients gs and states, all of one group and one step count t, on one
    device: Adam and AdamW in one multi-tensor fused call ([Note: one update launch])."""
    if kind == "sgd":
        return _fast_sgd(hp, t, ps, gs, states)
    fn = torch_adamw.adamw if kind == "adamw" else torch_adam.adam
    (b1, b2), device = hp.betas, ps[0].device
    # the step counts, before this step, on the device: made by a fill kernel, not copied
    # from the host; the fused kernel adds 1 to each in place
    counts = torch.full((len(ps),), float(t - 1), dtype=torch.float32, device=device)
    m, v = [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]
    hyper = {"lr": hp.lr, "weight_decay": hp.weight_decay, "eps": hp.eps, "beta1": b1, "beta2": b2}
    # the fused kernel (CPU and CUDA) is 3-4x faster than the single-tensor one on a
    # 2M-element shard; the lock-step bound covers any implementation's rounding
    fused, steps = device.type in ("cpu", "cuda"), list(counts.unbind())
    fn(list(ps), list(gs), m, v, [], steps, amsgrad=False, maximize=False, fused=fused, **hyper)


def _fast_sgd(hp: Hyper, t: int, ps, gs, states) -> None:
    """fast_step for SGD: torch's single-tensor kernel on each run."""
    for p, g, state in zip(ps, gs, states, strict=True):
        buf = state.get("momentum_buffer")
        bufs = [None if t == 1 else buf]  # torch creates the buffer on the first step
        torch_sgd.sgd([p], [g], bufs, **torch_kwargs("sgd", hp), maximize=False, foreach=False)
        if buf is not None and bufs[0] is not buf:
            buf.copy_(bufs[0])


def live_runs(runs: list[Run], slots, lo: int, used, steps) -> list[tuple[Run, int]]:
    """[Note: skipping unused parameters] The runs to update this step, each with t_p, the
    step count after it, of the parameters it covers (reference/step.py's [Note: unused
    parameters]). `slots` are the unit's parameter slots, `lo` the extent's first element in
    the padded buffer, `used` and `steps` per slot. Each run is cut at the slot edges where
    used or t_p change (a slot takes the gap after it); pieces of unused parameters are left
    out. Every optimizer is elementwise, so cutting a run changes no bit. Fast path: every
    parameter used and at one count, the runs as they are."""
    if all(used) and len(set(steps)) <= 1:
        return [(run, (steps[0] if steps else 0) + 1) for run in runs]
    out: list[tuple[Run, int]] = []
    for run in runs:
        pieces = []  # (start, used, t_p), in order; each piece runs to the next one's start
        for slot, use, t_p in zip(slots, used, steps, strict=True):
            a, b = max(slot.offset - lo, run.start), min(slot.offset + slot.numel - lo, run.stop)
            if a < b:
                start = a if pieces else run.start  # a gap before the first slot joins it
                if not pieces or pieces[-1][1:] != (use, t_p + 1):
                    pieces.append((start, use, t_p + 1))
        for i, (start, use, t_p) in enumerate(pieces):
            stop = pieces[i + 1][0] if i + 1 < len(pieces) else run.stop
            if use:
                out.append((Run(start=start, stop=stop, group=run.group), t_p))
    return out


@dataclass(frozen=True)
class Shard:
    """One unit's update: its flat fp32 master shard, unscaled gradient and state shards, and
    the runs to update this step, each with its t_p (live_runs)."""

    master: torch.Tensor  # 1D fp32, this rank's extent
    grad: torch.Tensor  # 1D, the master's length (fp32, or cast to it per run)
    states: dict[str, torch.Tensor]  # name -> 1D fp32, the master's length
    runs: list[tuple[Run, int]]


def step_shards(
    kind: str, groups: tuple[Hyper, ...], shards: list[Shard], *, deterministic: bool
) -> None:
    """Update flat master shards in place.

    [Note: one update launch] Deterministic mode runs one Triton kernel per unit shard on
    CUDA, each run with its own scalars, and elsewhere one kernel per run (the compiled loop or
    the torch ops). Fast mode gathers the runs of every shard given by
    (group, t_p, device) and hands each set to one multi-tensor fused call: on CUDA one launch
    for all units where the hyper-parameters agree, instead of one per unit and run. Every
    optimizer is elementwise, so how runs are batched changes no bit (tests/unit/
    test_optim_blocks.py compares batched with one call per run)."""
    batches: dict[tuple, list] = {}
    # shards the Triton kernel updated whole (deterministic, CUDA) are done; the rest go by run
    rest = [sh for sh in shards if not (deterministic and _whole_shard(kind, groups, sh))]
    for sh in rest:
        for run, t in sh.runs:
            hp = groups[run.group]
            sl = slice(run.start, run.stop)
            st = {k: sh.states[k][sl] for k in STATE_NAMES(kind, hp)}
            item = (sh.master[sl], sh.grad[sl].float(), st)
            if deterministic:
                deterministic_step(kind, hp, t, *item)
            else:
                batches.setdefault((run.group, t, sh.master.device), []).append(item)
    for (group, t, _), items in batches.items():
        ps, gs, sts = zip(*items)
        fast_step(kind, groups[group], t, ps, gs, list(sts))


def _whole_shard(kind: str, groups: tuple[Hyper, ...], sh: Shard) -> bool:
    """Deterministic Adam/AdamW over every run of one unit shard in one Triton launch, where
    it runs (CUDA); False, touching nothing, elsewhere."""
    if kind == "sgd" or not optim_triton.available(sh.master.device):
        return False
    runs = []
    for run, t in sh.runs:
        hp = groups[run.group]
        runs.append((run.start, run.stop, step_scalars(kind, hp, t), bool(hp.weight_decay)))
    moments = (sh.states["exp_avg"], sh.states["exp_avg_sq"])
    return optim_triton.adam_runs(kind, runs, sh.master, sh.grad.float(), *moments)


def update_batches(shards: list[Shard]) -> list[list[int]]:
    """Which units' updates run together before their working copies are refreshed
    ([Note: one update launch]): on CUDA all of them (kernels are queued, so the refreshes
    lose nothing by waiting in the queue, and fast mode launches once); on a host (the CPU, or
    offload's host shards) one unit at a time, so that each unit's refresh (its all-gather,
    its copy to the device) runs while the next unit's update computes."""
    on_device = [sh.master.device.type == "cuda" for sh in shards]  # shards, or units
    if shards and all(on_device):
        return [list(range(len(shards)))]
    return [[i] for i in range(len(shards))]
