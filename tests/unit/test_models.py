"""zero.workloads.models: counter-based init, the tied head, forward/backward, data, and bitwise
determinism.

Bits are compared on integer views (``.view(torch.int32)``), so -0.0 vs +0.0 and NaN payloads
count as differences, as they do for the engine's bitwise checks.
"""

import math

import pytest
import torch

from zero.workloads.models import (
    GPT,
    MLP,
    GPTConfig,
    MLPConfig,
    ParamInit,
    gpt_microbatches,
    init_parameters,
    init_value,
    materialize,
    mlp_microbatches,
    param_init,
    stable_seed,
)

SMALL = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert same_bits(a[name], b[name]), name


@pytest.fixture
def one_thread():
    # docs/design.md §2 pins threads: on this CPU a GPT's gradients at 1 and at 2 threads differ in
    # the last bits, so bitwise tests must not depend on the machine's default.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def grads_of(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    _, loss = model(*batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


# --- initialisation ---------------------------------------------------------------------------


def test_init_is_the_same_bits_whatever_the_construction_route():
    reference = state(GPT(SMALL, seed=7))
    # Global RNG state and other constructions in between must not matter.
    torch.manual_seed(12345)
    torch.randn(1000)
    MLP(MLPConfig(), seed=7)
    assert_same_state(reference, state(GPT(SMALL, seed=7)))
    # Meta first, materialised later.
    meta = GPT(SMALL, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert_same_state(reference, state(materialize(meta, device="cpu", seed=7)))
    # Re-initialising a trained-on model restores the same bits.
    model = GPT(SMALL, seed=0)
    init_parameters(model, 7)
    assert_same_state(reference, state(model))


def test_init_does_not_depend_on_the_thread_count():
    # A forked rank runs on 1 thread; the single-process model it must match may not.
    cfg = GPTConfig(vocab_size=4096, block_size=16, n_layer=1, n_head=2, n_embd=64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = state(GPT(cfg, seed=9))
        torch.set_num_threads(1)
        one = state(GPT(cfg, seed=9))
    finally:
        torch.set_num_threads(before)
    assert_same_state(one, two)


def test_construction_does_not_touch_the_global_rng():
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    GPT(SMALL, seed=1)
    MLP(seed=1)
    assert torch.equal(before, torch.random.get_rng_state())


def test_one_unit_materialised_alone_matches_the_whole_model():
    """What a stage-3 rank does: learn a unit's rule from a meta model and draw only its values."""
    whole = state(GPT(SMALL, seed=11))
    meta = GPT(SMALL, device="meta")
    unit = meta.unit_names()[1]
    names = [n for n, _ in meta.named_parameters() if n.startswith(unit + ".")]
    assert names
    for name in reversed(names):  # any order
        spec = param_init(meta, name)
        shape = meta.get_parameter(name).shape
        value = init_value(11, name, shape, spec.kind, std=spec.std)
        assert same_bits(value, whole[name]), name


def test_init_into_another_dtype_is_the_cast_of_the_float32_draw():
    fp32 = state(GPT(SMALL, seed=5))
    model = GPT(SMALL, seed=0).to(torch.bfloat16)
    init_parameters(model, 5)
    for name, p in model.named_parameters():
        assert same_bits(p.detach(), fp32[name].to(torch.bfloat16)), name


def test_init_value_depends_on_seed_and_name():
    a = init_value(0, "transformer.h.0.attn.c_attn.weight", (96, 32), "normal")
    assert same_bits(a, init_value(0, "transformer.h.0.attn.c_attn.weight", (96, 32), "normal"))
    assert not torch.equal(
        a, init_value(1, "transformer.h.0.attn.c_attn.weight", (96, 32), "normal")
    )
    assert not torch.equal(
        a, init_value(0, "transformer.h.1.attn.c_attn.weight", (96, 32), "normal")
    )
    # Across a whole model, no two normal-initialised parameters share their leading values.
    heads = [p.detach().reshape(-1)[:8] for p in GPT(SMALL, seed=0).parameters() if p.dim() == 2]
    assert len({tuple(h.tolist()) for h in heads}) == len(heads)


def test_init_value_statistics_and_kinds():
    w = init_value(0, "w", (256, 256), "normal", std=0.02)
    # 65536 draws: the sample std is within 1% of 0.02 with overwhelming probability
    # (its relative standard error is 1/sqrt(2n) = 0.28%).
    assert abs(w.std().item() / 0.02 - 1) < 0.01
    assert torch.equal(init_value(0, "b", (3,), "zeros"), torch.zeros(3))
    assert torch.equal(init_value(0, "g", (3,), "ones"), torch.ones(3))
    with pytest.raises(ValueError, match="kind"):
        init_value(0, "w", (3,), "uniform")
    with pytest.raises(ValueError, match="std"):
        ParamInit(kind="normal", std=-1.0)


def test_gpt_init_scheme():
    model = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4), seed=0)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln_" in name:
            assert torch.equal(p.detach(), torch.ones_like(p)), name
        else:
            std = 0.02 / math.sqrt(2 * 4) if name.endswith("c_proj.weight") else 0.02
            assert abs(p.std().item() / std - 1) < 0.1, name  # >= 16384 draws each


def test_stable_seed_is_stable():
    # Pinned: the value must not change between processes or Python versions (blake2b, not hash).
    assert stable_seed(0, "transformer.wte.weight") == stable_seed("0:transformer.wte.weight")
    assert 0 <= stable_seed(0, "x") < 2**63
    assert stable_seed(0, "x") != stable_seed(1, "x")


def test_init_parameters_rejects_meta():
    with pytest.raises(ValueError, match="meta"):
        init_parameters(GPT(SMALL, device="meta"), 0)


# --- structure --------------------------------------------------------------------------------


def test_tied_head_is_one_parameter_counted_once():
    model = GPT(SMALL)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    d, v, t, L = SMALL.n_embd, SMALL.vocab_size, SMALL.block_size, SMALL.n_layer
    per_block = (
        2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    )
    assert model.num_params() == v * d + t * d + L * per_block + 2 * d
    # Still tied after the meta route.
    late = materialize(GPT(SMALL, device="meta"), device="cpu", seed=0)
    assert late.lm_head.weight is late.transformer.wte.weight


def test_unit_names_partition_the_parameters():
    for model in (GPT(SMALL), MLP(MLPConfig(n_layer=3))):
        units = model.unit_names()
        for unit in units:
            model.get_submodule(unit)  # resolves
        names = [n for n, _ in model.named_parameters()]
        in_units = [n for n in names if any(n.startswith(u + ".") for u in units)]
        root = [n for n in names if n not in in_units]
        assert in_units and root
    gpt = GPT(SMALL)
    assert gpt.unit_names() == ["transformer.h.0", "transformer.h.1"]
    root = [n for n, _ in gpt.named_parameters() if not n.startswith("transformer.h.")]
    assert root == ["transformer.wte.weight", "transformer.wpe.weight"] + [
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]
    assert MLP(MLPConfig(n_layer=3)).unit_names() == ["layers.0", "layers.1"]
    assert MLP(MLPConfig(n_layer=1)).unit_names() == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_embd=30, n_head=4), "n_embd"),
        (dict(n_layer=0), "n_layer"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(n_head=True), "n_head"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(bias=1), "bias"),
    ],
)
def test_gpt_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.*expected"):
        GPTConfig(**kwargs)


@pytest.mark.parametrize("field", ["d_in", "d_hidden", "d_out", "n_layer"])
def test_mlp_config_errors_name_the_field(field):
    with pytest.raises(ValueError, match=rf"^{field}=0 is not allowed"):
        MLPConfig(**{field: 0})


def test_configs_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        GPTConfig(256)
    with pytest.raises(AttributeError):
        GPTConfig().n_layer = 3


# --- forward / backward -----------------------------------------------------------------------


def test_gpt_loss_at_init_is_near_ln_vocab():
    """Loss at init is ln V + O(σ²) with σ the logits' spread, so |loss − ln V| < 0.1.

    ln_f outputs have unit variance per channel and the tied head's rows are N(0, 0.02²), so a
    logit is ~N(0, σ²) with σ = 0.02·sqrt(d) = 0.11 at d = 32. For iid Gaussian logits
    E[logsumexp] ≈ ln V + σ²/2 = ln V + 0.006. The tie adds ≈ |w_i|²/|x| ≈ 0.6 to the logit of the
    *input* token, which is never the target here (strides ≥ 1), raising the loss by about
    (e^0.6 − 1)/V < 0.01. Sampling noise over B·T = 64 tokens is < 0.02. The bound 0.1 is ~3x the
    sum, and far below the distance to any trained model's loss.
    """
    model = GPT(SMALL, seed=0)
    for idx, targets in gpt_microbatches(SMALL, seed=0, data_step=0, count=3, batch_size=4):
        logits, loss = model(idx, targets)
        assert logits.shape == (4, SMALL.block_size, SMALL.vocab_size)
        assert math.isfinite(loss.item())
        assert abs(loss.item() - math.log(SMALL.vocab_size)) < 0.1
        loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    logits, loss = model(idx)
    assert loss is None and logits.shape[1] == SMALL.block_size


def test_gpt_rejects_a_too_long_sequence():
    with pytest.raises(ValueError, match="block_size"):
        GPT(SMALL)(torch.zeros(1, SMALL.block_size + 1, dtype=torch.long))


def test_mlp_forward_backward():
    cfg = MLPConfig()
    model = MLP(cfg, seed=0)
    x, y = mlp_microbatches(cfg, seed=0, data_step=0, count=1, batch_size=8)[0]
    out, loss = model(x, y)
    assert out.shape == (8, cfg.d_out)
    assert torch.equal(loss, ((out - y) ** 2).mean())
    loss.backward()
    # The first layer's gradient is not negligible: the fan-in init keeps the signal alive.
    assert model.layers[0].weight.grad.abs().max() > 1e-3


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("which", ["gpt", "mlp"])
def test_two_identical_passes_give_the_same_gradient_bits(which):
    if which == "gpt":
        model = GPT(SMALL, seed=1)
        batch = gpt_microbatches(SMALL, seed=1, data_step=0, count=1, batch_size=4)[0]
    else:
        model = MLP(seed=1)
        batch = mlp_microbatches(model.cfg, seed=1, data_step=0, count=1, batch_size=8)[0]
    loss_a, grads_a = grads_of(model, batch)
    loss_b, grads_b = grads_of(model, batch)
    assert same_bits(loss_a, loss_b)
    assert_same_state(grads_a, grads_b)


def repoint_into_flat_buffer(model, *, align: int, shift: int) -> torch.Tensor:
    """Move every parameter into one flat buffer, each at an offset ≡ shift (mod align)."""
    params = list(model.parameters())  # a tied weight once
    flat = torch.full((sum(p.numel() + 2 * align for p in params),), float("nan"))
    offset = 0
    for p in params:
        offset = -(-offset // align) * align + shift
        view = flat[offset : offset + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        offset += p.numel()
    return flat


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("shift", [1, 3, 37])
def test_gradient_bits_do_not_depend_on_parameter_offsets(shift):
    """docs/design.md §2's trap: BLAS may pick code paths by alignment. Aligned (128 elements, the
    layout's ALIGN) and unaligned offsets inside a flat buffer must give the same bits as
    separately allocated parameters."""
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=128)
    batch = gpt_microbatches(cfg, seed=2, data_step=0, count=1, batch_size=4)[0]
    model = GPT(cfg, seed=2)
    expected = grads_of(model, batch)
    for align, s in ((128, 0), (128, shift)):
        flat = repoint_into_flat_buffer(model, align=align, shift=s)
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
        starts = {(p.data_ptr() - flat.data_ptr()) // 4 % 128 for p in model.parameters()}
        assert starts == {s}
        loss, grads = grads_of(model, batch)
        assert same_bits(loss, expected[0])
        assert_same_state(grads, expected[1])


# --- data -------------------------------------------------------------------------------------


def test_gpt_microbatches_are_a_function_of_seed_step_and_index():
    batches = gpt_microbatches(SMALL, seed=4, data_step=9, count=4, batch_size=3)
    torch.manual_seed(0)  # the global RNG plays no part
    for j in range(4):
        again = gpt_microbatches(SMALL, seed=4, data_step=9, count=j + 1, batch_size=3)[j]
        assert torch.equal(batches[j][0], again[0]) and torch.equal(batches[j][1], again[1])
    idx, targets = batches[0]
    assert idx.dtype == torch.long and idx.shape == (3, SMALL.block_size)
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    assert 0 <= int(idx.min()) and int(idx.max()) < SMALL.vocab_size
    others = [
        gpt_microbatches(SMALL, seed=5, data_step=9, count=1, batch_size=3)[0],
        gpt_microbatches(SMALL, seed=4, data_step=10, count=1, batch_size=3)[0],
        batches[1],
    ]
    for other in others:
        assert not torch.equal(idx, other[0])


def test_mlp_microbatches_are_a_function_of_seed_step_and_index():
    cfg = MLPConfig()
    batches = mlp_microbatches(cfg, seed=4, data_step=9, count=3, batch_size=5)
    torch.manual_seed(0)
    for j in range(3):
        x, y = mlp_microbatches(cfg, seed=4, data_step=9, count=j + 1, batch_size=5)[j]
        assert same_bits(x, batches[j][0]) and same_bits(y, batches[j][1])
    x, y = batches[0]
    assert x.shape == (5, cfg.d_in) and y.shape == (5, cfg.d_out) and y.dtype == torch.float32
    assert not torch.equal(
        x, mlp_microbatches(cfg, seed=4, data_step=10, count=1, batch_size=5)[0][0]
    )


def test_data_helpers_validate_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        gpt_microbatches(SMALL, seed=0, data_step=0, count=1, batch_size=0)
    with pytest.raises(ValueError, match="data_step"):
        mlp_microbatches(MLPConfig(), seed=0, data_step=-1, count=1, batch_size=1)
