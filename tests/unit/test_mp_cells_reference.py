"""verify/mp/cells.py's reference side, which must not come from zero/mp (the code under test):
its split rule against docs/design.md §6.1 written out by hand, its cut and join as inverses that
place QKV's heads, and SlicedGPT (the plain GPT with its split operators evaluated slice by
slice) computing the plain GPT's function. That it also gives the TP slices' bits is what the
model-parallel cells check (tests/distributed/test_verify_mp.py)."""

import numpy as np
import pytest
import torch

from verify.checks.harness import microbatch_loss_and_grads
from verify.mp import cells as mp_cells
from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

CFG = GPTConfig(**{**mp_cells.CFG, "n_head": 4})  # 4 heads: N_m up to 4

SPLIT = {  # docs/design.md §6.1, by hand, for a one-block GPT
    "transformer.wte.weight": "rows",
    "lm_head.weight": "rows",
    "transformer.wpe.weight": None,
    "transformer.h.0.ln_1.weight": None,
    "transformer.h.0.ln_1.bias": None,
    "transformer.h.0.attn.c_attn.weight": "qkv",
    "transformer.h.0.attn.c_attn.bias": "qkv",
    "transformer.h.0.attn.c_proj.weight": "cols",
    "transformer.h.0.attn.c_proj.bias": None,
    "transformer.h.0.ln_2.weight": None,
    "transformer.h.0.ln_2.bias": None,
    "transformer.h.0.mlp.c_fc.weight": "rows",
    "transformer.h.0.mlp.c_fc.bias": "rows",
    "transformer.h.0.mlp.c_proj.weight": "cols",
    "transformer.h.0.mlp.c_proj.bias": None,
    "transformer.ln_f.weight": None,
    "transformer.ln_f.bias": None,
}

# [Composition, not rounding] as in tests/distributed/test_mp_model.py: no rounding bound exists
# for a whole model (docs/design.md §6.6), so SlicedGPT is compared with the plain GPT in float64.
# Both round at u = 2^-53; to differ by 2^-24 relative they would need a condition number above
# 2^29, while an operator put together wrongly moves the loss and gradients at the percent level.
# Relative to the loss, and to each gradient tensor's largest element.
SEPARATION = 2.0**-24


def test_the_split_rule_is_design_6_1():
    assert {n: mp_cells.split_of(n) for n in SPLIT} == SPLIT
    one_block = GPT(GPTConfig(**{**mp_cells.CFG, "n_layer": 1}), seed=0)
    names = {n for n, _ in one_block.named_parameters()}
    assert names == set(SPLIT) - {"lm_head.weight"}  # the tied head is listed once, as wte


def test_cut_places_qkv_heads_and_columns():
    w = np.arange(12, dtype=np.float32).reshape(6, 2)  # rows 0-1 q, 2-3 k, 4-5 v; h = 2
    assert mp_cells.cut(w, "qkv", 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]  # rows 1, 3, 5
    c = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert mp_cells.cut(c, "cols", 1, 2).tolist() == [[2, 3], [6, 7]]
    assert mp_cells.cut(c, "rows", 0, 2).tolist() == [[0, 1, 2, 3]]
    assert mp_cells.cut(c, None, 1, 2).tolist() == c.tolist()


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("rule", ["rows", "cols", "qkv", None])
def test_join_undoes_cut_bit_for_bit(rule, n):
    a = np.random.default_rng(0).standard_normal((12, 8)).astype(np.float32)
    a[0, 0] = -0.0
    back = mp_cells.join([mp_cells.cut(a, rule, m, n) for m in range(n)], rule)
    assert back.shape == a.shape and np.array_equal(back.view(np.uint32), a.view(np.uint32))


def test_join_refuses_replicated_slices_that_differ():
    a = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match="ln_f.bias: replicated"):
        mp_cells.join([a, a + 1], None, "transformer.ln_f.bias")


def composition_errors(n: int) -> tuple[float, float]:
    """(loss error relative to |loss|, worst gradient error relative to each tensor's largest
    element) of SlicedGPT at N_m = n against the plain GPT, in float64, over two micro-batches."""
    whole = {k: v.detach().double().numpy() for k, v in GPT(CFG, seed=3).named_parameters()}
    plain, sliced = GPT(CFG, seed=0), mp_cells.SlicedGPT(CFG, n)
    loss_err = grad_err = 0.0
    for batch in gpt_microbatches(CFG, seed=1, data_step=0, count=2, batch_size=2):
        l1, g1 = microbatch_loss_and_grads(plain, whole, batch, torch.float64, None)
        ln, gn = microbatch_loss_and_grads(sliced, whole, batch, torch.float64, None)
        assert gn.keys() == g1.keys()
        loss_err = max(loss_err, abs(ln - l1) / abs(l1))
        for k, g in g1.items():
            grad_err = max(grad_err, float(np.abs(gn[k] - g).max() / np.abs(g).max()))
    return loss_err, grad_err


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sliced_gpt_computes_the_plain_gpt(n):
    loss_err, grad_err = composition_errors(n)
    assert loss_err <= SEPARATION and grad_err <= SEPARATION, (loss_err, grad_err)


def test_a_partial_left_out_fails_the_composition_check(monkeypatch):
    """Every sum over the slices (row-parallel outputs, f's input gradients, the cross
    entropy's Σ exp) without its last partial: the check must see it."""
    real = mp_cells.tree_sum
    monkeypatch.setattr(mp_cells, "tree_sum", lambda xs: real(xs[:-1]) if len(xs) > 1 else xs[0])
    loss_err, grad_err = composition_errors(2)
    assert loss_err > 1e3 * SEPARATION and grad_err > 1e3 * SEPARATION, (loss_err, grad_err)
