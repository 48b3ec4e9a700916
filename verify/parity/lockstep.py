"""One lock-step of the parity section (verify/parity/section.py, whose docstring states the loop):
the
plain PyTorch side (Plain, the textbook loop restarted from the engine's state every step, and
PlainStep, what it computed), the elementwise bounds on |engine - plain| derived from plain-side
magnitudes (step_bounds, whose docstring has the derivation) and the checks of one lock-step
against them (check_step); with the semantics bugs that can be planted into the plain side
(PLANTS). A cell here is a verify.parity.section.ParityCell and a family a
verify.parity.section.Family.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..cells.cell import GROUPS
from ..checks.bounds import gamma, optimizer_step_error
from ..checks.expect import decay_groups
from ..checks.harness import loss_bound
from .anchors import REF_NORM_DEPTH, STATES, U64, U, norm_rel_error, peer_optimizer, ratio

CHECKS = ("loss", "norm", "master", *STATES, "buffers")
"""What check_step compares after each lock-step, each as its worst ratio diff/bound."""
PLANTS = ("coupled_decay", "no_mean")
"""Semantics bugs planted into the plain side: torch.optim.Adam (L2 decay coupled into the
gradient) in place of AdamW, and micro-batch losses not divided by M. Each must fail a cell."""


# -- the plain side -----------------------------------------------------------------------------


def family_loss(output):
    """The loss of a family's forward, read the same way for both sides: the second element of
    the project's (logits, loss) tuples, a Hugging Face output's `.loss`."""
    return output[1] if isinstance(output, tuple) else output.loss


@dataclass
class PlainStep:
    """What one plain step computed, and the magnitudes its bounds need (plain-side values)."""

    losses: list[float]
    norm: float
    grad: dict[str, np.ndarray]  # the averaged gradient before clipping, fp32
    abs_sum: dict[str, np.ndarray]  # Σ_j |g_j / M|, float64
    clipped: dict[str, np.ndarray]  # the gradient AdamW used
    master: dict[str, np.ndarray]
    opt: dict[str, dict[str, np.ndarray]]
    buffers: dict[str, np.ndarray]
    groups: dict[str, int]  # the parameter groups it stepped (verify.checks.expect.decay_groups)


class Plain:
    """The textbook loop of verify/parity/section.py's module docstring, restarted from a given
    state
    every step; `family` is the cell's (verify.parity.section.FAMILIES[cell.family])."""

    def __init__(self, cell, family):
        self.cell, self.batch = cell, family.batch
        self.model = family.build()  # fp32: the master the optimizer steps
        # a tied parameter once; frozen ones are no optimizer's business (torch.optim over the
        # trainable parameters), and their bf16 copy is cast once, as the engine's
        self.named = [(k, p) for k, p in self.model.named_parameters() if p.requires_grad]
        bf16 = cell.precision == "bf16"
        self.work = copy.deepcopy(self.model).to(torch.bfloat16) if bf16 else self.model
        self.work_named = dict(self.work.named_parameters())
        # the groups as verify states them, not by the engine's predicate (its config's input)
        self.groups = decay_groups(self.model)
        members = [[], []]
        for name, p in self.named:
            members[self.groups[name]].append(p)
        kind = "adam" if cell.plant == "coupled_decay" else "adamw"
        groups = [(ps, hp) for ps, hp in zip(members, GROUPS["adamw"]) if ps]
        self.opt = peer_optimizer(kind, groups)  # A4: single-tensor
        self.abs_sum: dict[str, torch.Tensor] = {}
        if not bf16:  # fp32: g_j / M as backward hands it to .grad's accumulation
            for name, p in self.named:
                p.register_hook(lambda g, name=name: self._record(name, g))

    def _record(self, name: str, g: torch.Tensor) -> None:
        a = g.detach().double().abs()
        self.abs_sum[name] = self.abs_sum[name] + a if name in self.abs_sum else a

    def _inputs(self, batch):
        if isinstance(batch, dict):
            return (), batch
        dtype = next(self.work.parameters()).dtype  # positional floats in the compute dtype
        return [x.to(dtype) if x.is_floating_point() else x for x in batch], {}

    def step(self, master, opt_state, t: int, buffers: dict, step: int) -> PlainStep:
        cell, m, n = self.cell, self.cell.micro_batches, self.cell.world_size
        with torch.no_grad():
            for name, p in self.named:
                p.copy_(master[name])
                p.grad = None
                self.opt.state[p] = {"step": torch.tensor(float(t))}
                self.opt.state[p].update({k: opt_state[name][k].clone() for k in STATES})
            if self.work is not self.model:
                for name, p in self.named:
                    self.work_named[name].copy_(p)  # the master rounded to bf16
            for name, b in self.work.named_buffers():
                b.copy_(buffers[name])
        self.abs_sum, losses = {}, []
        live = dict(self.work.named_buffers())
        for j in range(m):
            # DDP(broadcast_buffers=True): rank 0's buffers survive, so only the micro-batches
            # rank 0 runs (j mod N = 0) may update them
            kept = None if j % n == 0 else {k: b.clone() for k, b in live.items()}
            args, kwargs = self._inputs(self.batch(step, j))
            loss = family_loss(self.work(*args, **kwargs))
            losses.append(float(loss.detach().float()))
            (loss if cell.plant == "no_mean" else loss / m).backward()
            if kept is not None:
                with torch.no_grad():
                    for k, b in live.items():
                        b.copy_(kept[k])
            if self.work is not self.model:  # fp32 accumulation of the bf16 g_j / M
                for name, p in self.named:
                    g = self.work_named[name].grad
                    self._record(name, g)
                    p.grad = g.float() if p.grad is None else p.grad + g.float()
                    self.work_named[name].grad = None
        grad = {k: p.grad.detach().numpy().copy() for k, p in self.named}
        norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in self.named], cell.clip))
        clipped = {k: p.grad.detach().numpy().copy() for k, p in self.named}
        self.opt.step()
        return PlainStep(
            losses=losses,
            norm=norm,
            grad=grad,
            abs_sum={k: v.numpy() for k, v in self.abs_sum.items()},
            clipped=clipped,
            master={k: p.detach().numpy().copy() for k, p in self.named},
            opt={
                k: {s: self.opt.state[p][s].numpy().copy() for s in STATES} for k, p in self.named
            },
            buffers={k: b.detach().float().numpy().copy() for k, b in self.work.named_buffers()},
            groups=self.groups,
        )


# -- the bounds ---------------------------------------------------------------------------------


def step_bounds(cell, before_master, before_opt, t: int, plain: PlainStep) -> dict:
    """Elementwise bounds on |engine - plain| after one lock-step, from plain-side magnitudes.

    Notation as verify/parity/anchors.py (u = 2^-24, γ_k, A1-A4, ε = 1e-6); g_j is micro-batch j's
    gradient in the compute dtype, the same bits on both sides by A1 (the same parameter bits:
    the engine's working copy and the plain bf16 copy both round the same master), and
    (loss_j / M).backward() gives exactly g_j / M (A2: M a power of two). Neither side
    rounds a g_j differently; they differ in
      1. the sum: the engine's tree (deterministic) or the backend's order (fast) of the M
         terms in fp32, times s(1/M) exactly; plain's sequential fp32 accumulation. Each is within
         γ_{M-1}·Σ|g_j|/M of the exact mean:  e_g0 := 2·γ_{M-1}·Σ_j|g_j / M|  (elementwise).
      2. the norm: the engine's float64 chunk tree of fp32 squares (relative error ≤ ρ64 =
         γ_42(2^-53)), clip_grad_norm_'s float32 norm (≤ ρ, anchors' check 2). With G the
         plain's averaged gradient, ‖G_e - G_p‖ ≤ E := ‖e_g0‖₂, so
             |ν_e - ν_p| ≤ Δν := E + ρ64·(‖G_p‖ + E) + ρ·‖G_p‖.
      3. the coefficient: the engine's s(c / (ν_e + ε)) applied when < 1, plain's
         min(1, fl(c / fl(ν_p + ε))) always applied; with ν_lo = max(ν_p - Δν, 0) + ε,
             Δcoef := c·Δν / ν_lo² + γ_5,
         and 0 where even ν_p + Δν leaves both coefficients exactly 1 (anchors' check 3).
      4. the clipped gradient: e_g := (coef_p + Δcoef)·e_g0 + |G_p|·Δcoef + 2u·|g_p| (one
         rounding of each product, none when neither side clips).
      5. master, exp_avg, exp_avg_sq: verify.checks.bounds.optimizer_step_error("adamw", ...) from
      the
         common state with e_g, charging both implementations' roundings per line (A4): the
         engine's op order (deterministic) or torch's kernels (fast) against torch's
         single-tensor AdamW.
    The loss: both take the float32 losses of the same forwards (A1); the engine's float64
    mean is within loss_bound (verify/checks/harness.py) of the exact mean, plain's fsum mean is
    correctly rounded. Buffers (rank 0's, DDP semantics) are computed by the same forwards:
    bitwise.
    """
    m, c = cell.micro_batches, cell.clip
    e_g0 = {k: 2 * gamma(m - 1, U) * v for k, v in plain.abs_sum.items()}
    big_e = math.sqrt(sum(float((e * e).sum()) for e in e_g0.values()))
    g_norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in plain.grad.values()))
    rho = norm_rel_error([g.size for g in plain.grad.values()])
    rho64 = gamma(REF_NORM_DEPTH + 2, U64)
    d_norm = big_e + rho64 * (g_norm + big_e) + rho * g_norm
    coef = min(1.0, c / (plain.norm + 1e-6))
    if c / (plain.norm + d_norm + 1e-6) * (1 - gamma(4, U)) >= 1:
        d_coef, rounding = 0.0, 0.0  # both coefficients are exactly 1
    else:
        low = max(plain.norm - d_norm, 0.0) + 1e-6
        d_coef, rounding = c * d_norm / (low * low) + gamma(5, U), 2 * U
    out = {}
    for k in plain.grad:
        hp = GROUPS["adamw"][plain.groups[k]]
        g = plain.clipped[k]
        e_g = (coef + d_coef) * e_g0[k] + np.abs(plain.grad[k].astype(np.float64)) * d_coef
        e_g = e_g + rounding * np.abs(g.astype(np.float64))
        state = {s: before_opt[k][s].numpy() for s in STATES}
        p0 = before_master[k].numpy()
        err, _, _ = optimizer_step_error("adamw", hp, t + 1, p0, g, state, {"g": e_g})
        out[k] = {"master": err["p"], **{s: err[s] for s in STATES}}
    return {"state": out, "norm": d_norm, "loss": loss_bound(plain.losses)}


def check_step(bounds, plain: PlainStep, res, master, opt, buffers, perturb=0.0) -> dict:
    """Worst diff/bound of every check of one lock-step (buffers: 0 equal, inf not). perturb:
    ParityCell.perturb, applied to the engine's values here."""
    f = np.float64
    out = dict.fromkeys(CHECKS, 0.0)
    loss, norm = res.loss + perturb * bounds["loss"], res.norm + perturb * bounds["norm"]
    out["loss"] = ratio(abs(loss - math.fsum(plain.losses) / len(plain.losses)), bounds["loss"])
    out["norm"] = ratio(abs(norm - plain.norm), bounds["norm"])
    for k, b in bounds["state"].items():
        got = {"master": master[k], **opt[k]}
        want = {"master": plain.master[k], **plain.opt[k]}
        for s in ("master", *STATES):
            ours = got[s].numpy().astype(f).ravel()
            if perturb:
                i = int(np.argmax(b[s]))
                ours[i] += perturb * b[s].ravel()[i]
            diff = np.abs(ours - want[s].astype(f).ravel())
            out[s] = max(out[s], ratio(diff, b[s].ravel()))
    if perturb and buffers:  # one ulp in the first element of the first buffer
        k = next(iter(buffers))
        buffers = {**buffers, k: buffers[k].copy()}
        flat = buffers[k].reshape(-1)
        flat[0] = np.nextafter(flat[0], np.float32(np.inf))
    same = all(np.array_equal(buffers[k], v, equal_nan=True) for k, v in plain.buffers.items())
    out["buffers"] = 0.0 if same else math.inf
    return out
