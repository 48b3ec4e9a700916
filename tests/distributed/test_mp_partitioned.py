"""P_a: activation checkpoints partitioned over the model-parallel group (zero/mp/partitioned.py).

On 2 gloo ranks (N_m = 2) the tensor-parallel GPT runs one forward and backward four ways: no
checkpointing, checkpointing per block, and checkpointing with P_a (on the device and with
P_a+cpu). The loss and every gradient must have the same bits in all four: the gather returns
exactly the bits that were cut. Traffic and kept bytes are then exact: one all-gather of
(N-1)·⌈X/N⌉ elements per block (X = b·s·h), ⌈X/N⌉ elements kept per block instead of X, and
P_a's share of the blocks' MP traffic is 1/(5·N) (deterministic sums; 1/10 with the ring's
all-reduce), beside the paper's "less than 10%" (§7), which counts a full recomputation.
"""

import functools

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(300)

CFG = dict(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=32)
BATCH = 3


def one_pass(rank, world, how):
    from zero.collectives import CommCounter
    from zero.mp import TPGPT, Mesh, MPContext
    from zero.mp.partitioned import PartitionedCheckpoints
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    groups = Mesh(dp=1, mp=world).groups()
    cfg = GPTConfig(**CFG)
    counter = CommCounter(keep_steps=None)
    mp = MPContext.of(groups.mp_group, counter=counter)
    model = TPGPT.from_gpt(GPT(cfg, seed=0), mp)
    kept = []

    def count(t):  # what the outer hook keeps: the checkpoints (or their parts)
        kept.append(t.numel())
        return t

    for i, block in enumerate(model.transformer.h):
        if how == "plain":
            continue
        inner = block.forward
        hooks = functools.partial(saved_tensors_hooks, count, lambda t: t)
        if how in ("p_a", "p_a_cpu"):
            hooks = functools.partial(PartitionedCheckpoints, mp, i, offload=how == "p_a_cpu")

        def run(x, inner=inner, hooks=hooks):
            with hooks():
                return checkpoint(inner, x, use_reentrant=False)

        block.forward = run
    idx, tgt = gpt_microbatches(cfg, seed=1, data_step=0, count=1, batch_size=BATCH)[0]
    _, loss = model(idx, tgt)
    loss.backward()
    bits = {n: p.grad.view(torch.int32).clone() for n, p in model.named_parameters()}
    traffic = {}
    for rec in counter.records:
        key = (rec.kind, rec.op, rec.phase)
        calls, elements, padding = traffic.get(key, (0, 0, 0))
        traffic[key] = (calls + 1, elements + rec.elements, padding + rec.padding)
    return loss.detach().view(torch.int32).item(), bits, traffic, kept


@pytest.mark.dist
def test_p_a_changes_no_bit_and_costs_what_the_table_says():
    pool = get_pool(2)
    runs = {how: pool.run(one_pass, how) for how in ("plain", "ckpt", "p_a", "p_a_cpu")}
    n, layers = 2, CFG["n_layer"]
    x = BATCH * CFG["block_size"] * CFG["n_embd"]  # one block's checkpoint, b·s·h
    part = -(-x // n)
    for rank in range(n):
        base_loss, base_bits = runs["plain"][rank][:2]
        for how in ("ckpt", "p_a", "p_a_cpu"):
            loss, bits = runs[how][rank][:2]
            assert loss == base_loss, (how, rank)
            assert all(torch.equal(bits[k], base_bits[k]) for k in base_bits), (how, rank)
        # traffic: P_a adds exactly one all-gather per block, and P_a+cpu the host copies
        ckpt, p_a, cpu = (runs[h][rank][2] for h in ("ckpt", "p_a", "p_a_cpu"))
        extra = {k: v for k, v in p_a.items() if k not in ckpt}
        pad = (n - 1) * (part - min(part, x - rank * part))
        assert extra == {
            ("mp", "all_gather", "p_a"): (layers, layers * (n - 1) * part, layers * pad)
        }
        assert {k: v for k, v in p_a.items() if k in ckpt} == ckpt
        assert cpu[("offload", "d2h", "p_a_down")] == (layers, layers * part, 0)
        assert cpu[("offload", "h2d", "p_a_up")] == (layers, layers * part, 0)
        # P_a's share of MP traffic. A block's MP sums: 2 in forward, 2 f's in backward, and in
        # the recomputation 1, not 2: torch's non-reentrant checkpoint stops recomputing once
        # every tensor backward needs is back, before the MLP branch's sum. Each sum sends
        # (N-1)·X in deterministic mode (gather-based, docs/design.md §6); the head's f adds 1.
        sums = sum(
            v[1] for (k, _, ph), v in ckpt.items() if k == "mp" and ph in ("mp_fwd", "mp_bwd")
        )
        assert sums == (5 * layers + 1) * (n - 1) * x
        gathered = extra[("mp", "all_gather", "p_a")][1]
        assert gathered * 5 * n == layers * 5 * (n - 1) * x  # 1/(5N) of the blocks' sums
        # kept bytes: X per block with plain checkpointing, ⌈X/N⌉ with P_a (the hook's parts)
        assert runs["ckpt"][rank][3] == [x] * layers
