"""Communication volume counted on real gloo ranks equals the theory exactly (docs/design.md §2).

The expected volumes are written here again from docs/design.md §2's table, independently of
paper_figures.comm_volume, whose worker (one training step of a small GPT, counted by
engine.counter) is what runs on the ranks.

Legend: Ψ parameters (elements), N ranks, M micro-batches per step, k = M/N, L a unit's shard
length (padded), "root" the unit of embeddings, final norm and tied head.
"""

import pytest

from paper_figures.comm_volume import traffic_of
from zero.ranks.local import get_pool

pytestmark = pytest.mark.timeout(900)

# docs/design.md §2, per rank per step in units of Ψ·(N-1)/N: (stage, deterministic) -> f(k)
TABLE = {
    (0, True): lambda k: k + 1,
    (1, True): lambda k: k + 1,
    (2, True): lambda k: k + 1,
    (3, True): lambda k: 3 * k,
    (0, False): lambda k: 2,
    (1, False): lambda k: 2,
    (2, False): lambda k: k + 1,
    (3, False): lambda k: 3 * k,
}


def check_volume(n, stage, deterministic, k):
    ranks = get_pool(n).run(traffic_of, stage, deterministic, k, timeout_s=600)
    f = TABLE[(stage, deterministic)](k)
    # Stage 3's root stays gathered from its forward to the end of backward: one all-gather
    # per micro-step instead of two, so k·Ψ_root·(N-1)/N less than 3kΨ.
    save = k if stage == 3 else 0
    r0 = ranks[0]
    per_rank = (n - 1) * (f * r0["shard_sum"] - save * r0["root_shard_sum"])
    for r in ranks:
        assert r["elements"] == per_rank
        assert r["bytes"] == 2 * per_rank  # bf16 working copy and reduction
    payload = sum(r["elements"] - r["padding"] for r in ranks)
    assert payload == (n - 1) * (f * r0["num_params"] - save * r0["root_params"])
    return ranks


CASES = [(stage, det, k) for stage in range(4) for det in (True, False) for k in (1, 4)]


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(("stage", "deterministic", "k"), CASES)
def test_counted_volume_equals_the_theory(n, stage, deterministic, k):
    check_volume(n, stage, deterministic, k)


@pytest.mark.dist
@pytest.mark.full
@pytest.mark.parametrize(("stage", "deterministic", "k"), CASES)
def test_counted_volume_equals_the_theory_at_8(stage, deterministic, k):
    check_volume(8, stage, deterministic, k)


@pytest.mark.dist
def test_per_collective_at_m_equals_n():
    """The paper's decomposition at M = N (§7): baseline DP is a reduce-scatter plus an
    all-gather (Ψ each; fast mode: one all-reduce of 2Ψ), and P_os+g+p adds a second parameter
    all-gather: forward Ψ, backward Ψ - Ψ_root, gradients Ψ."""
    n = 4

    def by_op(ranks):
        out = {}
        for key, d in ranks[0]["collectives"].items():
            out[key] = d["elements"]
        return out

    r = check_volume(n, 0, True, 1)[0]
    psi = (n - 1) * r["shard_sum"]
    assert sum(v for k, v in by_op([r]).items() if k.startswith("reduce_scatter")) == psi
    assert sum(v for k, v in by_op([r]).items() if k.startswith("all_gather")) == psi
    r = check_volume(n, 0, False, 1)[0]
    assert by_op([r]) == {"all_reduce:grad": 2 * psi}
    r = check_volume(n, 3, True, 1)[0]
    ops = by_op([r])
    root = (n - 1) * r["root_shard_sum"]
    assert ops["all_gather:param_fwd"] == psi
    assert ops["all_gather:param_bwd"] == psi - root
    assert ops["reduce_scatter:grad"] == psi
