"""notebooks/teaching/ on real gloo ranks: the measurements behind the teaching notebooks
(02_zero_from_scratch and 04_claims_vs_measurements) must agree with the NumPy simulation, with
the reference's bits, and with the volumes of docs/design.md §2. The one-process tests of
notebooks/teaching/ are in tests/unit/test_teaching.py.
"""

import matplotlib
import pytest

from notebooks import teaching
from notebooks.teaching import CATEGORIES, Job, bytes_by_rank

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# -- real ranks --------------------------------------------------------------------------------


@pytest.mark.dist
def test_gloo_runs_match_the_simulation_and_the_reference():
    """zero/ on 2 gloo ranks, stages 0-3, deterministic, 2 steps: every rank's master is the
    reference's bits; its traffic is the simulation's exactly (stage 3: less one root all-gather
    per micro-step); its memory_report is the simulation's per category, and the blocks drawn
    from its buffers add up to it. Then a traced stage-2 step: the gradient is whole before the
    step's control exchange, and each rank computes the whole model's FLOPs."""
    jobs = [Job(stage=s, steps=2, reference_grads=True) for s in range(4)]
    jobs.append(Job(stage=2, steps=2, trace=True))
    *by_stage, traced = teaching.run_on_gloo(jobs, 2)
    for runs in by_stage:
        check = teaching.check_engine_against_simulation(runs)
        assert check.ok, check
        assert check.root_saving[0] == (runs[0].shards[0] if runs[0].stage == 3 else 0)
        for run in runs:
            held = {c: run.memory[c] for c in CATEGORIES}
            assert bytes_by_rank(run.blocks) == {run.rank: held}
        factors = teaching.volume_factors(runs[0])
        if runs[0].stage == 3:
            assert factors == {"root": 2.0, "transformer.h.0": 3.0, "transformer.h.1": 3.0}
        else:
            assert set(factors.values()) == {2.0}
    checks = [teaching.check_engine_against_simulation(r) for r in by_stage]
    assert "**NO**" not in teaching.format_engine_checks(checks)
    memory_ax, traffic_ax = teaching.draw_engine_vs_simulation(checks, title="e")
    h = [p.get_height() for p in memory_ax.patches]  # 4 engine bars, then 4 simulation bars
    assert h[:4] == h[4:] == [sum(c.engine_bytes.values()) for c in checks]
    h = [p.get_height() for p in traffic_ax.patches]
    assert h[:4] == [s - c.root_saving[0] for s, c in zip(h[4:], checks)]
    for run in traced:
        p = teaching.sync_points(run)
        assert p.last_grad_end <= p.first_control_start <= p.step_end
        iv = teaching.timeline(run)
        assert [i.start for i in iv] == sorted(i.start for i in iv)
        assert teaching.forward_calls(run) == {"transformer.h.0": 1, "transformer.h.1": 1}
        assert run.flops == [traced[0].single_process_flops] and run.flops[0] > 0
    assert teaching.same_bits(traced[0].master, traced[1].master)


@pytest.mark.dist
def test_deterministic_runs_do_not_depend_on_the_world_size():
    differing, numel = teaching.measure_invariance(
        (1, 2), {"stage 1": dict(stage=1)}, micro_batches=2, steps=1
    )
    assert differing == {"stage 1": {1: 0, 2: 0}} and numel > 0
