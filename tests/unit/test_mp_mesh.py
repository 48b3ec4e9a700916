"""zero.mp in one process: the mesh's arithmetic and bad input, exact split/join of the GPT,
the norm's ownership rule, the per-head attention assumption, and TPGPT.build's start values.
The fake-process-group mesh is in tests/distributed/test_mp_model.py (it needs a process)."""

import pytest
import torch
import torch.nn.functional as F

from zero.mp import Mesh, counts_in_norm, join_states, split_rule, split_state
from zero.mp.gpt import check_split
from zero.workloads.models import GPT, GPTConfig, gpt_num_params

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def bits(t):
    return t.contiguous().view(torch.int32)


def test_coordinates_are_mp_major():
    mesh = Mesh(dp=4, mp=2)
    assert [mesh.coords(r) for r in range(8)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    assert all(mesh.rank_of(*mesh.coords(r)) == r for r in range(8))
    assert mesh.mp_ranks(2) == [4, 5] and mesh.dp_ranks(1) == [1, 3, 5, 7]
    assert [g[:2] for g in mesh.all_groups()] == [
        ("mp", 0),
        ("mp", 1),
        ("mp", 2),
        ("mp", 3),
        ("dp", 0),
        ("dp", 1),
    ]


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: Mesh(dp=0, mp=2), "dp"),
        (lambda: Mesh(dp=2, mp=-1), "mp"),
        (lambda: Mesh(dp=True, mp=2), "dp"),
        (lambda: Mesh(dp=2, mp=1.5), "mp"),
        (lambda: Mesh(dp=2, mp=2).coords(4), "rank"),
        (lambda: Mesh(dp=2, mp=2).coords(-1), "rank"),
        (lambda: Mesh(dp=2, mp=2).rank_of(2, 0), "d"),
        (lambda: Mesh(dp=2, mp=2).rank_of(0, 2), "m"),
        (lambda: check_split(CFG, 3), "n_head"),
        (lambda: check_split(GPTConfig(vocab_size=66, n_head=4, n_embd=32), 4), "vocab_size"),
        (lambda: check_split(GPTConfig(dropout=0.1), 2), "dropout"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=rf"^{field}=.* is not allowed: expected"):
        call()


def test_mesh_is_keyword_only():
    with pytest.raises(TypeError):
        Mesh(2, 2)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_then_join_is_exact(n):
    full = GPT(CFG, seed=2).state_dict()
    parts = [split_state(full, CFG, m=m, n=n) for m in range(n)]
    joined = join_states(parts, CFG)
    assert joined.keys() == full.keys()
    for k, v in full.items():
        assert torch.equal(bits(joined[k]), bits(v)), k
    # shapes of one slice, from the rules (not from the code's output)
    h, v = CFG.n_embd, CFG.vocab_size
    p = parts[0]
    assert p["transformer.wte.weight"].shape == (v // n, h)
    assert p["transformer.h.0.attn.c_attn.weight"].shape == (3 * h // n, h)
    assert p["transformer.h.0.attn.c_proj.weight"].shape == (h, h // n)
    assert p["transformer.h.0.mlp.c_fc.bias"].shape == (4 * h // n,)
    assert p["transformer.h.0.mlp.c_proj.bias"].shape == (h,)
    # qkv: rank m holds heads m·H/N.. of q, then of k, then of v
    w = full["transformer.h.1.attn.c_attn.weight"]
    q_rows = w[:h].chunk(n)[n - 1]
    assert torch.equal(
        split_state(full, CFG, m=n - 1, n=n)["transformer.h.1.attn.c_attn.weight"][: h // n], q_rows
    )


@pytest.mark.parametrize("n", [2, 4])
def test_join_then_split_is_exact_and_checks_replicas(n):
    g = torch.Generator().manual_seed(0)
    full = GPT(CFG, seed=0).state_dict()
    parts = [
        {k: torch.randn(v.shape, generator=g) for k, v in split_state(full, CFG, m=0, n=n).items()}
        for _ in range(n)
    ]
    for k in parts[0]:
        if split_rule(k) is None:  # replicas hold the same bits
            for p in parts[1:]:
                p[k] = parts[0][k].clone()
        elif k == "lm_head.weight":  # tied to the embedding
            for p in parts:
                p[k] = p["transformer.wte.weight"]
    joined = join_states(parts, CFG)
    for m in range(n):
        again = split_state(joined, CFG, m=m, n=n)
        assert all(torch.equal(bits(again[k]), bits(parts[m][k])) for k in parts[m])
    parts[1]["transformer.ln_f.weight"] = parts[1]["transformer.ln_f.weight"] + 1
    with pytest.raises(ValueError, match="replicated transformer.ln_f.weight differs"):
        join_states(parts, CFG)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_norm_counts_every_element_once(n):
    """Σ over MP ranks of the elements each contributes to the norm = Ψ of the plain GPT."""
    full = GPT(CFG, seed=0)
    names = [k for k, _ in full.named_parameters()]  # the tied head appears once
    total = 0
    for m in range(n):
        sliced = split_state(dict(full.named_parameters()), CFG, m=m, n=n)
        total += sum(sliced[k].numel() for k in names if counts_in_norm(k, m))
    assert total == gpt_num_params(CFG)


@pytest.mark.parametrize("heads, n", [(4, 2), (4, 4), (8, 4)])
def test_attention_of_a_head_subset_is_the_same_bits(heads, n):
    """The assumption that lets operator lock-step cover the model (docs/design.md §6): SDPA
    on heads m·H/N.. alone gives those heads' bits of the all-heads call, forward and back."""
    g = torch.Generator().manual_seed(heads)
    q, k, v = (torch.randn(2, heads, 16, 8, generator=g, requires_grad=True) for _ in range(3))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    for m in range(n):
        s = slice(m * heads // n, (m + 1) * heads // n)
        qs, ks, vs = (z.detach()[:, s].clone().requires_grad_() for z in (q, k, v))
        ys = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        ys.backward(gy[:, s].contiguous())
        assert torch.equal(bits(ys), bits(y[:, s]))
        for part, whole in ((qs, q), (ks, k), (vs, v)):
            assert torch.equal(bits(part.grad), bits(whole.grad[:, s]))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_build_draws_the_plain_models_slices(n):
    """TPGPT.build (one full tensor at a time) = TPGPT.from_gpt (the whole plain model), bits."""
    from zero.collectives import CommCounter
    from zero.mp import TPGPT, MPContext

    full = GPT(CFG, seed=7)
    for m in range(n):
        mp = MPContext(group=None, size=n, rank=m, counter=CommCounter())
        built = dict(TPGPT.build(CFG, mp, seed=7).named_parameters())
        cut = dict(TPGPT.from_gpt(full, mp).named_parameters())
        assert built.keys() == cut.keys()
        assert all(torch.equal(bits(built[k]), bits(cut[k])) for k in built)
        tp = TPGPT.build(CFG, mp, seed=7)
        assert tp.lm_head.weight is tp.transformer.wte.weight  # the tie survives
