"""Tensor parallelism (zero/mp) on gloo ranks against the N_m = 1 GPT (docs/design.md §6).

Lock-step over operators, for the reason docs/design.md §6 gives (a difference of one rounding
changes every later rounding, so whole models have no derivable bound): the N_m = 1 model runs
forward and backward once, keeping each split operator's real input and real output gradient;
each MP rank runs its slice of that operator on the same input and gradient. Outputs and input
gradients must lie within verify/mp_bounds.py's derived bound, weight gradients must be the
exact slices (bitwise), and a planted error (a missing sum, a sum scaled by 1/N_m) must fail.

Legend: N = N_m, b·s tokens of width h, L blocks, V vocabulary.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zero.launch import get_pool
from zero.mp import split_rule

pytestmark = pytest.mark.timeout(600)

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH = 2


def _setup(deterministic, plant=None):
    import zero.mp.collectives as mpc
    from zero.collectives import CommCounter
    from zero.models import GPT, GPTConfig, gpt_microbatches
    from zero.mp import Mesh, MPContext

    groups = Mesh(dp=1, mp=torch.distributed.get_world_size()).groups()
    real = mpc.__dict__.setdefault("_real_reduce_sum", mpc.reduce_sum)
    if plant == "no_sum":  # the g / f collective left out: each rank keeps its partial
        mpc.reduce_sum = lambda x, *, ctx, phase: x.clone()
    elif plant == "mean":  # a sum scaled by 1/N_m
        mpc.reduce_sum = lambda x, *, ctx, phase: real(x, ctx=ctx, phase=phase) / ctx.size
    else:
        mpc.reduce_sum = real
    cfg = GPTConfig(**CFG)
    full = GPT(cfg, seed=3)
    mp = MPContext.of(groups.mp_group, counter=CommCounter(), deterministic=deterministic)
    batches = gpt_microbatches(cfg, seed=0, data_step=0, count=2, batch_size=BATCH)
    return cfg, full, mp, batches


def _capture(full, idx, tgt):
    """Each split operator's input, output and output gradient in the N_m = 1 model, by the
    name of its weight ("transformer.h.0.attn.c_attn.weight", ..., "transformer.wte.weight")."""
    rec = {}

    def keep(name):
        def hook(_mod, args, out):  # returns None: a forward hook's value would replace out
            rec[name] = dict(x=args[0].detach().clone(), y=out.detach().clone())
            out.register_hook(lambda g: rec[name].__setitem__("gout", g.detach().clone()))

        return hook

    mods = {f"{k}.weight": mod for k, mod in full.named_modules() if isinstance(mod, nn.Linear)}
    mods = {k: mod for k, mod in mods.items() if split_rule(k) is not None}
    mods["transformer.wte.weight"] = full.transformer.wte
    hooks = [mod.register_forward_hook(keep(name)) for name, mod in mods.items()]
    full(idx, tgt)[1].backward()
    for h in hooks:
        h.remove()
    return rec, mods


def _cut_last(t, rule, mp):
    """Rank m's part of a tensor's last dimension under a weight's split rule."""
    if rule == "qkv":
        return torch.cat([c.chunk(mp.size, -1)[mp.rank] for c in t.chunk(3, -1)], -1)
    return t.chunk(mp.size, -1)[mp.rank]


def _worst(out, key, diff, bound):
    from verify.mp_bounds import ratio

    out[key] = max(out.get(key, 0.0), ratio(diff, bound))


def _linear(name, mod, cap, cfg, mp, out):
    """One split linear in lock-step: forward, input gradient, weight and bias gradients."""
    from verify.mp_bounds import any_order_bound, as_bits, split_dot_bound
    from zero.mp import layers, split_state

    n, rule, x, gy = mp.size, split_rule(name), cap["x"], cap["gout"]
    w, b = mod.weight.detach(), None if mod.bias is None else mod.bias.detach()
    cut = split_state(
        {name: w} | ({} if b is None else {name[:-6] + "bias": b}), cfg, m=mp.rank, n=n
    )
    wm, bm = cut[name], cut.get(name[:-6] + "bias")
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    b1 = None if b is None else b.clone().requires_grad_()
    F.linear(x1, w1, b1).backward(gy)
    wt = wm.clone().requires_grad_()
    bt = None if bm is None else bm.clone().requires_grad_()
    tokens = x.reshape(-1, x.shape[-1]).shape[0]
    if rule == "cols":  # row-parallel: input features split, one g sum, bias added once
        xt = x.chunk(n, -1)[mp.rank].clone().requires_grad_()
        yt = layers.row_linear(xt, wt, bt, mp)
        yt.backward(gy)
        _worst(out, "row_fwd", yt - cap["y"], split_dot_bound(x, w, n=n, bias=b))
        _worst(out, "row_dx", xt.grad - x1.grad.chunk(n, -1)[mp.rank], any_order_bound(gy, wm.T))
        gy_m, x_m = gy, xt.detach()
    else:  # column-parallel: output features split, f's sum in backward
        xt = x.clone().requires_grad_()
        yt = layers.column_linear(xt, wt, bt, mp)
        gy_m = _cut_last(gy, rule, mp).contiguous()
        yt.backward(gy_m)
        y_m = _cut_last(cap["y"], rule, mp)
        _worst(out, "col_fwd", yt - y_m, any_order_bound(x, wm, bias=bm))
        _worst(out, "col_dx", xt.grad - x1.grad, split_dot_bound(gy, w.T, n=n))
        x_m = x
    out["bitwise"] = out.get("bitwise", 0) + torch.equal(
        as_bits(wt.grad), as_bits(cut_grad(w1, name, cfg, mp))
    )
    out["weights"] = out.get("weights", 0) + 1
    # weight gradient: gy_mᵀ·x over the b·s tokens, the same terms in either model
    g2 = gy_m.reshape(tokens, -1).T
    _worst(
        out,
        "dw",
        wt.grad - cut_grad(w1, name, cfg, mp),
        any_order_bound(g2, x_m.reshape(tokens, -1).T),
    )
    if bt is not None:  # Σ over the b·s tokens of gy
        want = cut_grad(b1, name[:-6] + "bias", cfg, mp)
        _worst(out, "db", bt.grad - want, any_order_bound(g2, torch.ones(1, tokens)).squeeze(-1))


def cut_grad(p, name, cfg, mp):
    from zero.mp import split_state

    return split_state({name: p.grad}, cfg, m=mp.rank, n=mp.size)[name]


def lockstep(rank, world, deterministic, plant=None):
    """Worker: max error/bound ratios per check on this MP rank, every split operator of the
    model (each block's four linears, the tied head, the embedding, the cross entropy)."""
    from verify.mp_bounds import xent_bounds
    from zero.mp import layers

    cfg, full, mp, batches = _setup(deterministic, plant)
    n, m, out = mp.size, mp.rank, {}
    for idx, tgt in batches:
        cap, mods = _capture(full, idx, tgt)
        for name, mod in mods.items():
            if isinstance(mod, nn.Linear):
                _linear(name, mod, cap[name], cfg, mp, out)
        # cross entropy on the N_m = 1 logits
        z = cap["lm_head.weight"]["y"].view(-1, cfg.vocab_size)
        z1, zt = z.clone().requires_grad_(), z.chunk(n, -1)[m].clone().requires_grad_()
        l1 = F.cross_entropy(z1, tgt.reshape(-1))
        l1.backward()
        lt = layers.vocab_cross_entropy(zt, tgt.reshape(-1), mp)
        lt.backward()
        lb, gb = xent_bounds(z, tgt.reshape(-1), n=n)
        _worst(out, "xent_loss", lt - l1, lb)
        _worst(out, "xent_grad", zt.grad - z1.grad.chunk(n, -1)[m], gb.chunk(n, -1)[m])
        # embedding: one rank holds each row, the others add +0 (values equal; docs §6)
        emb, w = cap["transformer.wte.weight"], full.transformer.wte.weight.detach()
        we, w1 = w.chunk(n)[m].clone().requires_grad_(), w.clone().requires_grad_()
        e_t = layers.vocab_embedding(idx, we, mp)
        e_t.backward(emb["gout"])
        F.embedding(idx, w1).backward(emb["gout"])
        same = bool((e_t == emb["y"]).all() and (we.grad == w1.grad.chunk(n)[m]).all())
        out["embed_equal"] = out.get("embed_equal", True) and same
    return out


CHECKS = ("col_fwd", "col_dx", "row_fwd", "row_dx", "dw", "db", "xent_loss", "xent_grad")


def check_lockstep(n, deterministic):
    ranks = get_pool(n).run(lockstep, deterministic, timeout_s=600)
    for r in ranks:
        # every ratio is error / derived bound (verify/mp_bounds.py, docs/design.md §6): <= 1
        for key in CHECKS:
            assert r[key] <= 1.0, (key, r[key])
        assert r["embed_equal"]
    return ranks


@pytest.mark.dist
@pytest.mark.parametrize("deterministic", [True, False])
def test_tp_operators_within_the_derived_bound_at_2(deterministic):
    check_lockstep(2, deterministic)


@pytest.mark.dist
@pytest.mark.full
@pytest.mark.parametrize("deterministic", [True, False])
def test_tp_operators_within_the_derived_bound_at_4(deterministic):
    check_lockstep(4, deterministic)


@pytest.mark.dist
@pytest.mark.parametrize("plant", ["no_sum", "mean"])
def test_a_planted_error_fails_the_bound(plant):
    """A missing g/f sum or one scaled by 1/N_m must break the forward and backward bounds."""
    ranks = get_pool(2).run(lockstep, True, plant, timeout_s=600)
    try:
        for r in ranks:
            assert r["row_fwd"] > 10 and r["col_dx"] > 10, r
    finally:
        get_pool(2).run(restore)


def restore(rank, world):
    """Worker: put the real reduce_sum back (the pool's workers outlive a test)."""
    import zero.mp.collectives as mpc

    mpc.reduce_sum = mpc.__dict__.get("_real_reduce_sum", mpc.reduce_sum)
