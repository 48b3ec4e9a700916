"""Real-world workloads wrapped unchanged by the engine (docs/models.md, "Workloads"):

1. zero.workloads.resnet.ResNet (BatchNorm) at stages 0-3: the same bits at every stage and at N = 1
and 2,
   buffers equal on every rank, and `python -m zero.workloads.digits` end to end.
2. Hugging Face GPT-2 (tied lm_head) and Llama built from configs with random weights: the same
   bits at every stage and N, the first-step loss equal to the plain model's, and one step within
   a derived bound of torch.optim.AdamW on the mean gradient.

Deterministic mode, fp32, AdamW throughout. "Same bits" compares
verify.checks.harness.state_digest: a
hash of the full gathered fp32 master, both Adam moments, the working parameters, t and the norm.
"""

import importlib.util
import json

import numpy as np
import pytest
import torch

from reference import Hyper
from verify.checks.harness import state_digest
from zero.build import auto
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.loop import train_steps
from zero.ranks.local import get_pool
from zero.workloads.resnet import ResNet, ResNetConfig

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None
U = 2.0**-24  # float32 unit roundoff

M = 4  # micro-batches per step: 2 per rank at N = 2, 4 at N = 1


# -- 1. ResNet with BatchNorm ---------------------------------------------------------------------


def image_batch(step, j):
    """8 random 8×8 images; micro-batch j has its own mean, so ranks' batch statistics differ."""
    g = torch.Generator().manual_seed(1000 * step + j)
    return torch.randn(8, 1, 8, 8, generator=g) + 0.5 * j, torch.randint(0, 10, (8,), generator=g)


def resnet_run(rank, n, stage, steps=3):
    model = ResNet(ResNetConfig(depth=1), seed=0)
    cfg = ZeroConfig(
        stage=stage, micro_batches=M, chunk=128, units="auto", optimizer="adamw",
        groups=(Hyper(lr=1e-2, weight_decay=0.01),),
    )  # fmt: skip
    eng = ZeroEngine(model, cfg)
    results = train_steps(eng, image_batch, steps)
    digest = state_digest(eng, results[-1])
    with torch.no_grad():  # one eval forward: the buffers are broadcast before it
        eng.eval()
        eng(image_batch(steps, 0)[0])
    buffers = {k: v.clone().numpy() for k, v in model.named_buffers()}
    return digest, buffers, list(eng.config.units), [r.loss for r in results]


@pytest.fixture(scope="module")
def resnet_runs():
    runs = {(2, s): get_pool(2).run(resnet_run, s) for s in range(4)}
    runs[(1, 0)] = get_pool(1).run(resnet_run, 0)
    runs[(1, 3)] = get_pool(1).run(resnet_run, 3)
    return runs


def test_auto_units_of_the_resnet_are_its_residual_blocks():
    model = ResNet(ResNetConfig(depth=2))
    assert auto(model) == [f"blocks.{i}" for i in range(6)]


@pytest.mark.dist
def test_resnet_every_stage_and_world_size_gives_the_same_bits(resnet_runs):
    ref = resnet_runs[(2, 0)][0]
    assert ref[2] == ["blocks.0", "blocks.1", "blocks.2"]  # units="auto": the residual blocks
    for (n, stage), per_rank in resnet_runs.items():
        for rank, (digest, *_) in enumerate(per_rank):
            assert digest == ref[0], (n, stage, rank)


@pytest.mark.dist
def test_resnet_buffers_are_equal_on_every_rank_and_stage(resnet_runs):
    """After an eval forward every rank holds rank 0's running statistics (the broadcast), and
    at N = 2 they are the same bits at every stage. They are not compared with N = 1: there
    rank 0 runs all M micro-batches, at N = 2 only rank 0's (j even) update the statistics that
    survive the broadcast (DDP's semantics too), so the buffers depend on N as DDP's do."""
    ref = resnet_runs[(2, 0)][0][1]
    assert float(np.abs(ref["stem.1.running_mean"]).max()) > 0  # the statistics did move
    # rank 0's M/N micro-batches a step update the surviving statistics: 2 a step, 3 steps
    assert int(ref["stem.1.num_batches_tracked"]) == 3 * M // 2
    for (n, stage), per_rank in resnet_runs.items():
        for rank, (_, buffers, _, _) in enumerate(per_rank):
            same = per_rank[0][1] if n == 1 else ref
            for name, v in buffers.items():
                assert np.array_equal(v, same[name]), (n, stage, rank, name)


@pytest.mark.dist
@pytest.mark.skipif(
    not HAS_SKLEARN, reason="scikit-learn is not installed (pip install -e '.[models]')"
)
def test_digits_cli_reports_the_accuracy_of_the_model_it_saves(tmp_path):
    """`python -m zero.workloads.digits` end to end (stage 3, N = 2, few steps): the accuracy in its
    log is the one recomputed here, in this process, from OUT/model.pt on the test split. The
    count of correct predictions must be equal; a flip could come only from a logit tie broken
    differently under another thread count, which the test would report."""
    from zero.workloads.digits import accuracy, load_digits_split, main

    out = tmp_path / "digits"
    record = main(["--steps", "12", "--nproc", "2", "--stage", "3", "--out", str(out)])
    log = json.loads((out / "digits_log.json").read_text())
    assert log["kind"] == "digits.run" and "provenance" in log
    assert log["result"]["test_accuracy"] == record["result"]["test_accuracy"]
    assert len(log["result"]["losses"]) == 12
    model = ResNet(ResNetConfig(depth=log["config"]["depth"]))
    model.load_state_dict(torch.load(out / "model.pt"))
    _, _, x_test, y_test = load_digits_split(log["config"]["test_fraction"])
    correct, total = accuracy(model, x_test, y_test)
    assert (correct, total) == (log["result"]["test_correct"], log["result"]["test_total"])
    assert log["result"]["test_accuracy"] == correct / total
    # not vacuous: the freshly initialised model is near chance (1/10), the trained one is not
    fresh, _ = accuracy(ResNet(ResNetConfig(depth=1), seed=1), x_test, y_test)
    assert correct > fresh


# -- 2. Hugging Face transformers -----------------------------------------------------------------

needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="transformers is not installed (pip install -e '.[models]')"
)
LR, WD = 1e-3, 0.1
VOCAB, T = 128, 16


def hf_model(kind):
    """A random-weight model from a config (no download); the same bits in every process."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "gpt2":  # dropout off: plain_first_step draws from no seeded RNG
            cfg = GPT2Config(
                n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                eos_token_id=0, attn_implementation="eager",
            )  # fmt: skip
            return GPT2LMHeadModel(cfg)
        cfg = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
            attn_implementation="eager",
        )  # fmt: skip
        return LlamaForCausalLM(cfg)


def token_batch(step, j):
    g = torch.Generator().manual_seed(7919 * step + j)
    ids = torch.randint(0, VOCAB, (2, T), generator=g)
    return {"input_ids": ids, "labels": ids}


def hf_config(stage):
    return ZeroConfig(
        stage=stage, micro_batches=M, chunk=128, units="auto", optimizer="adamw",
        groups=(Hyper(lr=LR, weight_decay=WD),),
    )  # fmt: skip


def hf_run(rank, n, kind, stage, steps=2):
    """The engine's run; rank 0 also runs the plain model's first step (same process, same
    thread count) and returns both."""
    eng = ZeroEngine(hf_model(kind), hf_config(stage))
    first = {}

    def on_step(step, res):
        if step == 0:
            master, _ = eng.gather_state()
            first.update({k: v.clone().numpy() for k, v in master.items()})

    results = train_steps(eng, token_batch, steps, on_step=on_step)
    out = {
        "digest": state_digest(eng, results[-1]),
        "units": list(eng.config.units),
        "loss0": results[0].loss,
        "master0": first,
    }
    if rank == 0:
        out["plain"] = plain_first_step(kind)
    return out


def plain_first_step(kind):
    """Plain PyTorch on step 0's M micro-batches in one process: each loss, each gradient g_j,
    then torch.optim.AdamW(foreach=False) on the sequential mean gradient."""
    model = hf_model(kind)
    named = dict(model.named_parameters())  # tied lm_head.weight appears once
    losses, grads = [], []
    for j in range(M):
        model.zero_grad(set_to_none=True)
        loss = model(**token_batch(0, j)).loss
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({k: p.grad.detach().clone() for k, p in named.items()})
    before = {k: p.detach().clone().numpy() for k, p in named.items()}
    abs_sum = {k: sum(g[k].double().abs() for g in grads).numpy() for k in named}
    for k, p in named.items():
        acc = grads[0][k].clone()
        for g in grads[1:]:
            acc = acc + g[k]
        p.grad = acc * (1.0 / M)
    opt = torch.optim.AdamW(named.values(), lr=LR, weight_decay=WD, foreach=False)
    opt.step()
    after = {k: p.detach().clone().numpy() for k, p in named.items()}
    grad = {k: p.grad.clone().numpy() for k, p in named.items()}
    return {"losses": losses, "before": before, "after": after, "grad": grad, "abs_sum": abs_sum}


def adamw_bound(plain, k, *, lr=LR, eps=1e-8):
    """|engine p1 - torch p1| elementwise after the first AdamW step from zero moments.

    In exact arithmetic the first step is p1 = p0·(1 - lr·wd) - lr·f(g) with f(g) = g/(|g|+eps)
    (m̂ = g, v̂ = g² after bias correction), so |lr·f| <= lr. Two sources of difference:
      * the mean gradient: the engine sums the M micro-batch gradients in the reference's tree,
        torch here sequentially; each sum of M terms is within γ_{M-1}·Σ|g_j| of the exact one
        (γ_k = k·u/(1 - k·u)), and ·1/M is exact (a power of two), so δ = 2γ_{M-1}·Σ|g_j|/M.
        f changes by at most δ·max f' over [|g| - δ, |g| + δ], f'(x) = eps/(|x|+eps)², and
        never by more than 2 (|f| <= 1).
      * the arithmetic of the update: each implementation rounds the decay product (u·|p0|),
        about 12 operations on the path of lr·f (m, v, sqrt, the bias corrections, + eps, the
        division, the step size: at most 16u·lr relative to lr, counting torch's sqrt at 1 ulp
        and each float32-rounded scalar) and the final subtraction (u·|p1| <= u·(|p0| + lr)).
        Both implementations: 2·(16u·lr + u·|p0| + u·(|p0| + lr))."""
    g = plain["grad"][k].astype(np.float64)
    p0 = np.abs(plain["before"][k].astype(np.float64))
    gamma = (M - 1) * U / (1 - (M - 1) * U)
    delta = 2 * gamma * plain["abs_sum"][k] / M
    low = np.maximum(np.abs(g) - delta, 0.0)
    df = np.minimum(delta * eps / (low + eps) ** 2, 2.0)
    return lr * df + 2 * (16 * U * lr + U * p0 + U * (p0 + lr))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_runs(request):
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed (pip install -e '.[models]')")
    kind = request.param
    runs = {(2, s): get_pool(2).run(hf_run, kind, s) for s in range(4)}
    runs[(1, 0)] = get_pool(1).run(hf_run, kind, 0)
    runs[(1, 3)] = get_pool(1).run(hf_run, kind, 3)
    return kind, runs


@needs_transformers
def test_auto_units_are_the_decoder_layers():
    assert auto(hf_model("gpt2")) == ["transformer.h.0", "transformer.h.1"]
    assert auto(hf_model("llama")) == ["model.layers.0", "model.layers.1"]


@pytest.mark.dist
@needs_transformers
def test_hf_every_stage_and_world_size_gives_the_same_bits(hf_runs):
    kind, runs = hf_runs
    ref = runs[(2, 0)][0]
    layers = "transformer.h" if kind == "gpt2" else "model.layers"
    assert ref["units"] == [f"{layers}.0", f"{layers}.1"]
    for (n, stage), per_rank in runs.items():
        for rank, got in enumerate(per_rank):
            assert got["digest"] == ref["digest"], (kind, n, stage, rank)


@pytest.mark.dist
@needs_transformers
def test_hf_first_loss_equals_the_plain_models_mean(hf_runs):
    """The engine's loss is the float64 mean of the M micro-batch losses. The losses are float32
    values within a few binades of ln(128), so their float64 sum is exact in any order: the
    engine's reported loss equals the plain mean bit for bit at every stage and N."""
    kind, runs = hf_runs
    plain = runs[(2, 0)][0]["plain"]
    want = float(np.sum(np.array(plain["losses"], dtype=np.float64)) / M)
    assert abs(want - np.log(VOCAB)) < 1.0, want  # random weights: about ln(vocab)
    for (n, stage), per_rank in runs.items():
        for got in per_rank:
            assert got["loss0"] == want, (kind, n, stage, got["loss0"], want)


@pytest.mark.dist
@needs_transformers
def test_hf_first_step_is_torch_adamw_within_the_derived_bound(hf_runs):
    kind, runs = hf_runs
    plain = runs[(2, 0)][0]["plain"]
    names = set(plain["after"])
    if kind == "gpt2":  # tied: one parameter, trained once
        assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    for (n, stage), per_rank in runs.items():
        master = per_rank[0]["master0"]
        assert set(master) == names, (kind, n, stage, set(master) ^ names)
        for k in sorted(names):
            got = master[k].reshape(plain["after"][k].shape).astype(np.float64)
            diff = np.abs(got - plain["after"][k])
            bound = adamw_bound(plain, k)
            assert np.all(diff <= bound), (kind, n, stage, k, float((diff / bound).max()))
    # not vacuous: the step moved every tensor by far more than the bound, and torch's AdamW
    # without the decoupled decay (a planted bug) is outside it
    master = runs[(2, 0)][0]["master0"]
    bounds = np.concatenate([adamw_bound(plain, k).ravel() for k in sorted(names)])
    moved = np.concatenate(
        [np.abs(plain["after"][k] - plain["before"][k]).ravel() for k in sorted(names)]
    )
    assert np.mean(moved > 100 * bounds) > 0.9, np.mean(moved > 100 * bounds)
    k = max(names, key=lambda k: np.abs(plain["before"][k]).max())
    no_decay = plain["after"][k].astype(np.float64) + LR * WD * plain["before"][k]
    got = master[k].reshape(no_decay.shape)
    assert np.any(np.abs(got - no_decay) > adamw_bound(plain, k)), k
