"""ZeRO++ over a subgroup (model parallelism's data-parallel group, or any group smaller than the
world) is refused by name at construction: hpZ's node parts, qgZ's hops and qwZ's gathers are
built and verified over the world's nodes only (zero/stages/hpz.py, zero/stages/stage3.py)."""

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
