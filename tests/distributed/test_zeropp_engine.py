"""ZeRO++ in the engine beyond verify's cells: qwZ's values do not depend on N ([Note: qwZ's
values], reference/zeropp.py), so a qwZ run gives the same bits at N = 1, 2 and 4; and ZeRO++ over
a subgroup (model parallelism's data-parallel group, or any group smaller than the world) is
refused by name at construction: qgZ's hops and qwZ's gathers are built and verified over the
world's nodes only (zero/stages/zeropp.py; hpZ's refusal is tests/distributed/test_hpz.py's)."""

from __future__ import annotations

import pytest
from engine_tools import on_half_the_world

from zero.ranks.local import get_pool, spawn


@pytest.mark.dist
@pytest.mark.parametrize(
    "fields, says",
    [
        (
            {"qgz_bits": 4, "quant_block": 64},
            "qgz_bits=4: the engine's group has 2 of the world's 4",
        ),
        (
            {"qwz_bits": 8, "quant_block": 64},
            "qwz_bits=8: the engine's group has 2 of the world's 4",
        ),
    ],
)
def test_zeropp_over_a_subgroup_is_refused_by_name(fields, says):
    said = get_pool(4).run(on_half_the_world, fields)
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
