"""Around the model's forward (zero/hooks.py): floating keyword inputs are cast to the compute
dtype like positional ones, and each micro-batch's randomness (dropout) is seeded from
(dropout_seed, data step, micro-batch index), so a model with dropout has the same bits at every
world size and stage, and those of the single-process reference side."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from reference import ModelSpec, init_state, train_step, working_copy
from verify.cells.cell import GROUPS
from verify.checks.harness import microbatch_loss_and_grads
from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine
from zero.hooks import forward_rng
from zero.loop import train_steps
from zero.ranks.local import get_pool
from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

pytestmark = pytest.mark.timeout(600)


class KwNet(nn.Module):
    """Token ids positional, float features and targets and an integer mask as keywords."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.seen: set[tuple] = set()

    def forward(self, ids, *, feats, y, mask):
        self.seen.add((ids.dtype, feats.dtype, y.dtype, mask.dtype))
        h = self.emb(ids) + self.proj(feats)  # a float32 feats fails against bf16 weights
        out = self.head(torch.tanh(h * mask.unsqueeze(-1))).squeeze(-1).mean(1)
        return out, ((out.float() - y.float()) ** 2).mean()


def kw_batches(step, count):
    out = []
    for j in range(count):
        g = torch.Generator().manual_seed(100 * step + j)
        out.append(
            {
                "ids": torch.randint(0, 16, (3, 5), generator=g),
                "feats": torch.randn(3, 5, 8, generator=g),
                "y": torch.randn(3, generator=g),
                "mask": torch.randint(0, 2, (3, 5), generator=g),
            }
        )
    return out


GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def make(kind, dropout):
    if kind == "kw":
        return KwNet(), ("proj",)
    model = GPT(dataclasses.replace(GPT_CFG, dropout=dropout))
    return model, tuple(model.unit_names())


def data(kind, step, count):
    if kind == "kw":
        return kw_batches(step, count)
    return gpt_microbatches(GPT_CFG, seed=0, data_step=step, count=count, batch_size=2)


def train(rank, n, kind, stage, precision, dropout=0.0, reference=True, steps=2):
    """Train the engine `steps` steps; beside it (reference=True) the NumPy reference step on
    gradients of a plain copy of the model, computed through the engine's input cast and with
    the micro-batch's seeded RNG. Rank 0 returns both masters' bits and the input dtypes."""
    torch.set_num_threads(1)
    model, units = make(kind, dropout)
    ref_model, _ = make(kind, dropout)
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    zcfg = ZeroConfig(
        stage=stage,
        precision=precision,
        optimizer="adamw",
        groups=GROUPS["adamw"],
        group_of=decay_matrices_only,
        micro_batches=4,
        units=units,
        chunk=128,
    )
    eng = ZeroEngine(model, zcfg)
    spec = ModelSpec.build(eng.unit_specs(), eng.group_index, chunk=zcfg.chunk)
    rcfg = zcfg.step_config(n)
    ref = init_state(init, spec, rcfg)
    for step in range(steps):
        batches = data(kind, step, 4)
        if reference:
            work = working_copy(ref, rcfg)
            grads = [
                microbatch_loss_and_grads(
                    ref_model,
                    work,
                    b,
                    zcfg.compute_dtype,
                    None,
                    forward_rng(zcfg.dropout_seed, step, j, "cpu"),
                )[1]
                for j, b in enumerate(batches)
            ]
            ref, _ = train_step(ref, grads, spec, rcfg)
        train_steps(eng, lambda s, j, b=batches: b[j], 1, start_step=step)
    master, _ = eng.gather_state()
    if rank:
        return None
    ours = {k: v.numpy().view(np.uint32) for k, v in master.items()}
    theirs = {k: np.asarray(v, np.float32).view(np.uint32) for k, v in ref.master.items()}
    return ours, theirs if reference else None, getattr(model, "seen", None)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])
def test_float_keyword_inputs_are_cast_and_match_the_reference(stage):
    """bf16: `feats` and `y` (float keywords) reach the model in bf16, ids and the integer mask
    as given, and the engine's master after two steps equals the reference side's bit for bit
    (without the cast the bf16 model fails: float32 features against bf16 weights)."""
    ours, theirs, seen = get_pool(2).run(train, "kw", stage, "bf16")[0]
    assert seen == {(torch.int64, torch.bfloat16, torch.bfloat16, torch.int64)}
    assert same(ours, theirs)


@pytest.mark.dist
def test_dropout_gives_the_same_bits_at_every_world_size_and_stage():
    """GPT with dropout 0.2 in deterministic mode: the final masters at N = 1 (stage 0) and
    N = 2 (stages 1 and 3) are identical, and equal the reference side run with the same seeded
    RNG; dropout 0 gives other bits, so the dropout really drew."""
    one, ref1, _ = get_pool(1).run(train, "gpt", 0, "fp32", 0.2)[0]
    assert same(one, ref1)
    for stage in (1, 3):
        two, ref2, _ = get_pool(2).run(train, "gpt", stage, "fp32", 0.2, False)[0]
        assert same(one, two), stage
    off, _, _ = get_pool(1).run(train, "gpt", 0, "fp32", 0.0, False)[0]
    assert not same(one, off)


def rng_untouched(rank, n):
    """The caller's own RNG stream is where it was after a forward and backward."""
    del rank
    model, units = make("gpt", 0.2)
    eng = ZeroEngine(model, ZeroConfig(micro_batches=n, units=units, chunk=128))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    idx, targets = data("gpt", 0, 1)[0]
    eng.backward(eng(idx, targets)[1])
    return torch.equal(before, torch.get_rng_state())


@pytest.mark.dist
def test_the_seeded_forward_leaves_the_callers_rng_alone():
    assert all(get_pool(2).run(rng_untouched))
