"""External anchors: the reference against training code that nobody here wrote (docs/design.md §2).

The reference and the engine agree bit for bit, so a semantics mistake they share (loss averaging
over micro-batches, where clipping happens, how weight decay couples, Adam's bias corrections)
would never show between them. So the *reference* is compared, in lock-step on the same GPT and
data, with textbook recipes: `plain` (one process, accumulate (loss_j / M).backward(),
clip_grad_norm_, torch.optim.AdamW), `ddp` (DistributedDataParallel on N gloo ranks) and, where
installed, DeepSpeed ZeRO-1/2 (`deepspeed_run`, first step only, one parameter group).

Five checks per step (grad, norm, clip coefficient, clipped gradient, optimizer step), each
within a bound derived from torch's documented arithmetic (assumptions A1-A4). The derivation,
and why DeepSpeed is anchored for one step only, are in docs/verification.md, section "Bounds".
Each check reports its worst ratio diff/bound; the anchor holds when every ratio is <= 1.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from reference import ModelSpec, StepConfig, init_state, train_step, working_copy
from reference.precision import UNIT_ROUNDOFF
from reference.step import CLIP_EPS, StepInfo, TrainState

from ..cells.cell import GROUPS, MODELS
from ..checks.bounds import gamma, optimizer_step_error
from ..checks.expect import decay_groups
from ..checks.harness import microbatch_grads

U = UNIT_ROUNDOFF["fp32"]
U64 = 2.0**-53
REF_NORM_DEPTH = 40  # pairwise depth of the reference norm's tree for < 2^40 elements
STATES = ("exp_avg", "exp_avg_sq")
CHECKS = ("grad", "norm", "master", *STATES)


@dataclass(frozen=True, kw_only=True)
class Anchor:
    """One lock-step anchor run: the model, the data and the step, as the reference sees them."""

    model: str = "gpt"
    """A key of verify.cells.cell.MODELS."""
    micro_batches: int = 8
    """M, a power of two (A2): the peers scale by 1/M and 1/N exactly only then."""
    steps: int = 4
    """Lock-steps to run."""
    clip_norm: float | None = 0.5
    """Clip the global norm to this (None: no clipping). The default clips some GPT steps."""
    batch_size: int = 4
    """Sequences per micro-batch."""
    seed: int = 0
    """Data seed (the model's initial values have their own, fixed seed)."""

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: allowed are {sorted(MODELS)}")
        m = self.micro_batches
        if m < 1 or m & (m - 1):
            raise ValueError(f"micro_batches={m}: must be a power of two (exact 1/M scaling)")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm={self.clip_norm}: must be > 0 or None")

    one_group: bool = False
    """Weight decay on every parameter, one group (the DeepSpeed anchor: module docstring);
    otherwise the reference's two groups, decay on matrices and none on biases and norms."""

    def groups(self):
        return GROUPS["adamw"][:1] if self.one_group else GROUPS["adamw"]

    def group_of(self, model) -> dict[str, int]:
        """Parameter name -> group, stated by verify/checks/expect.py's GROUPINGS (never the
        library's
        predicate: the reference and the peers take it alike, so it must be right on its own)."""
        groups = decay_groups(model)
        return dict.fromkeys(groups, 0) if self.one_group else groups


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How the peer trains. The defaults are the correct textbook recipe; the other values
    exist to plant semantics bugs that the anchors must catch."""

    divide_loss: bool = True
    """Divide each micro-batch's loss by the micro-batches per process (False: a missing 1/M)."""
    torch_optimizer: str = "AdamW"
    """The torch.optim class ("Adam": L2 weight decay coupled into the gradient)."""


@dataclass(frozen=True)
class RefStep:
    """One reference step and everything a peer needs to repeat it."""

    before: TrainState
    after: TrainState
    info: StepInfo
    grads: list[dict[str, np.ndarray]]  # g_j, fp32, by parameter name
    batches: list  # the M micro-batches (idx, targets)


@dataclass(frozen=True)
class PeerStep:
    """What a peer holds after one step from the reference's state."""

    grad: dict[str, np.ndarray]  # the averaged gradient before clipping, fp32
    norm: float  # clip_grad_norm_'s total norm (before clipping)
    master: dict[str, np.ndarray]  # new parameters, fp32
    opt: dict[str, dict[str, np.ndarray]]  # new exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Bounds:
    """Elementwise (by parameter name) and scalar bounds of one lock-step; module docstring."""

    grad: dict[str, np.ndarray]
    norm: float
    state: dict[str, dict[str, np.ndarray]]  # name -> {"p", "exp_avg", "exp_avg_sq"}
    terms: dict[str, float] = field(default_factory=dict)  # ρ, Δν, Δcoef, for reports


@contextlib.contextmanager
def one_thread():
    """A1 needs the same kernels everywhere: forked ranks run one thread, so the reference's
    g_j are computed with one thread too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def model_spec(model, chunk: int = 128, groups: dict[str, int] | None = None) -> ModelSpec:
    """The reference's view of the model: the root unit first (everything outside the model's
    units, the tied head included), then one unit each, as zero.engine arranges them; groups
    by name (None: verify.checks.expect.decay_groups)."""
    units = model.unit_names()
    named = list(model.named_parameters())  # a tied parameter appears once
    owner = {n: next((u for u in units if n.startswith(u + ".")), "") for n, _ in named}
    layout = [[(n, tuple(p.shape)) for n, p in named if owner[n] == u] for u in ("", *units)]
    groups = decay_groups(model) if groups is None else groups
    return ModelSpec.build([u for u in layout if u], groups, chunk=chunk)


def reference_run(a: Anchor) -> tuple[ModelSpec, StepConfig, list[RefStep]]:
    """The reference's trajectory over a.steps steps (its own, never the peer's)."""
    build, data = MODELS[a.model]
    model = build()
    spec = model_spec(model, groups=a.group_of(model))
    rcfg = StepConfig(
        optimizer="adamw",
        groups=a.groups(),
        micro_batches=a.micro_batches,
        clip_norm=a.clip_norm,
    )
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    state, out = init_state(init, spec, rcfg), []
    with one_thread():
        for step in range(a.steps):
            batches = data(
                model.cfg,
                seed=a.seed,
                data_step=step,
                count=a.micro_batches,
                batch_size=a.batch_size,
            )
            work = working_copy(state, rcfg)
            grads = [microbatch_grads(model, work, b, torch.float32, None) for b in batches]
            after, info = train_step(state, grads, spec, rcfg)
            out.append(RefStep(state, after, info, grads, batches))
            state = after
    return spec, rcfg, out


# -- the peers ----------------------------------------------------------------------------------


def torch_optimizer(model, a: Anchor, recipe: Recipe) -> torch.optim.Optimizer:
    """torch.optim with the reference's groups, every hyper-parameter spelled out (torch's AdamW
    defaults to weight_decay=0.01, which group 1 must not get)."""
    hps, group = a.groups(), a.group_of(model)
    members = [[] for _ in hps]
    for name, p in model.named_parameters():
        members[group[name]].append(p)
    kind = recipe.torch_optimizer.lower()
    return peer_optimizer(kind, [(ps, hp) for ps, hp in zip(members, hps) if ps])


def peer_optimizer(kind: str, groups) -> torch.optim.Optimizer:
    """torch.optim.Adam or AdamW over (parameters, Hyper) groups, foreach=False (A4: the
    single-tensor kernel). Every argument is spelled out here rather than taken from the
    library's own translation (zero.optim.update.torch_kwargs, which the engine's fast SGD and
    the consolidation use): a peer built by the code under test would share its mistakes."""
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    args = [
        {"params": ps, "lr": hp.lr, "betas": tuple(hp.betas), "eps": hp.eps,
         "weight_decay": hp.weight_decay}
        for ps, hp in groups
    ]  # fmt: skip
    return cls(args, foreach=False)


def load_state(model, opt, master, opt_state, t: int) -> None:
    """Lock-step: the reference's parameters and AdamW state, t steps taken so far."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(master[name]))
            p.grad = None
            opt.state[p] = {
                "step": torch.tensor(float(t)),
                **{k: torch.from_numpy(opt_state[name][k].copy()) for k in STATES},
            }


def clip_and_step(model, opt, a: Anchor) -> PeerStep:
    """clip_grad_norm_ then opt.step(), recording the gradient before clipping."""
    named = list(model.named_parameters())
    grad = {n: p.grad.detach().numpy().copy() for n, p in named}
    # Without clipping, max_norm = inf makes the coefficient min(1, inf) = 1: the same call
    # still reports the norm.
    max_norm = math.inf if a.clip_norm is None else a.clip_norm
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    opt.step()
    master = {n: p.detach().numpy().copy() for n, p in named}
    state = {n: {k: opt.state[p][k].numpy().copy() for k in STATES} for n, p in named}
    return PeerStep(grad, norm, master, state)


def plain_run(a: Anchor, steps: list[RefStep], recipe: Recipe = Recipe()) -> list[PeerStep]:
    """The single-process peer, one lock-step per reference step."""
    build, _ = MODELS[a.model]
    model = build()
    opt = torch_optimizer(model, a, recipe)
    out = []
    with one_thread():
        for s in steps:
            load_state(model, opt, s.before.master, s.before.opt, s.before.t)
            for x, y in s.batches:
                _, loss = model(x, y)
                (loss / len(s.batches) if recipe.divide_loss else loss).backward()
            out.append(clip_and_step(model, opt, a))
    return out


def ddp_payload(steps: list[RefStep]) -> list[tuple]:
    """What the DDP ranks need of each reference step (pickled to the workers)."""
    return [(s.before.master, s.before.opt, s.before.t, s.batches) for s in steps]


def ddp_run(rank: int, n: int, a: Anchor, payload: list[tuple], recipe: Recipe) -> list[PeerStep]:
    """The DDP peer on one rank (run it with zero.ranks.local.get_pool(n).run)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = a.micro_batches
    if n & (n - 1) or m % n:
        raise ValueError(f"world size {n}: must be a power of two dividing M={m} (A2)")
    torch.set_num_threads(1)
    build, _ = MODELS[a.model]
    model = build()
    ddp = DDP(model)
    opt = torch_optimizer(model, a, recipe)
    out = []
    for master, opt_state, t, batches in payload:
        load_state(model, opt, master, opt_state, t)
        mine = batches[rank::n]  # micro-batch j runs on rank j mod N
        for i, (x, y) in enumerate(mine):
            last = i == len(mine) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                _, loss = ddp(x, y)
                (loss / len(mine) if recipe.divide_loss else loss).backward()
        out.append(clip_and_step(model, opt, a))
    return out


# -- the bounds and the check -------------------------------------------------------------------


def norm_rel_error(sizes: list[int]) -> float:
    """ρ of the module docstring (check 2): clip_grad_norm_'s relative error in float32."""
    rho_i = max((1 + gamma(n, U)) * (1 + 2 * U) - 1 for n in sizes)
    return (1 + rho_i) * (1 + gamma(len(sizes), U)) * (1 + 2 * U) - 1


def step_bounds(spec: ModelSpec, rcfg: StepConfig, step: RefStep) -> Bounds:
    """The bounds of checks 1-5 of the module docstring for one lock-step."""
    m, before, info = rcfg.micro_batches, step.before, step.info
    c = 1.0 / m  # s(1/M) is exact: M is a power of two
    g0, e_g0 = {}, {}
    for name in spec.names:
        abs_sum = sum(np.abs(g[name].astype(np.float64)) for g in step.grads)
        e_g0[name] = 2 * gamma(m - 1, U) * abs_sum * c
        g0[name] = np.abs(info.reduced[name].astype(np.float64)) * c
    e_norm = math.sqrt(sum(float((e * e).sum()) for e in e_g0.values()))
    rho = norm_rel_error([step.grads[0][n].size for n in spec.names])
    rho64 = gamma(REF_NORM_DEPTH + 2, U64)
    nu = float(info.norm)
    d_norm = e_norm + rho * (nu * (1 + rho64) + e_norm) + rho64 * nu
    coef = 1.0 if info.clip_coef is None else float(info.clip_coef)
    never_clips = rcfg.clip_norm is None or (
        rcfg.clip_norm / (nu + d_norm + CLIP_EPS) * (1 - gamma(4, U)) >= 1
    )
    if never_clips:  # both coefficients are exactly 1 (check 3): nothing to charge
        d_coef, rounding = 0.0, 0.0
    else:
        low = max(nu - d_norm, 0.0) + CLIP_EPS
        d_coef = rcfg.clip_norm * d_norm / (low * (nu + CLIP_EPS)) + gamma(5, U)
        rounding = 2 * U
    state = {}
    for name in spec.names:
        hp = rcfg.groups[spec.group_of[name]]
        g_ref = info.reduced[name].astype(np.float32) * np.float32(c)
        if info.clip_coef is not None:
            g_ref = g_ref * info.clip_coef
        e_g = (coef + d_coef) * e_g0[name] + g0[name] * d_coef + rounding * np.abs(g_ref)
        args = (before.t + 1, before.master[name], g_ref, before.opt[name], {"g": e_g})
        err, _, _ = optimizer_step_error(rcfg.optimizer, hp, *args)
        state[name] = {k: err[k] for k in ("p", *STATES)}
    terms = {"rho": rho, "d_norm": d_norm, "d_coef": d_coef, "norm": nu, "coef": coef}
    return Bounds(grad=e_g0, norm=d_norm, state=state, terms=terms)


def ratio(diff: np.ndarray, bound: np.ndarray) -> float:
    """Worst diff/bound; a zero bound admits only a zero difference."""
    diff, bound = np.broadcast_arrays(np.asarray(diff, np.float64), np.asarray(bound, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(bound > 0, diff / bound, np.where(diff > 0, np.inf, 0.0))
    return float(r.max()) if r.size else 0.0


def check_step(step: RefStep, peer: PeerStep, b: Bounds) -> dict[str, float]:
    """Worst diff/bound of each check (module docstring) for one lock-step."""
    f = np.float64
    ref_g0 = {n: r.astype(f) / len(step.grads) for n, r in step.info.reduced.items()}
    out = dict.fromkeys(CHECKS, 0.0)
    for name, want in ref_g0.items():
        out["grad"] = max(out["grad"], ratio(np.abs(peer.grad[name] - want), b.grad[name]))
        diff = np.abs(peer.master[name].astype(f) - step.after.master[name])
        out["master"] = max(out["master"], ratio(diff, b.state[name]["p"]))
        for k in STATES:
            diff = np.abs(peer.opt[name][k].astype(f) - step.after.opt[name][k])
            out[k] = max(out[k], ratio(diff, b.state[name][k]))
    out["norm"] = ratio(abs(peer.norm - float(step.info.norm)), b.norm)
    return out


def check_run(spec, rcfg, steps: list[RefStep], peers: list[PeerStep]) -> list[dict[str, float]]:
    """check_step for every lock-step of a run."""
    return [check_step(s, p, step_bounds(spec, rcfg, s)) for s, p in zip(steps, peers)]


def worst(ratios: list[dict[str, float]]) -> dict[str, float]:
    """The worst ratio of each check over the steps of a run."""
    return {k: max(r[k] for r in ratios) for k in CHECKS}


def deepspeed_run(
    rank: int, n: int, a: Anchor, payload: list[tuple], stage: int, recipe: Recipe = Recipe()
) -> list[PeerStep]:
    """DeepSpeed ZeRO-1/2 on one rank: one lock-step, the first, from the initial state.

    The first step starts from zero moments and t = 0, exactly where DeepSpeed starts, so it
    needs no optimizer-state setter (DeepSpeed 0.19.8's fails beyond the first parameter group:
    module docstring). The recipe is DeepSpeed's own: engine.backward scales each micro-batch's
    loss by 1/(M/N) (gradient_accumulation_steps), its ZeRO reduction averages over the N
    ranks, its gradient_clipping is our clip_norm, and the client optimizer is torch's AdamW
    with the reference's groups. The gradient before clipping and the new state are read
    through DeepSpeed's public getters (deepspeed.utils.safe_get_full_*)."""
    from measure.bench import prepare_deepspeed

    why = prepare_deepspeed(rank, n)
    if why is not None:
        raise RuntimeError(f"DeepSpeed {why}")
    import deepspeed
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
    )

    m = a.micro_batches
    if n & (n - 1) or m % n:
        raise ValueError(f"world size {n}: must be a power of two dividing M={m} (A2)")
    torch.set_num_threads(1)
    master, _, t, batches = payload[0]
    if t != 0:
        raise ValueError(f"payload[0] is at t={t}: DeepSpeed's lock-step starts from t = 0")
    build, _ = MODELS[a.model]
    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(master[name]))
    config = {
        "train_micro_batch_size_per_gpu": a.batch_size,
        "gradient_accumulation_steps": m // n,
        "train_batch_size": a.batch_size * m,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0 if a.clip_norm is None else a.clip_norm,
        "steps_per_print": 1 << 30,
    }
    opt = torch_optimizer(model, a, recipe)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    named = list(model.named_parameters())
    mine = batches[rank::n]
    grad = {}
    for i, (x, y) in enumerate(mine):
        _, loss = eng(x, y)
        eng.backward(loss, scale_wrt_gas=recipe.divide_loss)
        if i == len(mine) - 1:  # the accumulation boundary: the reduced, averaged gradient
            grad = {nm: safe_get_full_grad(p).detach().numpy().copy() for nm, p in named}
        eng.step()
    norm = eng.get_global_grad_norm()
    new = {nm: safe_get_full_fp32_param(p).detach().numpy().copy() for nm, p in named}
    state = {
        nm: {k: safe_get_full_optimizer_state(p, k).detach().numpy().copy() for k in STATES}
        for nm, p in named
    }
    return [PeerStep(grad, float(norm), new, state)]
