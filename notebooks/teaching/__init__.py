"""What the teaching notebooks draw and measure: pictures of who holds which bytes, message and
memory tables, exercise checkers, real gloo runs with timelines, and the measurements behind the
claims.

Used by ``notebooks/02_zero_from_scratch.ipynb`` and ``notebooks/04_claims_vs_measurements.ipynb``
as ``from notebooks import teaching`` and ``teaching.X``; every name they use is re-exported here.
The mechanism itself is not here: notebook 02 writes each stage's step in its own cells (NumPy
over simulated ranks, the reduce-scatter and all-gather written out), and reference/simulate.py
holds the same steps as Stage0-Stage3. Tested in tests/unit/test_teaching.py (one process) and
tests/distributed/test_teaching.py (gloo ranks).

Modules:
    common        category and stage names, bitwise comparison, Markdown tables, save_figure
    simulation    the toy problem; reference/simulate.py's ranks beside the reference; tables
    pictures      blocks of who holds which bytes ([Note: counted bytes]); message tables
    exercises     notebook 02's exercises and their checkers
    gloo          Job, RankRun, run_on_gloo: zero/ on local gloo ranks
    engine_check  zero/ on gloo against the simulation of the same steps
    timeline      compute and communication intervals of a traced step
    claims        notebook 04's measurements: volumes, memory reduction, invariance
    figures       the bar and line charts over stages and world sizes
    model_parallel  notebook 07: the DP × MP mesh, one rank's memory estimated then measured

Legend (ZeRO paper §5, docs/design.md §2-§3):
    N       world size, the data-parallel degree N_d; ranks 0..N-1
    M       micro-batches per step over all ranks
    Ψ       parameters; Ψ_pad the padded count, N·ΣL, where L is a unit's shard length
    stage   0 baseline DP, 1 P_os, 2 P_os+g, 3 P_os+g+p
    block   a contiguous piece of one rank's buffers: (category, unit, shard), where `shard` is
            the rank whose 1/N slice of the unit it is. A replicated buffer is N blocks, one per
            shard; a partitioned one is the rank's own shard only.
"""

from .claims import (
    VolumeMeasurement,
    format_series,
    format_units,
    measure_invariance,
    measure_volumes,
    reduction_table,
    simulated_reduction,
    total_volume_factor,
    volume_factors,
)
from .common import (
    CATEGORIES,
    STAGE_NAMES,
    differing_elements,
    same_bits,
    save_figure,
    volume_in_psi,
)
from .engine_check import (
    EngineCheck,
    all_blocks,
    check_engine_against_simulation,
    draw_engine_vs_simulation,
    format_engine_checks,
    root_gather_saving,
    simulate_engine_run,
)
from .exercises import (
    ExerciseResult,
    check_reduce_scatter,
    check_resident_bytes,
    expected_reduce_scatter,
    left_to_right_reduce_scatter,
    reduce_scatter_cases,
)
from .figures import (
    draw_flops,
    draw_invariance,
    draw_reduction,
    draw_stage_memory,
    draw_stage_volume,
)
from .gloo import Job, RankRun, run_on_gloo
from .pictures import (
    PHASE_DTYPE,
    Block,
    MessageRow,
    _blocks_of,  # noqa: F401  (tests/unit/test_teaching.py checks its refusal)
    bytes_by_rank,
    draw_rank_bytes,
    engine_blocks,
    format_memory,
    format_messages,
    message_table,
    shard_colors,
    world_blocks,
)
from .simulation import (
    SimRun,
    StageSummary,
    ToyProblem,
    analytic_bytes,
    padded_numel,
    simulate,
    stage_report,
    summarize_stages,
    toy_problem,
    toy_units,
)
from .timeline import (
    TIMELINE_COLORS,
    Interval,
    SyncPoints,
    _rows,  # noqa: F401  (tests/unit/test_teaching.py checks the row packing)
    draw_timeline,
    forward_calls,
    gathers_per_unit,
    overlap_seconds,
    sync_points,
    timeline,
)

__all__ = [
    "CATEGORIES",
    "PHASE_DTYPE",
    "STAGE_NAMES",
    "TIMELINE_COLORS",
    "Block",
    "EngineCheck",
    "ExerciseResult",
    "Interval",
    "Job",
    "MessageRow",
    "RankRun",
    "SimRun",
    "StageSummary",
    "SyncPoints",
    "ToyProblem",
    "VolumeMeasurement",
    "all_blocks",
    "analytic_bytes",
    "bytes_by_rank",
    "check_engine_against_simulation",
    "check_reduce_scatter",
    "check_resident_bytes",
    "differing_elements",
    "draw_engine_vs_simulation",
    "draw_flops",
    "draw_invariance",
    "draw_rank_bytes",
    "draw_reduction",
    "draw_stage_memory",
    "draw_stage_volume",
    "draw_timeline",
    "engine_blocks",
    "expected_reduce_scatter",
    "format_engine_checks",
    "format_memory",
    "format_messages",
    "format_series",
    "format_units",
    "forward_calls",
    "gathers_per_unit",
    "left_to_right_reduce_scatter",
    "measure_invariance",
    "measure_volumes",
    "message_table",
    "overlap_seconds",
    "padded_numel",
    "reduce_scatter_cases",
    "reduction_table",
    "root_gather_saving",
    "run_on_gloo",
    "same_bits",
    "save_figure",
    "shard_colors",
    "simulate",
    "simulate_engine_run",
    "simulated_reduction",
    "stage_report",
    "summarize_stages",
    "sync_points",
    "timeline",
    "toy_problem",
    "toy_units",
    "total_volume_factor",
    "volume_factors",
    "volume_in_psi",
    "world_blocks",
]
