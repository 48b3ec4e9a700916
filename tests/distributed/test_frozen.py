"""Frozen parameters (requires_grad=False): docs/design.md §2 "Which parameters train", §3.

A LoRA model (zero/workloads/lora.py: the project's GPT, every parameter frozen, low-rank adapters
on its linears) trains at stages 0-3 and N = 1, 2, 4 to the reference's bits, where the reference's
spec holds the trainable parameters alone and its micro-batch gradients are computed in one
process on the working copy (the frozen values in the compute dtype); the frozen values never
change. Against plain torch.optim.AdamW over the trainable parameters: one step with clipping
within a derived bound, and the clipping norm leaves the frozen parameters out. memory_report
and the traffic counter equal verify/checks/expect.py's expectations (built from the model and
config
alone) exactly; checkpoints restore frozen values across N and stage and consolidate them.
"""

import importlib.util
import json

import numpy as np
import pytest
import torch

from reference.optim import Hyper
from reference.precision import DTYPES, cast
from reference.simulate import World
from reference.step import StepConfig, init_state, train_step, working_copy
from verify.checks import expect
from zero import checkpoint
from zero.config import ZeroConfig
from zero.engine import ZeroEngine, backward_scaled, cast_inputs
from zero.ranks.local import get_pool
from zero.workloads.lora import add_lora
from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCH, SEED = 2, 3
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lora_gpt(rank=2):
    """The project's GPT with every parameter frozen and adapters on its untied linears."""
    model = GPT(GPT_CFG, seed=SEED)
    add_lora(model, rank, seed=SEED)
    with torch.no_grad():  # B = 0 would give A a zero gradient on the first step: give B
        for name, p in model.named_parameters():  # values so that every adapter moves
            if name.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.02)
    return model


def config(stage, n, k=2, **kw):
    return ZeroConfig(
        stage=stage,
        micro_batches=n * k,
        chunk=128,
        units=tuple(GPT(GPT_CFG, device="meta").unit_names()),
        **kw,
    )


def batches(step, m):
    return gpt_microbatches(GPT_CFG, seed=SEED, data_step=step, count=m, batch_size=BATCH)


def f32bits(t):
    return t.detach().float().cpu().clone().view(torch.int32).numpy()  # a copy: no shared storage


def run_engine(
    rank, n, stage, steps=2, precision="fp32", clip_norm=0.5, save=None, load=None, options=()
):
    """`steps` steps of the LoRA GPT at M = 4 (from a checkpoint `load`, then saved to `save`);
    returns the full master, moments, frozen values, norms, memory and step 1's traffic."""
    torch.set_num_threads(1)
    model = lora_gpt()
    cfg = config(stage, n, 4 // n, precision=precision, clip_norm=clip_norm, **dict(options))
    eng = ZeroEngine(model, cfg)
    frozen0 = frozen_bits(eng)
    start = 0
    if load is not None:
        with eng.gathered_params(), torch.no_grad():  # wrong values: the load must restore them
            for p in model.parameters():
                if not p.requires_grad:
                    p.zero_()
        start = eng.load(load).data_step
    norms = []
    for step in range(start, start + steps):
        bs = batches(step, cfg.micro_batches)
        for j in range(rank, cfg.micro_batches, n):
            eng.backward(eng(*bs[j])[1])
        norms.append(eng.step().norm)
    if save is not None:
        eng.save(save)
    master, opt = eng.gather_state()
    return {
        "master": {k: f32bits(v) for k, v in master.items()},
        "opt": {k: {x: f32bits(t) for x, t in v.items()} for k, v in opt.items()},
        "frozen0": frozen0,
        "frozen": frozen_bits(eng),
        "norms": norms,
        "memory": {k: v for k, v in eng.memory_report().items() if k != "comm_buffers"},
        "traffic": expect.traffic_of_step(eng.counter, eng.counter.step - 1),
        "units": [u.name for u in eng.units],
        "peak_live": getattr(eng.impl, "peak_live", None),  # stage 3: gathered units at once
    }


def frozen_bits(eng):
    with eng.gathered_params():
        return {n: f32bits(p) for n, p in eng.module.named_parameters() if not p.requires_grad}


def reference_run(steps=2, precision="fp32", clip_norm=0.5, m=4):
    """The reference: trainable spec only, micro-batch gradients in one process on the working
    copy (the trainable parameters rounded from the master, the frozen ones from their start)."""
    torch.set_num_threads(1)
    model = lora_gpt()
    cfg = config(0, 1, m)
    spec = expect.reference_spec(model, cfg)
    rcfg = StepConfig(precision=precision, micro_batches=m, clip_norm=clip_norm, world_size=1)
    start = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    frozen = {n: cast(v, precision) for n, v in start.items() if n not in spec.names}
    state = init_state({n: start[n] for n in spec.names}, spec, rcfg)
    dtype, norms = TORCH[precision], []
    for step in range(steps):
        work = {**working_copy(state, rcfg), **frozen}
        grads = []
        for b in batches(step, m):
            for name, p in model.named_parameters():
                p.data = torch.from_numpy(np.asarray(work[name], np.float32)).to(dtype)
                p.grad = None
            args, _ = cast_inputs(b, {}, dtype)
            backward_scaled(model(*args)[1], None)
            grads.append({n: cast(p.grad.float().numpy(), precision)
                          for n, p in model.named_parameters() if p.requires_grad})  # fmt: skip
        state, info = train_step(state, grads, spec, rcfg)
        norms.append(float(info.norm))
    return spec, state, norms, frozen


def bits(a):
    return np.asarray(a, np.float32).view(np.int32)


RUNS = [(1, 0), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (4, 3)]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def runs(request):
    precision = request.param
    todo = RUNS if precision == "fp32" else [(1, 0), (2, 2), (2, 3)]
    out = {(n, s): get_pool(n).run(run_engine, s, 2, precision) for n, s in todo}
    return precision, out, reference_run(precision=precision)


# -- 1. the reference's bits at every stage and N; frozen values never change ----------------


@pytest.mark.dist
def test_lora_trains_to_the_references_bits_and_frozen_values_never_change(runs):
    precision, out, (spec, state, norms, frozen) = runs
    assert spec.names and all(".lora_" in n for n in spec.names), spec.names
    assert len(frozen) > len(spec.names)
    for (n, stage), per_rank in out.items():
        for rank, got in enumerate(per_rank):
            where = (precision, n, stage, rank)
            assert sorted(got["master"]) == sorted(spec.names), where
            for name in spec.names:
                assert np.array_equal(got["master"][name], bits(state.master[name])), (where, name)
                for x, want in state.opt[name].items():
                    assert np.array_equal(got["opt"][name][x], bits(want)), (where, name, x)
            assert got["norms"] == norms, where
            if stage == 3:  # a frozen buffer is freed after its unit's backward, not kept to
                assert got["peak_live"] == 2, where  # the end: else 3 blocks' buffers at once
            assert sorted(got["frozen"]) == sorted(frozen), where
            for name, want in frozen.items():  # the start value rounded once, never updated
                assert np.array_equal(got["frozen"][name], bits(want)), (where, name)
                assert np.array_equal(got["frozen0"][name], got["frozen"][name]), (where, name)
    # not vacuous: the adapters moved, and the trunk would have had gradients
    master0 = out[(1, 0)][0]["master"]
    start = {n: bits(p.detach().numpy()) for n, p in lora_gpt().named_parameters()}
    assert all(not np.array_equal(master0[n], start[n]) for n in spec.names)


# -- 3. resident bytes and traffic: exactly what verify/checks/expect.py builds from the model
# ------


@pytest.mark.dist
def test_memory_and_traffic_equal_the_expectations_and_the_simulation(runs):
    precision, out, (spec, state, norms, frozen_values) = runs
    cb = 2 if precision == "bf16" else 4
    model = lora_gpt()
    for (n, stage), per_rank in out.items():
        cfg = config(stage, n, 4 // n, precision=precision, clip_norm=0.5)
        frozen = expect.frozen_layouts(model, cfg)
        want_mem = expect.expected_memory(cfg, spec, n, frozen)
        # the frozen term by hand: every padded frozen buffer in the compute dtype, /N at 3
        padded = sum(lay.padded_numel(n) for _, lay in frozen)
        assert want_mem["frozen"] == padded * cb // (n if stage == 3 else 1)
        assert "lora" not in "".join(s.name for _, lay in frozen for s in lay.slots)
        names = [u for u, _ in expect.reference_units(model, cfg)]
        sim = World(
            {k: np.asarray(v) for k, v in state.master.items()},
            spec,
            StepConfig(precision=precision, micro_batches=4, world_size=n, clip_norm=0.5),
            stage=stage,
            mode="deterministic",
            frozen=[(name, lay, frozen_values) for name, lay in frozen],
        )
        zero_g = {k: np.zeros(v.shape, DTYPES[precision]) for k, v in state.master.items()}
        sim.step([zero_g] * 4)
        for rank, got in enumerate(per_rank):
            where = (precision, n, stage, rank)
            assert got["units"] == names, where
            assert got["memory"] == want_mem, where
            assert sim.resident_bytes(rank) == want_mem, where
            want = expect.expected_traffic(
                cfg, spec, n, rank, forward=True, frozen=frozen, names=names
            )
            assert got["traffic"] == want, where
            sent = sum(e for _, e, _ in got["traffic"].values())
            assert sim.traffic(rank) == (sent, sum(p for _, _, p in got["traffic"].values()))
    # stage 3 gathers the frozen buffers (forward, and backward but for the root), reduces none
    n, stage = 2, 3
    cfg = config(stage, n, 2, precision=precision)
    frozen = expect.frozen_layouts(model, cfg)
    plain = expect.expected_traffic(cfg, spec, n, 0, forward=True, names=names)
    extra = sum(
        (2 if name else 1) * 2 * (n - 1) * lay.shard_numel(n) for name, lay in frozen
    )  # k = 2 micro-steps
    gathers = {k: v for k, v in out[(n, stage)][0]["traffic"].items() if "all_gather" in k}
    plain_gathers = {k: v for k, v in plain.items() if "all_gather" in k}
    assert sum(v[1] for v in gathers.values()) == sum(v[1] for v in plain_gathers.values()) + extra
    rs = out[(n, stage)][0]["traffic"]["reduce_scatter:grad"]
    assert rs == plain["reduce_scatter:grad"]


# -- 2. against plain PyTorch: torch.optim over the trainable parameters, clip_grad_norm_ ---

U = 2.0**-24  # float32 unit roundoff
LR, WD, CLIP = 1e-3, 0.1, 0.01


def engine_one_step(rank, n, optimizer):
    """One step at stage 3 (M = 4, clipping active): the full master after it, and the norm."""
    torch.set_num_threads(1)
    model = lora_gpt()
    hp = Hyper(lr=LR, weight_decay=WD)
    cfg = config(3, n, 4 // n, optimizer=optimizer, groups=(hp,), clip_norm=CLIP)
    eng = ZeroEngine(model, cfg)
    bs = batches(0, 4)
    for j in range(rank, 4, n):
        eng.backward(eng(*bs[j])[1])
    norm = eng.step().norm
    master, _ = eng.gather_state()
    return {"master": {k: v.numpy() for k, v in master.items()}, "norm": norm}


def plain_step(optimizer, *, frozen_in_norm=False):
    """The plain model: micro-batch gradients summed in order, / M, clip_grad_norm_ over the
    trainable parameters (or, the old workaround, over every parameter), one torch.optim step
    (foreach=False) over the trainable parameters."""
    torch.set_num_threads(1)
    model = lora_gpt()
    if frozen_in_norm:
        for p in model.parameters():
            p.requires_grad_(True)
    named = dict(model.named_parameters())
    before = {k: p.detach().clone() for k, p in named.items()}
    grads, abs_sum = {}, {}
    for b in batches(0, 4):
        model.zero_grad(set_to_none=True)
        model(*b)[1].backward()
        for k, p in named.items():
            if p.grad is not None:
                grads[k] = grads.get(k, 0) + p.grad
                abs_sum[k] = abs_sum.get(k, 0) + p.grad.abs().double()
    for k in grads:
        named[k].grad = grads[k] / 4
    mean = {k: named[k].grad.clone() for k in grads}
    total = torch.nn.utils.clip_grad_norm_([named[k] for k in grads], CLIP)
    trainable = [p for k, p in named.items() if ".lora_" in k]
    kw = {"lr": LR, "weight_decay": WD}
    opt = torch.optim.AdamW(trainable, foreach=False, **kw)
    if optimizer == "sgd":
        opt = torch.optim.SGD(trainable, foreach=False, **kw)
    opt.step()
    return {
        "before": before,
        "after": {k: p.detach().clone() for k, p in named.items()},
        "grad": mean,
        "abs_sum": abs_sum,
        "norm": float(total),
        "numel": sum(g.numel() for g in grads.values()),
        "tensors": len(grads),
    }


def norm_bound(plain):
    """|engine norm - torch norm|: torch sums squares in float32 per tensor, then the norm of
    the norms: a relative error of at most γ_{P+T+2} (P elements, T tensors, + the squaring and
    the square roots), ρ below; the engine's float64 norm of its own mean gradient is exact to
    far below that. The two mean gradients differ by at most 2γ_{M-1}·Σ|g_j|/M elementwise
    (each sum of M terms within γ_{M-1}·Σ|g_j| of the exact one, /M exact), which moves the
    norm by at most the 2-norm of that difference."""
    k = plain["numel"] + plain["tensors"] + 2
    rho = k * U / (1 - k * U)
    gamma = 3 * U / (1 - 3 * U)
    delta = torch.sqrt(sum(((2 * gamma * a / 4) ** 2).sum() for a in plain["abs_sum"].values()))
    return rho, float(rho * plain["norm"] + delta)


def step_bound(plain, k, optimizer, engine_norm):
    """|engine p1 - torch p1| elementwise after one step from zero state with clipping.

    c = CLIP/(norm + 1e-6), each side's own; |c_e - c_t| <= c·(ρ_c) with ρ_c = (norm_bound's
    error)/norm + 2u (the division and its rounding on both sides). Each side's clipped gradient
    x = fl(c·ḡ) and the two differ by at most Δx = c·(2δ + (ρ_c + 2u)(|g| + 2δ)), δ = the mean's
    2γ_{M-1}Σ|g_j|/M as in tests/distributed/test_user_models.py's adamw_bound.
      SGD: p1 = p0(1 - lr·wd) - lr·x (torch: p0 - lr(x + wd·p0)): lr·Δx plus the roundings
          of both, 2·(3u·(|p0| + lr·|x|) + u·|p1|).
      AdamW: p1 = p0(1 - lr·wd) - lr·f(x), f(x) = x/(|x| + eps) after bias correction, f' =
          eps/(|x|+eps)²: lr·min(Δx·max f', 2) plus 2·(16u·lr + u·|p0| + u·(|p0| + lr)), the
          arithmetic term of adamw_bound."""
    g = plain["grad"][k].double().abs()
    p0 = plain["before"][k].double().abs()
    gamma = 3 * U / (1 - 3 * U)
    delta = 2 * gamma * plain["abs_sum"][k] / 4
    rho_c = norm_bound(plain)[1] / engine_norm + 4 * U
    c = CLIP / (engine_norm + 1e-6) * (1 + rho_c)
    dx = c * (2 * delta + (rho_c + 2 * U) * (g + 2 * delta))
    if optimizer == "sgd":
        p1 = p0 + LR * c * g
        return LR * dx + 2 * (3 * U * (p0 + LR * c * g) + U * p1)
    eps = 1e-8
    low = torch.clamp(c * g - dx, min=0)
    df = torch.clamp(dx * eps / (low + eps) ** 2, max=2.0)
    return LR * df + 2 * (16 * U * LR + U * p0 + U * (p0 + LR))


@pytest.mark.dist
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_one_clipped_step_matches_torch_optim_over_the_trainable_parameters(optimizer):
    plain = plain_step(optimizer)
    got = get_pool(2).run(engine_one_step, optimizer)[0]
    rho, nb = norm_bound(plain)
    assert abs(got["norm"] - plain["norm"]) <= nb, (got["norm"], plain["norm"], nb)
    assert CLIP < got["norm"]  # clipping is active
    names = sorted(got["master"])
    assert names == sorted(plain["grad"]) and all(".lora_" in k for k in names)
    worst = 0.0
    for k in names:
        diff = (torch.from_numpy(got["master"][k]).double() - plain["after"][k].double()).abs()
        bound = step_bound(plain, k, optimizer, got["norm"])
        assert bool((diff <= bound).all()), (optimizer, k, float((diff / bound).max()))
        worst = max(worst, float((diff / bound).max()))
    # not vacuous: the old workaround (frozen parameters trainable at lr=0, so in the norm)
    # clips by another coefficient, far outside the bounds
    wide = plain_step(optimizer, frozen_in_norm=True)
    assert wide["norm"] > plain["norm"] * (1 + 1000 * rho) + 1000 * nb, (wide["norm"], nb)
    if optimizer == "sgd":  # the update itself is proportional to the coefficient
        k = max(names, key=lambda k: float(plain["grad"][k].abs().max()))
        diff = (wide["after"][k].double() - plain["after"][k].double()).abs()
        assert bool((diff > 10 * step_bound(plain, k, optimizer, got["norm"])).any()), k


@pytest.mark.dist
def test_the_clipping_norm_leaves_frozen_parameters_out():
    """The engine's norm is torch's clip_grad_norm_ over the trainable parameters only, and
    differs from the one over every parameter (what training frozen parameters at lr=0 gave)
    by far more than the bound: the reason the lr=0 workaround clipped differently."""
    plain = plain_step("adamw")
    wide = plain_step("adamw", frozen_in_norm=True)
    per_n = {n: get_pool(n).run(engine_one_step, "adamw")[0]["norm"] for n in (1, 2)}
    assert per_n[1] == per_n[2]
    _, nb = norm_bound(plain)
    assert abs(per_n[2] - plain["norm"]) <= nb
    assert abs(per_n[2] - wide["norm"]) > 100 * nb, (per_n[2], wide["norm"], nb)
    print(f"norm: trainable {plain['norm']:.6g}, with the frozen part {wide['norm']:.6g}")


# -- 4. checkpoints: frozen values saved, restored at another N and stage, consolidated ------


@pytest.mark.dist
def test_checkpoint_resumes_bitwise_across_world_size_and_stage(tmp_path):
    """Save after step 1 at N = 2, stage 3 (bf16: the frozen buffers are bf16 on disk); load
    at N = 1 stage 0, N = 2 stage 1 and N = 4 stage 3 into engines whose frozen values were
    zeroed, run step 2: the reference's bits after two steps, frozen values restored."""
    ckpt = tmp_path / "ckpt"
    get_pool(2).run(run_engine, 3, 1, "bf16", 0.5, str(ckpt))
    spec, state, _, frozen = reference_run(precision="bf16")
    m = json.loads((checkpoint.format.resolve(ckpt) / "manifest.json").read_text())
    assert m["format_version"] == 2 and len(m["frozen_units"]) == GPT_CFG.n_layer + 1
    for n, stage in [(1, 0), (2, 1), (4, 3)]:
        for rank, got in enumerate(
            get_pool(n).run(run_engine, stage, 1, "bf16", 0.5, None, str(ckpt))
        ):
            where = (n, stage, rank)
            for name in spec.names:
                assert np.array_equal(got["master"][name], bits(state.master[name])), (where, name)
                for x, want in state.opt[name].items():
                    assert np.array_equal(got["opt"][name][x], bits(want)), (where, name, x)
            for name, want in frozen.items():
                assert np.array_equal(got["frozen"][name], bits(want)), (where, name)


@pytest.mark.dist
def test_consolidation_loads_into_the_plain_model_strictly(tmp_path):
    """The consolidated state dict holds every parameter (frozen ones upcast from bf16 to
    fp32) and loads into the plain LoRA model with strict=True; its optimizer state covers the
    trainable parameters alone and loads into torch.optim.AdamW over them."""
    ckpt = tmp_path / "ckpt"
    get_pool(2).run(run_engine, 3, 1, "bf16", 0.5, str(ckpt))
    spec, state, _, frozen = reference_run(steps=1, precision="bf16")
    sd = checkpoint.consolidate(ckpt)
    model = lora_gpt()
    model.load_state_dict(sd["model"], strict=True)
    named = dict(model.named_parameters())
    for name in spec.names:
        assert np.array_equal(bits(named[name].detach().numpy()), bits(state.master[name])), name
    for name, want in frozen.items():  # bf16 values, exactly representable in fp32
        got = named[name].detach()
        assert got.dtype == torch.float32
        assert np.array_equal(bits(got.numpy()), bits(np.asarray(want, np.float32))), name
    assert sd["param_names"] == [[n for n in named if named[n].requires_grad]]
    opt = torch.optim.AdamW([named[n] for n in sd["param_names"][0]])
    opt.load_state_dict(sd["optimizer"])
    assert len(sd["optimizer"]["state"]) == len(spec.names)
    for i, name in enumerate(sd["param_names"][0]):
        got = sd["optimizer"]["state"][i]["exp_avg_sq"].numpy()
        assert np.array_equal(bits(got), bits(state.opt[name]["exp_avg_sq"])), name


def refuse_mismatch(rank, n, ckpt):
    """Load a checkpoint with a frozen parameter into a model where it trains: refused."""
    model = lora_gpt()
    name = next(k for k, p in model.named_parameters() if not p.requires_grad)
    model.get_parameter(name).requires_grad_(True)
    eng = ZeroEngine(model, config(0, n, 2, precision="bf16"))
    try:
        eng.load(ckpt)
    except ValueError as e:
        return name, str(e)
    return name, ""


@pytest.mark.dist
def test_a_frozen_parameter_that_trains_now_is_refused_on_load(tmp_path):
    ckpt = tmp_path / "ckpt"
    get_pool(2).run(run_engine, 3, 1, "bf16", 0.5, str(ckpt))
    name, msg = get_pool(2).run(refuse_mismatch, str(ckpt))[0]
    assert repr(name) in msg and "requires_grad=True" in msg and "frozen" in msg, msg


# -- LoRA itself: the first forward is the base model's; Hugging Face GPT-2 -----------------


def test_lora_starts_as_the_base_model_and_freezes_it():
    base = GPT(GPT_CFG, seed=SEED)
    model = GPT(GPT_CFG, seed=SEED)
    names = add_lora(model, 4, seed=SEED)
    assert "lm_head" not in names and len(names) == 4 * GPT_CFG.n_layer  # tied head left alone
    idx, _ = batches(0, 1)[0]
    with torch.no_grad():
        assert torch.equal(base(idx)[0], model(idx)[0])  # B = 0: the delta adds exact zeros
    trains = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trains and all(n.endswith(("lora_a", "lora_b")) for n in trains)
    with pytest.raises(ValueError, match="rank=0"):
        add_lora(GPT(GPT_CFG), 0)


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def hf_lora_run(rank, n, stage):
    """Hugging Face GPT-2 from a config, LoRA on its Conv1D layers, wrapped unchanged."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        )  # fmt: skip
        model = GPT2LMHeadModel(cfg)
        add_lora(model, 2, seed=0)
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.data.normal_(0, 0.02)
    eng = ZeroEngine(model, ZeroConfig(stage=stage, micro_batches=4, chunk=128, units="auto"))
    before = frozen_bits(eng)
    for step in range(2):
        bs = batches(step, 4)
        for j in range(rank, 4, n):
            eng.backward(eng(input_ids=bs[j][0], labels=bs[j][0]).loss)
        eng.step()
    master, _ = eng.gather_state()
    return {
        "master": {k: f32bits(v) for k, v in master.items()},
        "same": all(np.array_equal(v, frozen_bits(eng)[k]) for k, v in before.items()),
        "frozen": len(before),
    }


@pytest.mark.dist
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_hugging_face_gpt2_with_lora_every_stage_the_same_bits():
    ref = get_pool(1).run(hf_lora_run, 0)[0]
    assert ref["same"] and ref["frozen"] > 0
    assert ref["master"] and all(".lora_" in k for k in ref["master"])
    for stage in (0, 3):
        for got in get_pool(2).run(hf_lora_run, stage):
            assert got["same"], stage
            for k, v in ref["master"].items():
                assert np.array_equal(got["master"][k], v), (stage, k)


# -- the measurement: a simulated rank of a large world, engine = analytic model -------------


@pytest.mark.dist
def test_lora_memory_at_stage_3_on_a_simulated_rank_equals_the_analytic_model():
    """measure/lora_memory.py at N = 64 (one rank of a fake world, the GPT built on meta): the
    engine's bytes equal zero.common.memory's model over the same padding exactly, frozen = 2Ψ_f/N
    plus padding, and the trainable part is (2 + 2 + 12)Ψ_t/N."""
    from measure.lora_memory import measure

    (rec,) = measure([64], chunk=128)
    assert rec["frozen_fraction"] > 0.98
    exact = {k: int(v) for k, v in rec["analytic_with_padding"].items()}
    assert rec["engine"] == exact
    psi_t, n = rec["psi_trainable"], 64
    assert (exact["params"], exact["grads"]) == (2 * psi_t // n, 2 * psi_t // n)
    assert exact["master"] + exact["optimizer"] == 12 * psi_t // n
    assert 2 * rec["psi_frozen"] / n <= exact["frozen"] <= 2 * rec["psi_frozen"] / n * 1.01


# -- ZeRO-R options with frozen parts ------------------------------------------------------


@pytest.mark.dist
@pytest.mark.parametrize(
    "options",
    [
        (("activation_checkpointing", True),),
        (("activation_checkpointing", True), ("offload_activations", True)),
        (("offload_optimizer", True), ("contiguous_memory", True)),
        (("bucket_elements", 512), ("overlap", False)),
        (("persist_below", 10**6),),
    ],
    ids=["checkpointing", "offload_activations", "offload_contiguous", "buckets", "persistent"],
)
def test_zero_r_options_keep_the_references_bits(options):
    spec, state, norms, frozen = reference_run()
    for got in get_pool(2).run(run_engine, 3, 2, "fp32", 0.5, None, None, options):
        assert got["norms"] == norms, options
        for name in spec.names:
            assert np.array_equal(got["master"][name], bits(state.master[name])), (options, name)
        for name, want in frozen.items():
            assert np.array_equal(got["frozen"][name], bits(want)), (options, name)
