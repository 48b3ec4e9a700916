"""The paper's printed numbers, typed in once, and its rounding rules; the throughput figures'
points as Runs (their configurations), and the hardware the paper states.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv 1910.02054 (SC20), and at the end ZeRO++ (Wang et al., arXiv 2306.10209, with its blog);
transcribed in docs/paper.md, whose section is cited at each value. These are the only hand-typed
numbers the figures and tables use: everything "ours" comes from the JSON records that the
sections write.

Legend: Ψ = num_params (7.5B, 128B, 1T in Table 1), N_d = world_size (the "DP" column),
K = 12 (mixed-precision Adam), MP = N_m (the model-parallel degree of Table 2), GB = 1e9 bytes.
Stages: 0 = Baseline DP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p.
"""

from __future__ import annotations

import decimal
import math
from dataclasses import dataclass
from decimal import Decimal

# --- Figure 1 (docs/paper.md §1.1): Ψ = 7.5B, N_d = 64, K = 12, per-device GB by stage. -----------
FIG1_NUM_PARAMS = 7.5e9
FIG1_WORLD_SIZE = 64
FIG1_K = 12
FIG1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
"""Figure 1 prints one decimal (1.9); Table 1 prints the same stage-3 value as 1.88."""

# --- Table 1 (docs/paper.md §1.2): per-device model-state GB vs DP degree. ------------------------
TABLE1_MODELS = (7.5e9, 128e9, 1e12)
TABLE1_MODEL_LABELS = ("7.5B", "128B", "1T")
TABLE1_STAGES = (1, 2, 3)
TABLE1_DP = (1, 4, 16, 64, 256, 1024)
TABLE1_GB = {
    # DP: 7.5B (P_os, P_os+g, P_os+g+p), 128B (...), 1T (...)
    1: (120, 120, 120, 2048, 2048, 2048, 16000, 16000, 16000),
    4: (52.5, 41.3, 30, 896, 704, 512, 7000, 5500, 4000),
    16: (35.6, 21.6, 7.5, 608, 368, 128, 4750, 2875, 1000),
    64: (31.4, 16.6, 1.88, 536, 284, 32, 4187, 2218, 250),
    256: (30.4, 15.4, 0.47, 518, 263, 8, 4046, 2054, 62.5),
    1024: (30.1, 15.1, 0.12, 513, 257, 2, 4011, 2013, 15.6),
}
"""Row = DP degree; columns = (model, stage) in TABLE1_MODELS × TABLE1_STAGES order."""
TABLE1_BOLD = {(4, 2), (16, 1), (64, 0), (64, 5), (1024, 8)}
"""(DP, column index) of the cells the paper prints in bold: fits in a 32 GB V100."""
TABLE1_DEVICE_GB = 32


def table1_cell(dp: int, num_params: float, stage: int) -> float:
    """The paper's printed Table 1 value for a DP degree, model size and stage."""
    column = TABLE1_MODELS.index(num_params) * len(TABLE1_STAGES) + TABLE1_STAGES.index(stage)
    return float(TABLE1_GB[dp][column])


# --- Table 2 (docs/paper.md §1.3): max model size, theoretical vs measured. -----------------------
@dataclass(frozen=True, kw_only=True)
class Printed:
    """One printed cell: its text as printed (markup stripped), the parsed value, its styling."""

    text: str
    """As printed, e.g. "7.6B" or "0.5T"."""
    billions: float
    """The value in billions of parameters (0.5T = 500)."""
    bold: bool = False
    italic: bool = False

    @property
    def decimals(self) -> int:
        """Decimals printed in the number, e.g. 1 for "0.5T", 0 for "1T"."""
        number = self.text[:-1]
        return len(number.split(".")[1]) if "." in number else 0

    @property
    def unit(self) -> str:
        """The unit as printed: "B" or "T"."""
        return self.text[-1]


def _p(text: str, *, bold: bool = False, italic: bool = False) -> Printed:
    scale = {"B": 1.0, "T": 1000.0}[text[-1]]
    return Printed(text=text, billions=float(text[:-1]) * scale, bold=bold, italic=italic)


TABLE2_DEVICE_BYTES = 32e9
TABLE2_WORLD_SIZE = 64
TABLE2_K = 12
TABLE2_MP = (1, 2, 4, 8, 16)
TABLE2_GPUS = {1: 64, 2: 128, 4: 256, 8: 512, 16: 1024}
TABLE2_THEORETICAL = {
    # MP: (Baseline, P_os, P_os+g, P_os+g+p), i.e. stages 0..3
    1: (_p("2B"), _p("7.6B", bold=True), _p("14.4B"), _p("128B")),
    2: (_p("4B"), _p("15.2B", bold=True), _p("28.8B"), _p("256B")),
    4: (_p("8B"), _p("30.4B", bold=True), _p("57.6B"), _p("0.5T")),
    8: (_p("16B"), _p("60.8B", bold=True), _p("115.2B"), _p("1T")),
    16: (_p("32B"), _p("121.6B", bold=True), _p("230.4B"), _p("2T", italic=True)),
}
TABLE2_MEASURED = {
    # MP: (measured Baseline, measured ZeRO-DP with P_os)
    1: (_p("1.3B"), _p("6.2B", bold=True)),
    2: (_p("2.5B"), _p("12.5B", bold=True)),
    4: (_p("5B"), _p("25B", bold=True)),
    8: (_p("10B", italic=True), _p("50B", bold=True)),
    16: (_p("20B"), _p("100B", bold=True)),
}
"""Italics as in the original; its caption does not explain them."""


# --- Figures 6-8 (docs/paper.md §1.6, §1.7, §1.8): configurations C1-C5, MP = 16, 400 V100 32GB. --
FIG6_MAX_BILLIONS = {"C1": 40, "C2": 60, "C3": 50, "C4": 140, "C5": 150}
"""Largest model at batch 16 per GPU. C1, C2, C4 and C5 are stated in the text; C3 is read off
the plot (≈50), consistent with the 50B row of the SC20 appendix."""
FIG7_MODELS = ("40B", "100B")
FIG7_GB = {
    "40B": {"C1": 30, "C2": 24, "C3": 25.5, "C4": 20, "C5": 20},
    "100B": {"C4": 30, "C5": 26.5},
}
"""Max cache allocated per GPU, read off the plot (approximate); no bars for C1-C3 at 100B."""
FIG8_TFLOPS = {
    "60B": {"C1": 12, "C2": 12.5, "C3": 17, "C4": 35, "C5": 32},
    "170B": {"C5": 21},
}
"""TFLOP/s per GPU, read off the plot; at 170B only C5 ran (C1-C4 marked as failing)."""
FIG8_BATCH_60B = {"C1": 2, "C2": 4, "C3": 32, "C4": 32, "C5": 8}
"""Batch per GPU of each configuration on the 60B model (docs/paper.md §1.9)."""


# --- Figures 2, 3 and 4 (docs/paper.md §1.8, configurations §1.9): TFLOP/s per GPU. -------------
# Each row: (label, GPUs, MP, layers, hidden, B sequences per data-parallel rank per step,
# TFLOP/s per GPU read off the plot, approximate). ZeRO runs are stage 2 (P_os+g), with
# partitioned activations where MP > 1; Baseline DP and Megatron are stage 0.
FIG4_ZERO = (
    ("1.5B", 128, 1, 34, 1920, 24, 40.0),
    ("2.5B", 128, 1, 54, 1920, 24, 42.0),
    ("4B", 128, 1, 64, 2304, 16, 43.5),
    ("6B", 128, 1, 52, 3072, 12, 47.0),
    ("8B", 128, 1, 72, 3072, 8, 47.0),
    ("10B", 128, 1, 50, 4096, 6, 41.0),
    ("11B", 128, 1, 54, 4096, 4, 35.5),
    ("12B", 128, 1, 58, 4096, 4, 33.0),
    ("13B", 128, 1, 62, 4096, 2, 21.0),
)
FIG4_BASELINE_DP = (
    ("1.16B", 128, 1, 24, 1920, 8, 39.5),
    ("1.38B", 128, 1, 40, 1536, 1, 18.0),
)
FIG2_ZERO = (
    ("1.5B", 400, 1, 48, 1600, 24, 30.0),
    ("8B", 400, 4, 72, 3072, 64, 37.0),
    ("40B", 400, 4, 88, 6144, 12, 36.0),
    ("60B", 400, 16, 132, 6144, 64, 36.5),
    ("80B", 400, 16, 100, 8192, 32, 37.5),
    ("100B", 400, 16, 125, 8192, 32, 38.5),
    ("120B", 400, 16, 150, 8192, 24, 28.0),
    ("140B", 400, 16, 175, 8192, 16, 27.0),
    ("170B", 400, 16, 212, 8192, 12, 21.0),
)
"""Figure 2's 20B point exists only in the SC20 appendix, without a plotted value: left out."""
FIG2_MEGATRON = (
    ("1.5B", 400, 2, 48, 1600, 16, 26.0),
    ("8B", 400, 8, 72, 3072, 8, 23.0),
    ("40B", 384, 32, 88, 6144, 4, 5.0),
    ("60B", 384, 64, 132, 6144, 4, 6.0),
    ("80B", 384, 128, 100, 8192, 4, 5.0),
    ("100B", 384, 128, 125, 8192, 2, 3.5),
    ("120B", 384, 128, 150, 8192, 2, 3.5),
    ("140B", 384, 128, 175, 8192, 2, 3.5),
    ("170B", 256, 256, 212, 8192, 2, 2.0),
)
FIG3_ZERO = (
    ("64 GPUs", 64, 16, 75, 8192, 16, 25.5),
    ("128 GPUs", 128, 16, 75, 8192, 48, 37.5),
    ("256 GPUs", 256, 16, 75, 8192, 48, 39.0),
    ("400 GPUs", 400, 16, 75, 8192, 64, 36.5),
)


@dataclass(frozen=True, kw_only=True)
class Run:
    """One bar or point of a paper figure: its configuration (docs/paper.md §1.9) and value
    (§1.8)."""

    figure: str
    series: str
    label: str
    gpus: int
    mp: int
    layers: int
    hidden: int
    batch: int
    """B: sequences per data-parallel rank per step (total batch / DP)."""
    stage: int
    paper_tflops: float
    """Read off the paper's plot: approximate (docs/paper.md §1.8)."""
    partitioned_activations: bool = False

    def __post_init__(self):
        if self.gpus % self.mp:
            raise ValueError(f"mp={self.mp} is not allowed: expected a divisor of gpus={self.gpus}")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r} is not allowed: expected 0, 1, 2 or 3")

    @property
    def dp(self) -> int:
        return self.gpus // self.mp


def _z(fig, label, gpus, mp, layers, hidden, batch, tflops, series="ZeRO"):
    return Run(figure=fig, series=series, label=label, gpus=gpus, mp=mp, layers=layers,
               hidden=hidden, batch=batch, stage=2, paper_tflops=tflops,
               partitioned_activations=mp > 1)  # fmt: skip


def _b(fig, label, gpus, mp, layers, hidden, batch, tflops, series):
    return Run(figure=fig, series=series, label=label, gpus=gpus, mp=mp, layers=layers,
               hidden=hidden, batch=batch, stage=0, paper_tflops=tflops)  # fmt: skip


FIGURE4 = tuple(_z("4", *r) for r in FIG4_ZERO) + tuple(
    _b("4", *r, "Baseline DP") for r in FIG4_BASELINE_DP
)
FIGURE2 = tuple(_z("2", *r) for r in FIG2_ZERO) + tuple(
    _b("2", *r, "Megatron") for r in FIG2_MEGATRON
)
FIGURE3 = tuple(_z("3", *r) for r in FIG3_ZERO)
"""The rows above as Runs: the paper's values (docs/paper.md §1.8), each with its configuration
(§1.9); paper_figures/performance/throughput_model.py fits Figure 4 and predicts Figures 2 and 3."""


# --- The stated hardware of Figures 2-4 (docs/paper.md §1.8, docs/perfmodel.md). -------------
@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The hardware of Figures 2-4, as stated (docs/perfmodel.md): DGX-2 nodes of V100s."""

    peak_flops: float = 125e12
    """V100 fp16 tensor-core peak, FLOP/s."""
    nvswitch_bytes_s: float = 300e9
    """DGX-2 NVSwitch bandwidth per GPU, bytes/s."""
    node_bytes_s: float = 800e9 / 8
    """Between nodes: 800 Gbps per node, bytes/s."""
    hbm_bytes_s: float = 900e9
    """V100 HBM2 bandwidth, bytes/s."""
    gpus_per_node: int = 16
    """A DGX-2 holds 16 V100s."""


HARDWARE = Hardware()


# --- The paper's rounding rules (docs/paper.md §1.2 and §1.3). ------------------------------------
def _decimal(x: float) -> Decimal:
    # The shortest repr is the decimal number the float stands for (41.25 -> "41.25"), so rounding
    # it half up gives what a person rounding the printed value gets.
    if not math.isfinite(x):
        raise ValueError(f"x={x!r} is not allowed: expected a finite number")
    return Decimal(repr(float(x)))


def paper_round(x: float, *, fine_below: float = 2.0) -> float:
    """Round a GB value the way Table 1 prints it (docs/paper.md §1.2).

    - Values of 100 or more are truncated to an integer: 4187.5 -> 4187, 2054.69 -> 2054.
    - Values under 100 are rounded half up to 1 decimal (41.25 -> 41.3), or to 2 decimals when
      under ``fine_below`` (1.875 -> 1.88, 0.1171875 -> 0.12). Figure 1 prints 1.875 as 1.9: that
      is ``fine_below=0``.

    Half up, not Python's round: round(41.25, 1) is 41.2 (half to even), the paper prints 41.3.
    """
    d = _decimal(x)
    if d >= 100:
        return float(d.to_integral_value(rounding=decimal.ROUND_DOWN))
    quantum = Decimal("0.01") if d < Decimal(repr(float(fine_below))) else Decimal("0.1")
    return float(d.quantize(quantum, rounding=decimal.ROUND_HALF_UP))


def table2_round(billions: float, mp: int) -> float:
    """Table 2's rule (docs/paper.md §1.3): the MP = 1 value, rounded half up to 0.1B, times MP.

    ``billions`` is the max model size at this MP, in billions; it is divided by MP first, so that
    7.64B at MP = 2 prints as 2 × 7.6 = 15.2B, not 15.3B.
    """
    per_mp = _decimal(billions) / mp
    return float(per_mp.quantize(Decimal("0.1"), rounding=decimal.ROUND_HALF_UP) * mp)


def format_number(x: float, decimals: int | None = None) -> str:
    """Print a number the way the paper does: no trailing ".0" (120, 7.5, 1.88, 4187).

    With ``decimals``, round half up to that many decimals first (for the T-valued cells).
    """
    d = _decimal(x)
    if decimals is not None:
        d = d.quantize(Decimal(1).scaleb(-decimals), rounding=decimal.ROUND_HALF_UP)
    text = format(d, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def format_size(billions: float, unit: str, decimals: int) -> str:
    """A Table 2 cell in the paper's style: "7.6B", or in T with the paper's decimals ("0.5T")."""
    if unit == "T":
        return format_number(billions / 1000, decimals) + "T"
    return format_number(billions) + "B"


# --- ZeRO++ (Wang et al., arXiv 2306.10209; docs/paper.md §3). ------------------------------------
ZEROPP_COLLECTIVES = ("forward all-gather", "backward all-gather", "gradient reduce-scatter")
ZEROPP_VOLUME = {"ZeRO-3": (1.0, 1.0, 1.0), "ZeRO++": (0.5, 0.0, 0.25)}
"""Cross-node volume per step of each collective, in units of M, the model's bytes in fp16 (the
volume table of ZeRO++'s blog and paper): 3M for ZeRO-3, 0.75M for ZeRO++."""
ZEROPP_TECHNIQUE = {"qwZ": (0, 0.5), "hpZ": (1, 0.0), "qgZ": (2, 0.25)}
"""Each technique: the collective it changes (index into ZEROPP_COLLECTIVES) and that
collective's cross-node volume with it, in M (qwZ: fp16 -> int8; hpZ: the backward gather stays
inside a node; qgZ: int4 all-to-all in two hops)."""
ZEROPP_HEADLINE = 2.16
"""The abstract: "up to 2.16x better throughput at 384 GPU scale"."""
ZEROPP_GPUS = 384
"""Every throughput bar below: 384 V100 GPUs (the blog's Figures 6-8)."""


@dataclass(frozen=True, kw_only=True)
class ZeroppBar:
    """One pair of bars of ZeRO++'s blog (docs/paper.md §3.2): TFLOP/s per GPU as printed above
    the bars (integers), ZeRO-3 beside ZeRO++, and the speedup printed on the arrow, if any."""

    figure: str
    model: str
    tokens_per_gpu: int
    gbps: int
    """Inter-node bandwidth per node: IB links x 100 Gbps."""
    zero3_tflops: float
    zeropp_tflops: float
    arrow: float | None = None


_BARS = (  # (figure, Gbps, tokens per GPU, model, ZeRO-3, ZeRO++, arrow)
    *(("6", 400, 1024, m, a, b, x) for m, a, b, x in (("18B", 25, 35, None),
      ("49B", 23, 36, None), ("91B", 23, 36, None), ("138B", 23, 36, 1.56))),
    *(("6", 400, 2048, m, a, b, x) for m, a, b, x in (("18B", 40, 53, None),
      ("49B", 36, 51, 1.41), ("91B", 36, 51, None), ("138B", 36, 50, None))),
    *(("7", 100, 1024, m, a, b, x) for m, a, b, x in (("18B", 14, 31, 2.21),
      ("49B", 11, 22, None), ("91B", 11, 22, None), ("138B", 11, 22, None))),
    *(("7", 100, 2048, m, a, b, x) for m, a, b, x in (("18B", 26, 46, 1.77),
      ("49B", 20, 38, None), ("91B", 20, 38, None), ("138B", 20, 38, None))),
    ("8", 200, 2048, "18B", 37, 50, None), ("8", 800, 2048, "18B", 47, 54, None),
    ("8", 200, 2048, "138B", 32, 48, None), ("8", 800, 2048, "138B", 48, 55, None),
)  # fmt: skip
ZEROPP_BARS = tuple(
    ZeroppBar(figure=f, gbps=g, tokens_per_gpu=t, model=m, zero3_tflops=a, zeropp_tflops=b, arrow=x)
    for f, g, t, m, a, b, x in _BARS
)
"""The blog's Figure 6 (4 IB links: 400 Gbps), 7 (1 link: 100 Gbps) and 8 (200 and 800 Gbps)."""
