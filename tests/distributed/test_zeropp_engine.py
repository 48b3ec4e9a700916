"""ZeRO++ in the engine beyond verify's cells: qwZ's values do not depend on N ([Note: qwZ's
values], reference/zeropp.py), so a qwZ run gives the same bits at N = 1, 2 and 4; and ZeRO++ over
a subgroup (model parallelism's data-parallel group, or any group smaller than the world) is
refused by name at construction: hpZ's node parts, qgZ's hops and qwZ's gathers are built and
verified over the world's nodes only (zero/stages/hpz.py, zero/stages/stage3.py)."""

from __future__ import annotations

import pytest

from zero.ranks.local import spawn


def build_on_own_group(rank, n, fields):
    import torch.distributed as dist

    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.workloads.models import MLP, MLPConfig

    groups = [dist.new_group([r]) for r in range(n)]  # every rank creates every group
    model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3))
    cfg = ZeroConfig(stage=3, chunk=128, units=tuple(model.unit_names()), **fields)
    try:
        ZeroEngine(model, cfg, group=groups[rank])
    except ValueError as exc:
        return str(exc)
    return "built"


@pytest.mark.dist
@pytest.mark.parametrize(
    "fields, says",
    [
        ({"hpz": True}, "hpz=True: the engine's group has 1 of the world's 2 ranks"),
        (
            {"qgz_bits": 4, "quant_block": 64},
            "qgz_bits=4: the engine's group has 1 of the world's 2",
        ),
        (
            {"qwz_bits": 8, "quant_block": 64},
            "qwz_bits=8: the engine's group has 1 of the world's 2",
        ),
    ],
)
def test_zeropp_over_a_subgroup_is_refused_by_name(fields, says):
    said = spawn(build_on_own_group, 2, fields, timeout_s=120)
    assert all(says in text for text in said), said


def qwz_digest(rank, n, bits):
    """Three steps of stage 3 with qwZ at M = 4 (the same micro-batches at every N): the state's
    digest (verify.checks.sides.state_digest: master, states, working copy, t, scale, norm)."""
    from tests.helpers.engine_tools import mlp_engine
    from verify.checks.sides import state_digest
    from zero.loop import train_steps
    from zero.workloads.models import mlp_microbatches

    model, eng = mlp_engine(3, n, 4 // n, qwz_bits=bits, quant_block=64)
    data = lambda step, j: mlp_microbatches(
        model.cfg, seed=0, data_step=step, count=4, batch_size=4
    )[j]  # noqa: E731
    results = train_steps(eng, data, 3)
    return state_digest(eng, results[-1])


@pytest.mark.dist
def test_qwz_gives_the_same_bits_at_every_world_size():
    """int4 (int8 takes the same path with another grid)."""
    digests = {n: set(spawn(qwz_digest, n, 4, timeout_s=120)) for n in (1, 2, 4)}
    assert all(len(d) == 1 for d in digests.values()), digests  # every rank agrees
    assert digests[1] == digests[2] == digests[4], digests
    plain = set(spawn(qwz_digest, 2, None, timeout_s=120))
    assert plain != digests[2]  # it did quantize
