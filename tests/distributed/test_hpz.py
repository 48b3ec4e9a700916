"""ZeRO++'s hpZ at stage 3 (ZeroConfig.hpz, zero/stages/hpz.py) on real gloo ranks simulated as
nodes (ZeroConfig.ranks_per_node): the same bits as plain stage 3, the backward all-gather's
bytes all inside the node and equal to the volume derived here by hand, the secondary parts'
memory, and the refusals.

Legend: N ranks, R per node, k = M/N micro-steps, C = 128-element chunks; the MLP 16 -> 48 ->
48 -> 4 of engine_tools.mlp_engine: layers.0 and layers.1 are units of 7 and 19 chunks
(test_node_traffic.py derives them), layers.2 the root (3 chunks: gathered from its forward to
the end of backward, so never gathered for backward, with or without hpZ). A unit is padded to
N·L_u with L_u = ceil(chunks / N)·C; a secondary part is N·L_u/R.
"""

from __future__ import annotations

import math

import pytest
from engine_tools import mlp_engine, on_half_the_world, one_step

from verify.checks.sides import state_digest
from zero.config import ZeroConfig
from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(600)

K, STEPS = 2, 3
ROOT, CHUNKS = 3, (7, 19)  # the root's and the units' 128-element chunks
BYTES = {"fp32": 4, "bf16": 2}


SLOTS = (((0, 768), (768, 48)), ((0, 2304), (2304, 48)))  # (offset, numel): weight, bias


def part_padding(n: int, per_node: int, j: int) -> int:
    """Padding elements one backward gather of every unit sends from node rank j: its part's
    elements outside every parameter, to R - 1 ranks."""
    out = 0
    for pad, slots in zip(padded(n), SLOTS, strict=True):
        lo, hi = j * pad // per_node, (j + 1) * pad // per_node
        real = sum(max(0, min(o + k, hi) - max(o, lo)) for o, k in slots)
        out += (per_node - 1) * (hi - lo - real)
    return out


def padded(n: int) -> list[int]:
    """Each unit's padded length N·L_u at world size n (the root's apart)."""
    return [n * math.ceil(c / n) * 128 for c in CHUNKS]


def train(rank, n, per_node, precision, hpz, stale=False):
    """STEPS stage-3 steps; the state digest, the backward all-gathers' (intra, inter) bytes and
    (calls, elements) of every step, and memory_report. stale: the secondary parts copied at
    the first forward only (a planted bug: the digest must see it)."""
    from engine_tools import patched

    from zero.stages import hpz as hpz_module

    real = hpz_module.HpZ.keep

    def keep_once(self, u):
        if not getattr(u, "kept", False):
            real(self, u)
            u.kept = True
        u.hpz_fresh = True

    with patched(hpz_module.HpZ, **({"keep": keep_once} if stale else {})):
        model, eng = mlp_engine(3, n, K, precision=precision, ranks_per_node=per_node, hpz=hpz)
        links, sent = [], []
        for step in range(STEPS):
            result = one_step(eng, model, rank, n, K, step)
            bwd = [r for r in eng.counter.of_step(step) if r.phase == "param_bwd"]
            links.append((sum(r.intra_bytes for r in bwd), sum(r.inter_bytes for r in bwd)))
            sent.append((len(bwd), sum(r.elements for r in bwd), sum(r.padding for r in bwd)))
        return {
            "digest": state_digest(eng, result),
            "links": links,
            "sent": sent,
            "memory": eng.memory_report(),
        }


@pytest.mark.dist
@pytest.mark.parametrize("n, per_node", [(4, 2), (8, 4)])
def test_hpz_is_bitwise_plain_stage3_and_keeps_backward_gathers_inside_the_node(n, per_node):
    """bf16 and fp32, deterministic, 3 steps of M = 2N: the digests of every rank agree with and
    without hpZ. The backward all-gathers send, per step and rank, k·Σ_u (R-1)·N·L_u/R elements,
    none across nodes (without hpZ: k·Σ_u (N-1)·L_u, crossing from each node's last rank)."""
    pool = get_pool(n)
    for precision in ("bf16", "fp32"):
        plain = pool.run(train, per_node, precision, False)
        ours = pool.run(train, per_node, precision, True)
        assert [r["digest"] for r in ours] == [r["digest"] for r in plain]
        assert len({r["digest"] for r in ours}) == 1
        parts = [p // per_node for p in padded(n)]
        elements = K * sum((per_node - 1) * p for p in parts)
        want = elements * BYTES[precision]
        assert (n, per_node, elements) in ((4, 2, 3584), (8, 4, 6144))  # by hand, see above
        assert [part_padding(n, per_node, j) for j in range(per_node)] in (
            [0, 416],
            [0, 0, 0, 2784],
        )
        for rank, r in enumerate(ours):
            assert r["links"] == [(want, 0)] * STEPS, rank
            pad = K * part_padding(n, per_node, rank % per_node)
            assert r["sent"] == [(K * len(CHUNKS), elements, pad)] * STEPS
            assert r["memory"]["hpz"] == sum(parts) * BYTES[precision]  # the root keeps none
            assert "hpz" not in plain[rank]["memory"]
            mem = {k: v for k, v in r["memory"].items() if k not in ("hpz", "comm_buffers")}
            assert mem == {k: v for k, v in plain[rank]["memory"].items() if k != "comm_buffers"}
        world = K * sum((n - 1) * p // n for p in padded(n)) * BYTES[precision]
        last = [rank % per_node == per_node - 1 for rank in range(n)]
        assert [r["links"][0] for r in plain] == [(0, world) if x else (world, 0) for x in last]


@pytest.mark.dist
def test_a_stale_secondary_part_changes_the_bits():
    """The planted bug the digest comparison exists for: parts not refreshed after an update."""
    pool = get_pool(4)
    plain = pool.run(train, 2, "fp32", False)
    stale = pool.run(train, 2, "fp32", True, True)
    assert [r["digest"] for r in stale] != [r["digest"] for r in plain]


@pytest.mark.dist
def test_hpz_over_a_subgroup_is_refused_by_name():
    got = get_pool(4).run(on_half_the_world, {"hpz": True})
    for msg in got:
        assert msg.startswith("hpz=True: the engine's group has 2 of the world's 4 ranks"), msg


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_hpz_without_stage_3_is_refused_by_name(stage):
    with pytest.raises(ValueError, match=rf"^hpz=True: .* allowed with stage=3 \(stage={stage}"):
        ZeroConfig(stage=stage, hpz=True)


def test_hpz_must_be_a_bool():
    with pytest.raises(ValueError, match=r"^hpz=1: must be True or False$"):
        ZeroConfig(stage=3, hpz=1)
