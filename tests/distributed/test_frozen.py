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

from reference import ModelSpec
from reference.precision import cast
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


def run_engine(rank, n, stage, steps=2, precision="fp32", clip_norm=0.5, k=2):
    """`steps` steps of the LoRA GPT; returns the full master, moments and frozen values."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = lora_gpt()
    cfg = config(stage, n, k, precision=precision, clip_norm=clip_norm)
    eng = ZeroEngine(model, cfg)
    frozen0 = {}
    with eng.gathered_params():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                frozen0[name] = f32bits(p)
    norms = []
    for step in range(steps):
        bs = batches(step, cfg.micro_batches)
        for j in range(rank, cfg.micro_batches, n):
            eng.backward(eng(*bs[j])[1])
        norms.append(eng.step().norm)
    master, opt = eng.gather_state()
    frozen = {}
    with eng.gathered_params():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                frozen[name] = f32bits(p)
    return {
        "master": {k: f32bits(v) for k, v in master.items()},
        "opt": {k: {x: f32bits(t) for x, t in v.items()} for k, v in opt.items()},
        "frozen0": frozen0,
        "frozen": frozen,
        "norms": norms,
        "memory": eng.memory_report(),
        "traffic": expect.traffic_of_step(eng.counter, 1),
    }


def reference_run(steps=2, precision="fp32", clip_norm=0.5, m=4):
    """The reference: trainable spec only, micro-batch gradients in one process."""
    torch.set_num_threads(1)
    model = lora_gpt()
    cfg = config(0, 1, m)
    units = [[(n, s) for n, s in ps] for _, ps in expect.reference_units(model, cfg)]
    spec = ModelSpec.build(units, chunk=cfg.chunk)
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
            grads.append({n: p.grad.float().numpy().copy() for n, p in model.named_parameters()
                          if p.requires_grad})  # fmt: skip
        grads = [{n: cast(g[n], precision) for n in spec.names} for g in grads]
        state, info = train_step(state, grads, spec, rcfg)
        norms.append(float(info.norm))
    return spec, state, norms, frozen


@pytest.mark.dist
def test_smoke():
    for stage in range(4):
        got = get_pool(2).run(run_engine, stage)
        print(stage, got[0]["norms"], got[0]["memory"])
