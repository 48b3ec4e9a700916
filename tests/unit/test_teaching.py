"""notebooks/teaching/, one process: the pictures, tables, exercise checkers, timelines and
claim arithmetic behind the teaching notebooks (02_zero_from_scratch and 04_claims_vs_measurements).

The block pictures must add up to exactly the bytes the simulated ranks (World.resident_bytes)
hold; the message tables to exactly World.traffic; the exercise checkers must accept the right
answer and reject plausible wrong ones bit for bit; and the timeline must be ordered and its
overlap arithmetic exact. The runs on real gloo ranks are in tests/distributed/test_teaching.py.
"""

import os

import matplotlib
import numpy as np
import pytest

from notebooks import teaching
from notebooks.teaching import (
    CATEGORIES,
    Interval,
    Job,
    RankRun,
    bytes_by_rank,
    check_reduce_scatter,
    check_resident_bytes,
    simulate,
    toy_problem,
    world_blocks,
)
from reference import Hyper, cast
from reference.simulate import World
from zero.common.memory import reduction_factor

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# -- bits --------------------------------------------------------------------------------------


def test_same_bits_compares_bits_not_values():
    zero = {"a": np.array([0.0, 1.0], np.float32)}
    assert teaching.same_bits(zero, {"a": np.array([0.0, 1.0], np.float32)})
    assert not teaching.same_bits(zero, {"a": np.array([-0.0, 1.0], np.float32)})  # == as values
    nan = {"a": np.array([np.nan], np.float32)}
    assert teaching.same_bits(nan, {"a": np.array([np.nan], np.float32)})  # != as values
    assert not teaching.same_bits(zero, {"a": np.array([0.0, 1.0], np.float64)})
    assert not teaching.same_bits(zero, {"b": zero["a"]})
    one_ulp = np.nextafter(np.float32(1.0), np.float32(2.0))
    assert teaching.differing_elements(zero, {"a": np.array([0.0, one_ulp], np.float32)}) == 1
    with pytest.raises(ValueError, match="names differ"):
        teaching.differing_elements(zero, {"b": zero["a"]})


# -- who holds which bytes ----------------------------------------------------------------------

CONFIGS = [
    # (precision, reduce_dtype, optimizer groups)
    ("bf16", "bf16", None),  # the paper's configuration, AdamW
    ("fp32", None, None),  # pure fp32: the master is the working copy or a view of it
    ("fp16", "fp32", None),
]


@pytest.mark.parametrize("precision, reduce_dtype, _", CONFIGS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n, accumulation", [(1, 1), (2, 1), (3, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_block_totals_equal_resident_bytes(
    precision, reduce_dtype, _, stage, n, accumulation, mode
):
    problem = toy_problem(
        world_size=n, micro_batches=n * accumulation, precision=precision, reduce_dtype=reduce_dtype
    )
    world = World(problem.master, problem.spec, problem.cfg, stage=stage, mode=mode)
    world.step(problem.grads(0))
    blocks = world_blocks(world)
    totals = bytes_by_rank(blocks)
    assert sorted(totals) == list(range(n))
    for r in range(n):
        assert totals[r] == world.resident_bytes(r), (r, totals[r])
    # what each block is: the rank's own shard of a partitioned buffer, all shards of a whole one
    partitioned = {
        "params": stage >= 3,
        "grads": stage >= 2,
        "master": stage >= 1,
        "optimizer": stage >= 1,
    }
    for r in range(n):
        for cat in CATEGORIES:
            mine = [b for b in blocks if b.rank == r and b.category == cat and not b.partial]
            for u in range(len(world.shard)):
                shards = sorted(b.shard for b in mine if b.unit == u)
                if not shards:  # a view of another buffer: fp32 master only
                    assert precision == "fp32" and cat == "master"
                    continue
                per_buffer = {"optimizer": 2}.get(cat, 1)  # AdamW: m and v
                if partitioned[cat]:
                    assert shards == [r] * per_buffer
                else:
                    assert shards == sorted(list(range(n)) * per_buffer)
    partial = [b for b in blocks if b.partial]
    if mode == "fast" or accumulation == 1:
        assert not partial
    else:  # floor(log2(M/N)) extra shards per unit, docs/design.md §3
        assert all(b.shard == b.rank and b.category == "grads" for b in partial)
        assert len(partial) == n * len(world.shard)


def test_blocks_reject_a_buffer_that_is_neither_whole_nor_a_shard():
    with pytest.raises(ValueError, match="neither the unit"):
        teaching._blocks_of(0, "grads", 1, 100, 5, 12, 4, 0)


@pytest.mark.parametrize("stage", [0, 3])
def test_picture_draws_every_block_at_its_width(stage):
    run = simulate(toy_problem(world_size=4, micro_batches=8), stage)
    blocks = world_blocks(run.world)
    ax = teaching.draw_rank_bytes(blocks, title="t")
    widths = [p.get_width() for p in ax.patches]
    assert len(widths) == len(blocks)
    assert sum(widths) == sum(b.nbytes for b in blocks)
    # one row per (rank, category); its label text is the row's total
    labels = [t.get_text() for t in ax.texts]
    totals = bytes_by_rank(blocks)
    assert labels == [f"{totals[r][c] / 1024:.1f} KiB" for r in range(4) for c in CATEGORIES]
    assert ax.get_title() == "t" and ax.get_xlabel()
    with pytest.raises(ValueError, match="empty"):
        teaching.draw_rank_bytes([], title="t")


# -- messages and memory -----------------------------------------------------------------------


@pytest.mark.parametrize("stage, factor", [(0, 2), (1, 2), (2, 2), (3, 3)])
@pytest.mark.parametrize("precision, reduce_dtype", [("bf16", "bf16"), ("fp16", "fp32")])
def test_message_table_adds_up_to_the_traffic(stage, factor, precision, reduce_dtype):
    n = 4
    run = simulate(toy_problem(world_size=n, precision=precision, reduce_dtype=reduce_dtype), stage)
    w = run.world
    for r in range(n):
        rows = teaching.message_table(w, r)
        for kind in ("model", "control"):
            mine = [x for x in rows if x.kind == kind]
            assert (sum(x.elements for x in mine), sum(x.padding for x in mine)) == w.traffic(
                r, kind
            )
        compute, red = (2 if precision != "fp32" else 4), (2 if reduce_dtype == "bf16" else 4)
        for x in rows:
            size = {"grad": red, "grad_gather": red, "norm": 8, "overflow": 4}.get(x.phase, compute)
            assert x.nbytes == x.elements * size, x
        model = sum(x.elements for x in rows if x.kind == "model")
        # M = N: the paper's 2Ψ / 3Ψ, exactly, against the padded count
        assert teaching.volume_in_psi(model, n, teaching.padded_numel(w)) == factor
    text = teaching.format_messages(
        teaching.message_table(w), world_size=n, psi_padded=teaching.padded_numel(w)
    )
    assert f"**{factor}**" in text
    with pytest.raises(ValueError, match="world_size=1"):
        teaching.volume_in_psi(10, 1, 10)


@pytest.mark.parametrize("optimizer, groups", [("adamw", None), ("sgd", "momentum")])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_analytic_bytes_equal_what_the_ranks_hold(optimizer, groups, stage):
    problem = toy_problem(world_size=4, micro_batches=8)
    if optimizer == "sgd":
        from dataclasses import replace

        hp = (Hyper(lr=0.1, momentum=0.9), Hyper(lr=0.1, momentum=0.5))
        problem = replace(problem, cfg=replace(problem.cfg, optimizer="sgd", groups=hp))
    run = simulate(problem, stage)
    assert run.master_equal and run.opt_equal
    assert teaching.analytic_bytes(run.world) == run.world.resident_bytes(0)
    assert "measured/expected = 1.0000" in teaching.stage_report(run.world)


def test_analytic_bytes_refuses_groups_with_different_state_counts():
    from dataclasses import replace

    problem = toy_problem(world_size=2)
    hp = (Hyper(lr=0.1, momentum=0.9), Hyper(lr=0.1))
    problem = replace(problem, cfg=replace(problem.cfg, optimizer="sgd", groups=hp))
    with pytest.raises(ValueError, match="cfg.groups"):
        teaching.analytic_bytes(simulate(problem, 1).world)


def test_summary_of_the_four_steps():
    summary = teaching.summarize_stages(toy_problem(world_size=4))
    assert summary.volume == {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}
    assert {s: sum(h.values()) for s, h in summary.held.items()} == summary.expected
    totals = [summary.expected[s] for s in range(4)]
    assert totals == sorted(totals, reverse=True) and totals[0] == 4 * totals[3]  # 16Ψ vs 16Ψ/N
    assert summary.table().count("1.0000") == 4


def test_stage_report_tables():
    report = teaching.stage_report(simulate(toy_problem(world_size=2), 1).world, rank=1)
    assert "Messages rank 1 sent" in report and "| rank |" in report


# -- exercise 1: the reduce-scatter ------------------------------------------------------------


def solution_reduce_scatter(bufs):
    from reference.tree import tree_sum

    n = len(bufs)
    L = bufs[0].size // n
    return [tree_sum([b[r * L : (r + 1) * L] for b in bufs]) for r in range(n)]


def not_yet(*_):
    raise NotImplementedError


def test_reduce_scatter_checker_accepts_the_tree_and_rejects_other_orders():
    ok = check_reduce_scatter(solution_reduce_scatter)
    assert ok.attempted and ok.passed
    naive = check_reduce_scatter(teaching.left_to_right_reduce_scatter)
    assert naive.attempted and not naive.passed
    # the tree and the left-to-right sum agree at N = 2, 3 only; the cases must show the rest
    fails = [line for line in naive.lines if "FAIL" in line]
    assert [f.split(":")[0].strip() for f in fails] == [
        "FAIL N = 4",
        "FAIL N = 5",
        "FAIL N = 6",
        "FAIL N = 8",
    ]

    def in_float32(bufs):
        return [x.astype(np.float32) for x in solution_reduce_scatter(bufs)]

    assert not check_reduce_scatter(in_float32).passed

    def reversed_ranks(bufs):
        return solution_reduce_scatter(bufs[::-1])

    assert not check_reduce_scatter(reversed_ranks).passed


def test_reduce_scatter_checker_falls_back_to_the_solution_and_says_so():
    result = check_reduce_scatter(not_yet, fallback=solution_reduce_scatter)
    assert not result.attempted and result.passed
    assert "not attempted yet" in str(result)
    bare = check_reduce_scatter(not_yet)
    assert not bare.attempted and not bare.passed
    with pytest.raises(AssertionError, match="solution fails"):
        check_reduce_scatter(not_yet, fallback=teaching.left_to_right_reduce_scatter)


def test_expected_reduce_scatter_is_the_tree_in_rank_order():
    (bufs,) = teaching.reduce_scatter_cases(world_sizes=(4,), shard=8)
    got = teaching.expected_reduce_scatter(bufs)
    for r in range(4):
        s = [b[r * 8 : (r + 1) * 8] for b in bufs]
        want = (s[0] + s[1]) + (s[2] + s[3])
        assert np.array_equal(got[r].view(np.uint16), want.view(np.uint16))


# -- exercise 2: per-rank memory ---------------------------------------------------------------


def paper_bytes(stage, n, psi):
    return {
        "params": 2 * psi // (n if stage >= 3 else 1),
        "grads": 2 * psi // (n if stage >= 2 else 1),
        "master": 4 * psi // (n if stage >= 1 else 1),
        "optimizer": 8 * psi // (n if stage >= 1 else 1),
    }


def test_resident_bytes_checker():
    assert check_resident_bytes(paper_bytes, world_sizes=(1, 4)).passed

    def grads_never_partitioned(stage, n, psi):
        return {**paper_bytes(stage, n, psi), "grads": 2 * psi}

    wrong = check_resident_bytes(grads_never_partitioned, world_sizes=(4,))
    assert wrong.attempted and not wrong.passed
    assert sum("FAIL" in line for line in wrong.lines) == 2  # stages 2 and 3
    fallback = check_resident_bytes(not_yet, fallback=paper_bytes, world_sizes=(2,))
    assert not fallback.attempted and fallback.passed


# -- timelines ---------------------------------------------------------------------------------


def fake_run(events, records, **kw) -> RankRun:
    base = dict(
        rank=0,
        world_size=2,
        stage=2,
        volume=[(0, 0)],
        control=[(0, 0)],
        counts=[{}],
        memory={},
        blocks=[],
        master={},
        losses=[],
        unit_names=["root", "h0"],
        shards=[128, 256],
        micro_batches=2,
    )
    base.update(kw)
    return RankRun(events=events, records=records, **base)


def rec(phase, start, end, unit=1, kind="model", op="reduce_scatter", elements=256):
    return {
        "op": op,
        "phase": phase,
        "kind": kind,
        "unit": unit,
        "unit_name": None if unit is None else ["root", "h0"][unit],
        "elements": elements,
        "nbytes": 2 * elements,
        "start": start,
        "end": end,
    }


def test_timeline_orders_everything_by_start_and_drops_unfinished_collectives():
    events = [
        {"phase": "backward", "name": "h0", "start": 8.0, "end": 12.0},
        {"phase": "forward", "name": "h0", "start": 1.0, "end": 2.0},
        {"phase": "backward", "name": "h0", "start": 14.0, "end": 20.0},
    ]
    records = [
        rec("grad", 5.0, 15.0),
        rec("grad", 0.0, 10.0),
        rec("grad", 3.0, None),  # never completed: not drawn
        rec("step", 21.0, 22.0, unit=None, kind="control", op="all_gather"),
    ]
    iv = teaching.timeline(fake_run(events, records))
    assert [i.start for i in iv] == [0.0, 1.0, 5.0, 8.0, 14.0, 21.0]
    assert [i.lane for i in iv] == ["communication", "compute"] + ["communication"] + [
        "compute"
    ] * 2 + ["communication"]
    assert iv[-1].kind == "control" and iv[0].label == "reduce_scatter h0"
    # overlap of grad traffic [0,10] ∪ [5,15] with backward [8,12] ∪ [14,20]: [8,12] and [14,15]
    assert teaching.overlap_seconds(iv, comm_phase="grad", compute_kind="backward") == 5.0
    assert teaching.overlap_seconds(iv, comm_phase="grad", compute_kind="forward") == 1.0
    assert teaching.overlap_seconds(iv, comm_phase="param_fwd", compute_kind="forward") == 0.0
    rows = teaching._rows([i for i in iv if i.lane == "communication"])
    assert rows == [0, 1, 0]  # [0,10] and [5,15] overlap; [21,22] reuses row 0


def test_sync_points_and_counts_from_a_trace():
    events = [
        {"phase": "forward", "name": "h0", "start": 0.0, "end": 1.0},
        {"phase": "backward", "name": "h0", "start": 2.0, "end": 6.0},
        {"phase": "step", "name": "optimizer step", "start": 7.0, "end": 9.0},
    ]
    records = [
        rec("grad", 3.0, 6.5),
        rec("grad", 4.0, 7.0, unit=0, elements=128),
        rec("step", 7.5, 7.6, unit=None, kind="control", op="all_gather", elements=10),
        rec("param_update", 8.0, 8.5, op="all_gather"),
    ]
    p = teaching.sync_points(fake_run(events, records))
    assert (p.last_grad_end, p.first_control_start, p.step_end, p.last_comm_end) == (
        7.0,
        7.5,
        9.0,
        8.5,
    )
    assert p.overlapped == 3.0 and p.backward == 4.0
    assert teaching.forward_calls(fake_run(events, records)) == {"h0": 1}
    # per micro-step (M/N = 1): unit 1 sent 256 + 256 elements over (N-1)·L = 256; root 128/128
    assert teaching.volume_factors(fake_run(events, records)) == {"root": 1.0, "h0": 2.0}
    with pytest.raises(ValueError, match="not a traced run"):
        teaching.sync_points(fake_run([], records))


def test_draw_timeline_labels_its_lanes():
    events = [{"phase": "backward", "name": "h0", "start": 0.0, "end": 1.0}]
    ax = teaching.draw_timeline([fake_run(events, [rec("grad", 0.5, 2.0)])], title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 · compute",
        "rank 0 · communication",
    ]
    assert len(ax.patches) == 2 and ax.get_xlabel() and ax.get_title() == "t"


# -- claims ------------------------------------------------------------------------------------


def test_simulated_reduction_is_the_formula_exactly():
    for stage in (1, 2, 3):
        sizes = (1, 2, 4, 8)
        assert teaching.simulated_reduction(sizes, stage) == [
            reduction_factor(n, stage) for n in sizes
        ]


def test_figures_are_labelled_and_hold_data():
    axes = [
        teaching.draw_stage_memory(
            {s: dict.fromkeys(CATEGORIES, 100 * (4 - s)) for s in range(4)},
            expected={s: 400 * (4 - s) for s in range(4)},
            title="m",
        ),
        teaching.draw_stage_volume({"a": {0: 2.0, 3: 3.0}}, paper={0: 2, 3: 3}, title="v"),
        teaching.draw_flops({"s": [10, 10]}, single_process=10, title="f"),
        teaching.draw_reduction({1: [1.0, 1.6]}, world_sizes=(1, 2), title="r"),
        teaching.draw_invariance({"d": {1: 0, 2: 0}}, numel=5, title="i"),
    ]
    for ax in axes:
        assert ax.get_title() and (ax.get_xlabel() or ax.get_ylabel())
        assert ax.patches or ax.lines


def test_save_figure_writes_a_png_and_nothing_else(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    path = teaching.save_figure(fig, "x", tmp_path / "figs")
    assert path == tmp_path / "figs" / "x.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "figs") == ["x.png"]


def test_job_validates_its_fields():
    with pytest.raises(ValueError, match="stage=4"):
        Job(stage=4)
    with pytest.raises(ValueError, match="steps=0"):
        Job(stage=0, steps=0)
    with pytest.raises(ValueError, match="trace=True"):
        Job(stage=0, trace=True, steps=1)
    with pytest.raises(ValueError, match="is not a Job"):
        teaching.run_on_gloo([{"stage": 0}], 2)


def test_toy_problem_gradients_are_a_function_of_the_step():
    p = toy_problem(world_size=2)
    a, b = p.grads(0), p.grads(0)
    assert len(a) == 2 and all(teaching.same_bits(x, y) for x, y in zip(a, b))
    assert not teaching.same_bits(a[0], p.grads(1)[0])
    assert all(x.dtype == cast(np.zeros(1), "bf16").dtype for x in a[0].values())


def test_interval_is_a_plain_record():
    i = Interval(lane="compute", label="x", start=0.0, end=1.0, kind="forward")
    assert (i.end - i.start, i.kind) == (1.0, "forward")


def test_notebook_exercises_have_a_collapsed_solution_after_the_student_cell():
    """In 02, each exercise cell (the student's, raising NotImplementedError) is followed by a
    "Solution" heading, the solution in a collapsed cell, and a check that falls back to it."""
    import nbformat

    path = os.path.join(
        os.path.dirname(__file__), "..", "..", "notebooks", "02_zero_from_scratch.ipynb"
    )
    cells = nbformat.read(path, as_version=4).cells
    students = [i for i, c in enumerate(cells) if "raise NotImplementedError" in c.source]
    assert len(students) == 2, path
    for i in students:
        heading, solution, check = cells[i + 1], cells[i + 2], cells[i + 3]
        assert heading.cell_type == "markdown" and "Solution" in heading.source
        assert solution.cell_type == "code"
        assert solution.metadata.get("jupyter", {}).get("source_hidden") is True
        assert "fallback=solution_" in check.source and "teaching.check_" in check.source
