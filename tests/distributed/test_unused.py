"""Parameters without a gradient in a step ([Note: unused parameters], reference/step.py):
skipped by the optimizer exactly as torch.optim skips `grad is None`, at every stage.

The model is verify/cells/branch.py's BranchMLP: a side branch (its own unit) that odd data steps
skip,
and that on even steps some ranks use and others do not ("mlp-branch"; at stage 3 the ranks agree:
"mlp-skip", docs/models.md)."""

import json
import math

import numpy as np
import pytest
import torch

from reference.optim import Hyper
from verify.cells.branch import BranchMLP, branch_microbatches, skip_microbatches
from verify.cells.cell import Cell
from verify.checks.bounds import gamma, optimizer_step_error
from verify.checks.harness import reference_trajectory, run_cells
from zero import checkpoint
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.loop import train_steps
from zero.ranks.local import get_pool
from zero.workloads.models import MLPConfig

pytestmark = pytest.mark.timeout(600)

SIDE = ("side.weight", "side.bias")
U = 2.0**-24


def model_for(stage: int) -> str:
    return "mlp-skip" if stage == 3 else "mlp-branch"


def branch_cells(n: int, **kw) -> list[Cell]:
    return [
        Cell(stage=s, world_size=n, precision="fp32", optimizer="adamw",
             mode="deterministic", model=model_for(s), steps=4, **kw)
        for s in range(4)
    ]  # fmt: skip


def test_the_branch_is_unused_on_odd_steps_in_the_reference():
    """Not vacuous: the reference's own step counts of the side branch fall behind t."""
    cell = branch_cells(2)[0]
    infos = reference_trajectory(cell)
    assert len(infos) == 4 and not any(i.skipped for i in infos)
    assert all(i.reduced["side.weight"].any() == (s % 2 == 0) for s, i in enumerate(infos))


@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_stage_equals_the_reference_bitwise(n):
    """Stages 0-3 at N: masters, states, working copies, norms and every parameter's own step
    count are the reference's bits, step by step (verify/checks/harness.py). At stage 3 the side
    unit
    runs on no rank in odd steps: its zeros are built from metadata, where FlatUnit.grads()
    used to read the sharded parameters and raise an error about a read nobody made."""
    per_rank = get_pool(n).run(run_cells, branch_cells(n), timeout_s=600)
    for verdicts in per_rank:
        for v in verdicts:
            assert v["passed"], v["first"]


def planted_zero_update(rank, n, cells):
    """The old rule planted: every parameter updated, used or not (zero gradients)."""
    from zero import engine as engine_module

    original = engine_module.live_runs

    def every_run(runs, slots, lo, used, steps):
        return original(runs, slots, lo, [True] * len(used), steps)

    engine_module.live_runs = every_run
    try:
        return run_cells(rank, n, cells)
    finally:
        engine_module.live_runs = original


@pytest.mark.dist
def test_the_old_zero_gradient_update_fails_verification():
    per_rank = get_pool(2).run(planted_zero_update, branch_cells(2), timeout_s=600)
    for verdicts in per_rank:
        for v in verdicts:
            assert not v["passed"] and v["first"].startswith("step 1: unit 3 (side)"), v["first"]


# -- against plain PyTorch: torch.optim.AdamW(foreach=False) + clip_grad_norm_ ------------------


def torch_count(opt, p) -> int:
    """torch.optim's own step count of p (0 before its first step; no state is created)."""
    return int(opt.state.get(p, {}).get("step", 0))


LR, WD, CLIP = 1e-2, 0.1, 0.5
HP = Hyper(lr=LR, weight_decay=WD)


def torch_step(model, opt, batches):
    """Plain PyTorch, one process: each micro-batch's gradient, their mean where some
    micro-batch has one (None where none has: zero_grad(set_to_none=True)), clipping, AdamW."""
    named = dict(model.named_parameters())
    per = []
    for b in batches:
        model.zero_grad(set_to_none=True)
        model(*b)[1].backward()
        per.append({k: p.grad.clone() for k, p in named.items() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    for k, p in named.items():
        have = [g[k] for g in per if k in g]
        if have:  # zeros where a micro-batch had none, as DDP reduces them
            acc = per[0].get(k, torch.zeros_like(p))
            for g in per[1:]:
                acc = acc + g.get(k, torch.zeros_like(p))
            p.grad = acc * (1.0 / len(per))
    torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP, foreach=False)
    grads = {k: p.grad.clone() for k, p in named.items() if p.grad is not None}
    opt.step()
    return grads


def step_bound(g, p, state, t_p, numel_max, count):
    """|engine p1 - torch p1| elementwise after one AdamW step from the same state (lock-step).
    The mean gradient has the same bits on both sides (M = 2: one addition, times 1/2). The
    clip coefficient differs: torch's float32 norm (squares and sums of at most numel_max
    elements per tensor, then of `count` tensor norms, two square roots) is within
    ρ = γ_{numel_max + count + 4} of the exact norm relatively, the engine's float64 norm within
    1e-12; each side divides and rounds (2u), so |Δcoef| <= coef·(ρ + 4u), and each side rounds
    g·coef (u each): e_g = |g|·(ρ + 6u). verify/checks/bounds.optimizer_step_error carries e_g
    through
    AdamW's lines, charging both implementations' roundings per line."""
    rho = gamma(numel_max + count + 4, U) + 1e-12
    e_g = np.abs(g.astype(np.float64)) * (rho + 6 * U)
    err, _, _ = optimizer_step_error("adamw", HP, t_p, p, g, state, {"g": e_g})
    return err["p"]


def lockstep_vs_torch(rank, n, stage, planted):
    from zero import engine as engine_module

    data = skip_microbatches if stage == 3 else branch_microbatches
    cfg = MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)
    model, plain = BranchMLP(cfg), BranchMLP(cfg)
    zcfg = ZeroConfig(
        stage=stage, optimizer="adamw", groups=(HP,), micro_batches=2, clip_norm=CLIP,
        units=tuple(model.unit_names()),
    )  # fmt: skip
    eng = ZeroEngine(model, zcfg)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD, foreach=False)
    named = dict(plain.named_parameters())
    numel_max, count = max(p.numel() for p in named.values()), len(named)
    original = engine_module.live_runs
    if planted:
        engine_module.live_runs = lambda r, s, lo, used, st: original(
            r, s, lo, [True] * len(used), st
        )
    rows = []
    try:
        for step in range(4):
            batches = data(cfg, seed=0, data_step=step, count=2, batch_size=4)
            before = {k: p.detach().clone().numpy() for k, p in named.items()}
            state = {
                k: {x: v.clone().numpy() for x, v in opt.state.get(p, {}).items() if x != "step"}
                for k, p in named.items()
            }
            steps = {k: torch_count(opt, p) for k, p in named.items()}
            zeros = {k: np.zeros_like(v) for k, v in before.items()}
            eng.load_full_state(
                before,
                {k: state[k] or {"exp_avg": zeros[k], "exp_avg_sq": zeros[k]} for k in named},
                t=step, data_step=step, steps=steps,
            )  # fmt: skip
            grads = torch_step(plain, opt, batches)
            train_steps(eng, lambda s, j, b=batches: b[j], 1, start_step=step)
            master, _ = eng.gather_state()
            after_steps = eng.param_steps()
            for k, p in named.items():
                got = master[k].numpy().astype(np.float64)
                want = p.detach().numpy().astype(np.float64)
                if k in grads:
                    g = grads[k].numpy()
                    st = state[k] or {"exp_avg": zeros[k], "exp_avg_sq": zeros[k]}
                    bound = step_bound(g, before[k], st, steps[k] + 1, numel_max, count)
                else:  # torch.optim skipped it: so must the engine, bit for bit
                    bound = np.zeros_like(want)
                ok = bool(np.all(np.abs(got - want) <= bound))
                moved = np.abs(want - before[k].astype(np.float64))
                tight = k not in grads or float(np.mean(moved > 100 * bound)) > 0.9
                rows.append(
                    (step, k, k in grads, ok and tight, after_steps[k], torch_count(opt, p))
                )
    finally:
        engine_module.live_runs = original
    return rows


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lockstep_with_torch_adamw_and_clip_grad_norm(stage):
    """Four steps, each from torch's state: used parameters within the derived bound of
    torch.optim.AdamW(foreach=False) after clip_grad_norm_; the side branch, which torch skips
    on odd steps (grad None), unchanged bit for bit; every parameter's own step count equal to
    torch's state["step"]. Not vacuous: over 90% of each used tensor moved by more than 100x
    its bound."""
    per_rank = get_pool(2).run(lockstep_vs_torch, stage, False, timeout_s=600)
    for rows in per_rank:
        assert all(ok for *_, ok, _, _ in rows), [r for r in rows if not r[3]]
        assert all(ours == theirs for *_, ours, theirs in rows), rows
        skipped = {(s, k) for s, k, used, *_ in rows if not used}
        assert skipped == {(s, k) for s in (1, 3) for k in SIDE}  # not vacuous


@pytest.mark.dist
def test_the_old_zero_gradient_update_is_outside_the_bound_of_torch():
    """The old rule (a zero-gradient update: decay and moments move the side branch on the
    steps torch skips) fails the same comparison, so the test above can fail."""
    (rows, *_) = get_pool(2).run(lockstep_vs_torch, 0, True, timeout_s=600)
    bad = {(s, k) for s, k, used, ok, *_ in rows if not ok}
    assert bad and all(k in SIDE and s % 2 == 1 for s, k in bad), bad


# -- checkpoints: per-parameter step counts ---------------------------------------------------


def save_then_resume(rank, n, stage, directory, phase):
    """phase 'save': data steps 0-1 at (n, stage), saved; 'load': load, then data step 2;
    'straight': data steps 0-2 without a checkpoint. Returns the counts and the masters' bits."""
    cfg = MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)
    model = BranchMLP(cfg, seed=1 if phase == "load" else 0)  # load must overwrite
    zcfg = ZeroConfig(stage=stage, optimizer="adamw", groups=(HP,), micro_batches=2,
                      units=tuple(model.unit_names()))  # fmt: skip
    eng = ZeroEngine(model, zcfg)

    def batch(s, j):  # ranks disagree on even steps: fine at N = 1, and at stages 0-2
        return branch_microbatches(cfg, seed=0, data_step=s, count=2, batch_size=4)[j]

    if phase == "load":
        eng.load(directory)
        loaded = eng.param_steps()
        train_steps(eng, batch, 1, start_step=2)
    else:
        train_steps(eng, batch, 2 if phase == "save" else 3)
        loaded = None
        if phase == "save":
            eng.save(directory)
    master, _ = eng.gather_state()
    bits = {k: v.numpy().view(np.uint32).tobytes() for k, v in master.items()}
    return loaded, eng.param_steps(), bits


@pytest.mark.dist
def test_step_counts_are_saved_resharded_and_consolidated(tmp_path):
    """Saved at N = 2, stage 1 with the side branch one step behind (t = 2, t_p = 1); loaded at
    N = 1, stage 3, one more step: the uninterrupted run's bits (a count restored as t would
    change Adam's bias correction). Consolidation gives each parameter its own state["step"]."""
    root = tmp_path / "ck"
    (_, saved, _), *_ = get_pool(2).run(save_then_resume, 1, str(root), "save")
    assert saved["side.weight"] == 1 and saved["mlp.layers.0.weight"] == 2
    (loaded, _, resumed), *_ = get_pool(1).run(save_then_resume, 3, str(root), "load")
    (_, _, straight), *_ = get_pool(1).run(save_then_resume, 0, str(root), "straight")
    assert loaded == saved
    assert resumed == straight
    out = checkpoint.consolidate(root)
    names = [k for group in out["param_names"] for k in group]
    for i, k in enumerate(names):
        assert float(out["optimizer"]["state"][i]["step"]) == saved[k], k
    # an old (version 1) manifest has no counts: every parameter at t
    step_dir = checkpoint.resolve(root)
    m = json.loads((step_dir / "manifest.json").read_text())
    for p in m["params"]:
        del p["step"]
    m["format_version"] = 1
    body = {k: v for k, v in m.items() if k != "checksum"}
    import hashlib

    from zero.checkpoint.format import _canonical

    m["checksum"] = hashlib.sha256(_canonical(body)).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(m))
    old = checkpoint.consolidate(root)
    assert {float(s["step"]) for s in old["optimizer"]["state"].values()} == {2.0}
    (loaded_old, _, _), *_ = get_pool(1).run(save_then_resume, 0, str(root), "load")
    assert set(loaded_old.values()) == {2}


def never_stepped(rank, n, directory):
    cfg = MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3)
    model = BranchMLP(cfg)
    zcfg = ZeroConfig(stage=2, optimizer="adamw", groups=(HP,), micro_batches=2,
                      units=tuple(model.unit_names()))  # fmt: skip
    eng = ZeroEngine(model, zcfg)
    batches = branch_microbatches(cfg, seed=0, data_step=1, count=2, batch_size=4)  # odd: unused
    train_steps(eng, lambda s, j: batches[j], 1, start_step=1)
    eng.save(directory)
    return eng.param_steps()


@pytest.mark.dist
def test_a_parameter_never_stepped_has_no_optimizer_state(tmp_path):
    """As in torch.optim: only parameters that had a gradient get state (and a 'step')."""
    counts, *_ = get_pool(2).run(never_stepped, str(tmp_path / "ck"))
    assert {k for k, v in counts.items() if v == 0} == set(SIDE)
    out = checkpoint.consolidate(tmp_path / "ck")
    names = [k for group in out["param_names"] for k in group]
    without = {names[i] for i in range(len(names)) if i not in out["optimizer"]["state"]}
    assert without == set(SIDE)
    # and torch.optim takes the state dict as it is
    model = BranchMLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    opt.load_state_dict(out["optimizer"])
    assert math.isclose(opt.param_groups[0]["lr"], LR)
