"""Frozen parameters (requires_grad=False): docs/design.md §2 "Which parameters train", §3.

A LoRA model (zero/lora.py: the project's GPT, every parameter frozen, low-rank adapters on its
linears) trains at stages 0-3 and N = 1, 2, 4 to the reference's bits, where the reference's
spec holds the trainable parameters alone and its micro-batch gradients are computed in one
process on the working copy (the frozen values in the compute dtype); the frozen values never
change. Against plain torch.optim.AdamW over the trainable parameters: one step with clipping
within a derived bound, and the clipping norm leaves the frozen parameters out. memory_report
and the traffic counter equal verify/expect.py's expectations (built from the model and config
alone) exactly; checkpoints restore frozen values across N and stage and consolidate them.
"""

import numpy as np
import pytest
import torch

from reference.precision import DTYPES, cast
from reference.simulate import World
from reference.step import StepConfig, init_state, train_step, working_copy
from verify import expect
from zero.config import ZeroConfig
from zero.engine import ZeroEngine, backward_scaled, cast_inputs
from zero.launch import get_pool
from zero.lora import add_lora
from zero.models import GPT, GPTConfig, gpt_microbatches

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


def run_engine(rank, n, stage, steps=2, precision="fp32", clip_norm=0.5, save=None, load=None):
    """`steps` steps of the LoRA GPT at M = 4 (from a checkpoint `load`, then saved to `save`);
    returns the full master, moments, frozen values, norms, memory and step 1's traffic."""
    torch.set_num_threads(1)
    model = lora_gpt()
    cfg = config(stage, n, 4 // n, precision=precision, clip_norm=clip_norm)
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
            backward_scaled(model(*cast_inputs(b, dtype))[1], None)
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
            assert sorted(got["frozen"]) == sorted(frozen), where
            for name, want in frozen.items():  # the start value rounded once, never updated
                assert np.array_equal(got["frozen"][name], bits(want)), (where, name)
                assert np.array_equal(got["frozen0"][name], got["frozen"][name]), (where, name)
    # not vacuous: the adapters moved, and the trunk would have had gradients
    master0 = out[(1, 0)][0]["master"]
    start = {n: bits(p.detach().numpy()) for n, p in lora_gpt().named_parameters()}
    assert all(not np.array_equal(master0[n], start[n]) for n in spec.names)


# -- 3. resident bytes and traffic: exactly what verify/expect.py builds from the model ------


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
