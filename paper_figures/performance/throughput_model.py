"""A performance model of the paper's throughput figures: fitted on one figure, tested on others.

One GPU's step takes t = compute + MP communication + exposed DP communication + optimizer,
compute = F / (peak · f(x)) with f(x) = peak_fraction · x / (x + half_work), and the reported
throughput is F / t per GPU (F: Megatron's FLOP count with activation checkpointing). The free
parameters (Params) are fitted on Figure 4 alone; Figures 2 and 3 are predictions
(docs/paper.md §1.8, §1.9). The terms, the stated hardware (HARDWARE), the assumptions and what
the fit can and cannot tell apart are in docs/perfmodel.md.

Legend: B sequences per DP rank per step, s sequence length, l layers, h hidden size, V
vocabulary, MP the model-parallel degree, DP = GPUs / MP, Ψ parameters, x = B·s·h / MP the
per-GPU size of a transformer GEMM, g GPUs of a group inside one node, k the nodes it spans.
The paper's runs (Run, FIGURE2-4) and HARDWARE are paper_figures/paper.py's, the CPU
measurements in the model's terms (cpu_terms) paper_figures/performance/throughput.py's; all
importable here.
"""

# [Note: measured MP volume] The MP communication is no assumed count of all-reduces: it is the
# elements that our engine's tensor parallelism sends per rank (kind "mp", docs/design.md §6),
# read from a measure.bench record of a model-parallel system (MEASURED_MP) and scaled to a
# paper run by mp_elements, §6's fast-mode formula with the recomputation and P_a terms. The
# record's count must equal mp_elements at the record's own size, or the model refuses it
# (tests/distributed/test_bench_mp.py checks the formula against the count with activation
# checkpointing and P_a too). Measured, a checkpointed block costs 5 sums of B·s·h, not the 6 of
# docs/paper.md §1.4: torch's non-reentrant checkpoint recomputes one of the block's two sums.

# [Note: what is fitted] Figure 4 has no model parallelism, and its DP communication time depends
# on overlap and internode_efficiency only through (1 - overlap) / internode_efficiency, which it
# cannot tell apart. So the fit varies peak_fraction, half_work and overlap, both effective
# bandwidths stay at the stated numbers (efficiency 1), and the held-out predictions are also
# reported with both efficiencies at 0.5 (SENSITIVITY).

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from paper_figures.common import MEASURED
from paper_figures.paper import FIGURE2, FIGURE3, FIGURE4, HARDWARE, Hardware, Run
from paper_figures.performance.throughput import COMM_PHASES, COMPUTE_PHASES, cpu_terms  # noqa: F401
from zero.common.results import make_record, provenance, read_json, write_json
from zero.workloads.models import gpt_flops

KIND_POINT = "perf_model.point"
KIND_FIT = "perf_model.fit"
SECTION = "perf_model"

SEQ = 1024
VOCAB = 50257
OPTIMIZER_BYTES = 28
"""Bytes of memory traffic per parameter of one mixed-precision Adam step (see Assumptions)."""

MEASURED_MP = MEASURED / "bench_mp_anchor.json"
"""measure.bench's records of the model-parallel systems whose counted MP traffic sets the
model's MP volume ([Note: measured MP volume])."""

DP_VOLUME = {0: 2, 1: 2, 2: 2, 3: 3}
"""docs/design.md §2 at M = N: elements each rank sends per step, in units of Ψ·(N-1)/N."""


@dataclass(frozen=True, kw_only=True)
class Params:
    """The named free parameters (module docstring)."""

    peak_fraction: float
    """Achieved fraction of peak FLOP/s for large GEMMs."""
    half_work: float
    """GEMM size x = B·s·h/MP at which half of peak_fraction is reached."""
    overlap: float
    """Fraction of the DP communication hidden behind backward, in [0, 1]."""
    nvswitch_efficiency: float = 1.0
    """Effective / stated NVSwitch bandwidth."""
    internode_efficiency: float = 1.0
    """Effective / stated bandwidth between nodes."""

    def __post_init__(self):
        for name in ("peak_fraction", "nvswitch_efficiency", "internode_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name}={v!r} is not allowed: expected a fraction in (0, 1]")
        if not self.half_work >= 0:
            raise ValueError(f"half_work={self.half_work!r} is not allowed: expected >= 0")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap!r} is not allowed: expected [0, 1]")


FITTED, HELD_OUT = FIGURE4, FIGURE2 + FIGURE3

SENSITIVITY = {"nvswitch_efficiency": 0.5, "internode_efficiency": 0.5}
"""The held-out predictions are also made with these fixed (unfitted) values instead of 1."""


# ---------------------------------------------------------------------------------------------
# The model


def num_params(layers: int, hidden: int, *, vocab: int = VOCAB, seq: int = SEQ) -> int:
    """Ψ of a GPT-2-like model, embeddings included, head tied:
    zero.workloads.models.gpt_num_params."""
    return layers * (12 * hidden * hidden + 13 * hidden) + (vocab + seq) * hidden + 2 * hidden


def step_flops(batch: int, layers: int, hidden: int, *, recompute: bool = True) -> float:
    """FLOPs of one step of a paper model on B sequences (all MP ranks together)."""
    return gpt_flops(batch, SEQ, layers, hidden, VOCAB, recompute=recompute)


def collective_seconds(payload: float, factor: float, gpus: int, per_node: int, p: Params,
                       hw: Hardware = HARDWARE) -> float:  # fmt: skip
    """A hierarchical collective over a group of `gpus`, `per_node` of them in each node: each
    GPU moves factor·payload·(g-1)/g bytes over NVSwitch; the node's link carries
    factor·payload·(k-1)/k for each of the gpus_per_node/g groups that share it.
    factor: 2 for an all-reduce, 1 for an all-gather or a reduce-scatter."""
    if gpus <= 1:
        return 0.0
    g = min(per_node, gpus)
    k = gpus // g
    intra = factor * payload * (g - 1) / g / (hw.nvswitch_bytes_s * p.nvswitch_efficiency)
    share = hw.gpus_per_node / g
    inter = share * factor * payload * (k - 1) / k / (hw.node_bytes_s * p.internode_efficiency)
    return intra + inter


def mp_elements(*, layers: int, batch: int, seq: int, hidden: int, mp: int, recompute: bool,
                p_a: bool) -> int:  # fmt: skip
    """Elements one rank sends in the MP collectives of one micro-batch of `batch` sequences,
    fast mode (ring all-reduces): docs/design.md §6's table, 2(N-1)⌈n/N⌉ per sum or max of n
    elements, N = mp, X = batch·seq·hidden, T = batch·seq. Forward 2L + 1 sums of X and 3 of T,
    backward 2L + 1 sums of X; recompute (activation checkpointing of every block) one more sum
    of X per block; p_a one all-gather of (N-1)·⌈X/N⌉ per block."""
    if mp == 1:
        return 0
    x, t = batch * seq * hidden, batch * seq
    ring = lambda e: 2 * (mp - 1) * math.ceil(e / mp)  # noqa: E731
    sums = (2 * layers + 1) * 2 + (layers if recompute else 0)
    gather = layers * (mp - 1) * math.ceil(x / mp) if recompute and p_a else 0
    return sums * ring(x) + 3 * ring(t) + gather


def record_mp_elements(record: dict) -> tuple[int, int]:
    """(counted, mp_elements) of one measure.bench record of a fast model-parallel system: the
    kind "mp" elements rank 0 sent in one step, and the formula at the record's size."""
    c = record["config"]
    g = c["gpt"]
    counted = record["result"]["traffic_per_step"][0]["elements"]["mp"]
    formula = mp_elements(layers=g["n_layer"], batch=c["sequences_per_micro_batch"],
                          seq=g["block_size"], hidden=g["n_embd"], mp=c["mp"], recompute=False,
                          p_a=False)  # fmt: skip
    return counted, formula * (c["micro_batches"] // c["dp"])


@functools.cache
def measured_mp(path: str | None = None) -> dict:
    """The measured MP volume ([Note: measured MP volume]): of the fast MP system with the
    largest N_m in the records at `path` (default MEASURED_MP), its counted elements, the
    formula's at its size and their ratio, which scales every paper run's mp_elements."""
    path = Path(path) if path is not None else MEASURED_MP
    fast = [
        r for r in read_json(path)["records"]
        if r["result"]["status"] == "ok" and r["config"].get("mp", 1) > 1
        and r["config"]["mode"] == "fast"
    ]  # fmt: skip
    if not fast:
        raise ValueError(f"MEASURED_MP={str(path)!r}: no fast model-parallel record in it")
    rec = max(fast, key=lambda r: (r["config"]["mp"], r["config"]["system"]))
    counted, formula = record_mp_elements(rec)
    if counted != formula:
        raise ValueError(
            f"MEASURED_MP: {rec['config']['system']} counted {counted} MP elements per step, "
            f"docs/design.md §6 says {formula}: the formula no longer describes the engine"
        )
    c = rec["config"]
    return {
        "source": path.name,
        "system": c["system"],
        "model": c["model"],
        "counted_elements": counted,
        "formula_elements": formula,
        "scale": counted / formula,
    }


def sent_seconds(sent_bytes: float, gpus: int, per_node: int, p: Params,
                 hw: Hardware = HARDWARE) -> float:  # fmt: skip
    """collective_seconds of a ring collective in which every GPU sends `sent_bytes`: its
    payload·factor is sent_bytes·g/(g-1) for a group of g GPUs."""
    if gpus <= 1:
        return 0.0
    return collective_seconds(sent_bytes * gpus / (gpus - 1), 1, gpus, per_node, p, hw)


def two_link_seconds(intra_bytes: float, inter_bytes: float, p: Params,
                     hw: Hardware = HARDWARE) -> float:  # fmt: skip
    """Two link classes, used one after the other (docs/perfmodel.md, *Two link classes*): the
    busiest GPU's intra-node bytes over its NVSwitch (or NVLink) bandwidth, then a node's
    inter-node bytes over the node's link. Bytes moved from one class to the other change the
    time only as far as the two bandwidths differ."""
    intra = intra_bytes / (hw.nvswitch_bytes_s * p.nvswitch_efficiency)
    return intra + inter_bytes / (hw.node_bytes_s * p.internode_efficiency)


def _split(run: Run, p: Params, hw: Hardware) -> tuple[float, float, float, float, float]:
    """(FLOPs per GPU, GEMM size x, MP communication, DP communication before overlap and
    optimizer seconds): the parts that the three fitted parameters do not change."""
    s, h, mp, dp = SEQ, run.hidden, run.mp, run.dp
    flops = step_flops(run.batch, run.layers, h) / mp
    x = run.batch * s * h / mp
    mp_node = min(mp, hw.gpus_per_node)
    # [Note: measured MP volume]: fp16 elements, every block checkpointed (the paper's runs)
    sent = mp_elements(layers=run.layers, batch=run.batch, seq=s, hidden=h, mp=mp,
                       recompute=True, p_a=run.partitioned_activations)  # fmt: skip
    mp_comm = sent_seconds(2.0 * sent * measured_mp()["scale"], mp, mp_node, p, hw)
    psi = num_params(run.layers, h) / mp
    dp_node = max(1, hw.gpus_per_node // mp)  # same-MP-rank GPUs in one node
    dp_comm = collective_seconds(2.0 * psi, DP_VOLUME[run.stage], dp, dp_node, p, hw)
    optimizer = OPTIMIZER_BYTES * psi / (dp if run.stage >= 1 else 1) / hw.hbm_bytes_s
    return flops, x, mp_comm, dp_comm, optimizer


def terms(run: Run, p: Params, hw: Hardware = HARDWARE) -> dict[str, float]:
    """Seconds per step per GPU of each term, the FLOPs and the modelled TFLOP/s per GPU."""
    flops, x, mp_comm, dp_comm, optimizer = _split(run, p, hw)
    fraction = p.peak_fraction * x / (x + p.half_work)
    compute = flops / (hw.peak_flops * fraction)
    total = compute + mp_comm + (1 - p.overlap) * dp_comm + optimizer
    return {
        "flops_per_gpu": flops,
        "gemm_size": x,
        "achieved_fraction": fraction,
        "compute_s": compute,
        "mp_comm_s": mp_comm,
        "dp_comm_s": dp_comm,
        "dp_exposed_s": (1 - p.overlap) * dp_comm,
        "optimizer_s": optimizer,
        "step_s": total,
        "tflops": flops / total / 1e12,
    }


def predict(run: Run, p: Params, hw: Hardware = HARDWARE) -> float:
    """Modelled TFLOP/s per GPU."""
    return terms(run, p, hw)["tflops"]


def relative_error(model: float, paper: float) -> float:
    """(model - paper) / paper."""
    return (model - paper) / paper


def mape(runs, p: Params, hw: Hardware = HARDWARE) -> float:
    """Mean |relative error| over runs."""
    return float(np.mean([abs(relative_error(predict(r, p, hw), r.paper_tflops)) for r in runs]))


# ---------------------------------------------------------------------------------------------
# Fitting: an exhaustive grid, refined twice around its best point (deterministic, no SciPy)


def _grid_loss(runs, base: Params, hw: Hardware, f, lw, o) -> np.ndarray:
    """Sum over runs of squared log(model / paper), for every (f, 10**lw, o) of the broadcast
    grids at once: a point 10% high costs what a point 10% low does."""
    total = np.zeros(np.broadcast_shapes(f.shape, lw.shape, o.shape))
    for r in runs:
        flops, x, mp_comm, dp_comm, optimizer = _split(r, base, hw)
        compute = flops * (x + 10.0**lw) / (hw.peak_flops * f * x)
        step = compute + mp_comm + (1 - o) * dp_comm + optimizer
        total += np.log(flops / step / 1e12 / r.paper_tflops) ** 2
    return total


def fit(runs=FITTED, *, hw: Hardware = HARDWARE, fixed: Params | None = None) -> Params:
    """peak_fraction, half_work and overlap minimising the squared log errors over `runs`
    ([Note: what is fitted]); the bandwidth efficiencies are taken from `fixed` (default 1)."""
    base = fixed or Params(peak_fraction=0.5, half_work=1e6, overlap=0.5)
    # ranges: fraction (0, 1]; log10(half_work) 3..9; overlap [0, 1]
    lo, hi = np.array([0.05, 3.0, 0.0]), np.array([1.0, 9.0, 1.0])
    for _ in range(3):
        f, lw, o = np.meshgrid(*(np.linspace(a, b, 41) for a, b in zip(lo, hi)), indexing="ij")
        loss = _grid_loss(runs, base, hw, f, lw, o)
        i = np.unravel_index(np.argmin(loss), loss.shape)
        best = np.array([f[i], lw[i], o[i]])
        span = (hi - lo) / 10  # zoom in around the best point, inside the allowed ranges
        lo = np.maximum(best - span, [0.01, 0.0, 0.0])
        hi = np.minimum(best + span, [1.0, 12.0, 1.0])
    # The valley runs diagonally (a higher fraction with more exposed communication), where an
    # axis-aligned grid stalls: finish with a pattern search along each axis and the diagonals.
    bounds_lo, bounds_hi = np.array([0.01, 0.0, 0.0]), np.array([1.0, 12.0, 1.0])
    moves = [np.array(m, float) for m in itertools.product((-1, 0, 1), repeat=3) if any(m)]
    current = float(_grid_loss(runs, base, hw, *(np.array(v) for v in best)))
    step = (hi - lo) / 4
    while np.max(step) > 1e-7:
        trials = [np.clip(best + m * step, bounds_lo, bounds_hi) for m in moves]
        values = _grid_loss(runs, base, hw, *np.array(trials).T)
        k = int(np.argmin(values))
        if values[k] < current:  # move, and lengthen the stride while moves keep paying off
            best, current, step = trials[k], float(values[k]), step * 2
        else:
            step = step / 2
    return replace(
        base, peak_fraction=float(best[0]), half_work=float(10 ** best[1]), overlap=float(best[2])
    )


# ---------------------------------------------------------------------------------------------
# Records, summary, figure


def _point_record(run: Run, p: Params, role: str, prov: dict, variant: str) -> dict:
    t = terms(run, p)
    config = {
        **{k: v for k, v in asdict(run).items() if k != "paper_tflops"},
        "dp": run.dp,
        "seq": SEQ,
        "vocab": VOCAB,
        "num_params": num_params(run.layers, run.hidden),
        "role": role,
        "variant": variant,
    }
    result = {
        "paper_tflops": run.paper_tflops,
        "paper_source": "read off the paper's plot (approximate)",
        "model_tflops": t["tflops"],
        "relative_error": relative_error(t["tflops"], run.paper_tflops),
        "terms": t,
    }
    return make_record(config=config, result=result, kind=KIND_POINT, provenance=prov)


def build_records() -> list[dict]:
    """Fit on FITTED, predict HELD_OUT (and the SENSITIVITY variant); one record per point plus
    the fit's record (parameters, errors by figure and role, a constant predictor's errors)."""
    prov = provenance()
    p = fit()
    alt = replace(p, **SENSITIVITY)
    records = [_point_record(r, p, "fitted", prov, "fit") for r in FITTED]
    records += [_point_record(r, p, "held_out", prov, "fit") for r in HELD_OUT]
    records += [_point_record(r, alt, "held_out", prov, "sensitivity") for r in HELD_OUT]
    constant = float(np.mean([r.paper_tflops for r in FITTED]))  # a model with no mechanism
    groups = {
        "fitted: Figure 4": FITTED,
        "held out: Figure 2 ZeRO": [r for r in FIGURE2 if r.series == "ZeRO"],
        "held out: Figure 2 Megatron": [r for r in FIGURE2 if r.series == "Megatron"],
        "held out: Figure 3": FIGURE3,
    }
    errors = {
        name: {
            "points": len(runs),
            "mape": mape(runs, p),
            "mape_sensitivity": mape(runs, alt),
            "mape_constant_predictor": float(
                np.mean([abs(relative_error(constant, r.paper_tflops)) for r in runs])
            ),
        }
        for name, runs in groups.items()
    }
    fit_config = {
        "fitted_on": "Figure 4 (ZeRO-DP without MP, 128 GPUs): 11 points",
        "free": ["peak_fraction", "half_work", "overlap"],
        "fixed": {"nvswitch_efficiency": 1.0, "internode_efficiency": 1.0},
        "sensitivity": SENSITIVITY,
        "hardware": asdict(HARDWARE),
        "seq": SEQ,
        "vocab": VOCAB,
        "loss": "sum of squared log(model / paper)",
        "mp_volume": measured_mp(),
    }
    result = {"params": asdict(p), "errors": errors, "constant_tflops": constant}
    records.append(make_record(config=fit_config, result=result, kind=KIND_FIT, provenance=prov))
    return records


def write_records(path) -> Path:
    """Fit, predict and write the records to `path` (zero.common.results JSON, atomically)."""
    return write_json(path, {"section": SECTION, "records": build_records()})


def summary(records: list[dict]) -> str:
    """One line per group: MAPE of the model, of the sensitivity variant, of a constant."""
    fit_rec = next(r for r in records if r["kind"] == KIND_FIT)
    lines = [
        "fitted: " + ", ".join(f"{k} = {v:.3g}" for k, v in fit_rec["result"]["params"].items())
    ]
    for name, e in fit_rec["result"]["errors"].items():
        lines.append(
            f"{name} ({e['points']} points): mean |error| {100 * e['mape']:.0f}% "
            f"(bandwidths at 50%: {100 * e['mape_sensitivity']:.0f}%; "
            f"a constant {fit_rec['result']['constant_tflops']:.1f} TFLOP/s: "
            f"{100 * e['mape_constant_predictor']:.0f}%)"
        )
    return "\n".join(lines)


def points_table(records: list[dict], *, variant: str = "fit") -> str:
    """Markdown: every point, paper vs model, its error and role."""
    rows = ["| figure | series | model | GPUs | MP | B | role | paper | model | error |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        c, res = r["config"], r["result"]
        if r["kind"] != KIND_POINT or c["variant"] != variant:
            continue
        rows.append(
            f"| {c['figure']} | {c['series']} | {c['label']} | {c['gpus']} | {c['mp']} | "
            f"{c['batch']} | {c['role']} | {res['paper_tflops']:.1f} | "
            f"{res['model_tflops']:.1f} | {100 * res['relative_error']:+.0f}% |"
        )
    return "\n".join(rows)


def draw(records: list[dict]):
    """The figure: one panel per paper figure, paper values against the model (held-out
    predictions also with the sensitivity variant). Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    pts = [r for r in records if r["kind"] == KIND_POINT]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (
        ("4", "Figure 4 (FITTED): ZeRO-DP, 128 GPUs, no MP"),
        ("2", "Figure 2 (HELD OUT): 400 GPUs, with MP"),
        ("3", "Figure 3 (HELD OUT): 60B model, MP 16"),
    )
    for ax, (figure, title) in zip(axes, panels):
        here = [r for r in pts if r["config"]["figure"] == figure]

        def x_of(r, by_gpus=figure == "3"):  # Figure 3 by GPU count, the others by size
            c = r["config"]
            return c["gpus"] if by_gpus else c["num_params"] / 1e9

        for series, color in (("ZeRO", "C0"), ("Baseline DP", "C1"), ("Megatron", "C1")):
            main = [r for r in here if r["config"]["series"] == series]
            fitted = [r for r in main if r["config"]["variant"] == "fit"]
            if not fitted:
                continue
            xs = [x_of(r) for r in fitted]
            ax.plot(xs, [r["result"]["paper_tflops"] for r in fitted], "o", color=color,
                    label=f"{series}: paper (read off plot)")  # fmt: skip
            ax.plot(xs, [r["result"]["model_tflops"] for r in fitted], "x--", color=color,
                    label=f"{series}: model")  # fmt: skip
            alt = [r for r in main if r["config"]["variant"] == "sensitivity"]
            if alt:
                ax.plot([x_of(r) for r in alt], [r["result"]["model_tflops"] for r in alt], ":",
                        color=color, lw=1, label=f"{series}: model, bandwidths at 50%")  # fmt: skip
        if figure == "2":
            ax.set_xscale("log")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_xlabel("GPUs" if figure == "3" else "parameters (billions)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 50)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle("Performance model (compute + exposed communication + optimizer) vs the paper")
    fig.tight_layout()
    return fig


def render(results_path, figure_path) -> Path:
    """perf_model.png from the records in `results_path` (never from numbers held in code)."""
    import io

    from zero.common.results import write_atomic

    fig = draw(read_json(results_path)["records"])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return write_atomic(figure_path, buf.getvalue())
