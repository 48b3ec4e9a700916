"""measure.bench's configuration: the workloads it can time (BenchModel, MODELS: [Note: bench
model sizes]), what to time and how often (BenchConfig, every field an option of
`python -m measure.bench`), and the model-parallel systems' mesh (layout, check_config). All
importable from measure.bench.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero.common import cli
from zero.config import WATCHDOG_MODES
from zero.mp.gpt import check_split
from zero.ranks.launch import MAX_TIMEOUT_S, check_timeout
from zero.workloads.models import GPTConfig

from .bench_systems import DEFAULT_SYSTEMS, MP_SYSTEMS, SYSTEMS, mp_layout

MALLOC_MODES = ("system", "keep")
"""BenchConfig.malloc: glibc's defaults, or [Note: malloc keeps freed blocks]."""


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """A workload: the GPT, its micro-batch size, and how long a run of it is by default."""

    gpt: GPTConfig
    """The model (zero.workloads.models.GPT); sequences are gpt.block_size tokens long."""
    batch_size: int
    """B: sequences per micro-batch; each rank runs one micro-batch per step (M = N)."""
    repeats: int = 5
    """BenchConfig.repeats when the command leaves it out."""
    steps: int = 6
    """BenchConfig.steps when the command leaves it out."""


# [Note: bench model sizes] Our GPT ties the output layer to the token embedding, so   Ψ = V·d + T·d
# + L·(12d² + 13d) + 2d (per block: qkv 3d² + 3d, attention projection d² + d, MLP 8d² + 5d, two
# LayerNorms 4d; then the final LayerNorm). Vocabulary 2048 and sequence 128 at every size but the
# test's: the sizes differ in depth and width only, so a larger one weighs communication and the
# optimizer (Ψ) more against the activations (B·T·d·L).
MODELS = {
    # The default GPTConfig, Ψ = 120,576: a step takes milliseconds, for tests.
    "small": BenchModel(gpt=GPTConfig(), batch_size=4),
    # The anchor GPT that the targets (step time ÷ DDP's) were measured on:
    # 4 layers, d 256, 4 heads: Ψ = 524,288 + 32,768 + 4·789,760 + 512 = 3,716,608 (3.72M).
    "anchor": BenchModel(
        gpt=GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256),
        batch_size=8,
        repeats=8,
    ),
    # Model parallelism needs N_m | n_head: "small" with 4 heads (tests), and a size between
    # small and anchor: 2 layers, d 128, 4 heads: Ψ = 262,144 + 16,384 + 2·198,272 + 256 = 675,328.
    "small-mp": BenchModel(gpt=GPTConfig(n_head=4), batch_size=4),
    "mini": BenchModel(
        gpt=GPTConfig(vocab_size=2048, block_size=128, n_layer=2, n_head=4, n_embd=128),
        batch_size=8,
        repeats=8,
    ),
    # 8 layers, d 512, 8 heads: Ψ = 1,048,576 + 65,536 + 8·3,152,384 + 1,024 = 26,334,208.
    "mid": BenchModel(
        gpt=GPTConfig(vocab_size=2048, block_size=128, n_layer=8, n_head=8, n_embd=512),
        batch_size=8,
        repeats=4,
        steps=3,
    ),
    # 14 layers, d 768, 12 heads: Ψ = 1,572,864 + 98,304 + 14·7,087,872 + 1,536 = 100,902,912.
    "large": BenchModel(
        gpt=GPTConfig(vocab_size=2048, block_size=128, n_layer=14, n_head=12, n_embd=768),
        batch_size=8,
        repeats=3,
        steps=2,
    ),
}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to time, and how often."""

    model: str = "anchor"
    """A key of MODELS: 'small' (seconds, for tests), 'anchor' (3.72M parameters), 'mid'
    (26.3M) or 'large' (101M); [Note: bench model sizes]."""
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    """Which of SYSTEMS to time; the ratios need 'ddp' (×DDP) and the fast stage (×fast).
    The model-parallel ones (MP_SYSTEMS) need N_m | N and N_m | n_head, vocab_size."""
    world_sizes: tuple[int, ...] = (2, 4)
    """N values, each >= 1; one pool of N ranks each, all systems built in it. At N = 1 there is
    no communication: the step is the systems' software overhead around the same compute."""
    repeats: int | None = None
    """Rounds of [Note: alternating repeats]; the spread is over repeats × steps samples.
    None: the model's own default (BenchModel.repeats: fewer at the larger sizes)."""
    steps: int | None = None
    """Timed steps per repeat (each system, each round); None: the model's (BenchModel.steps)."""
    warmup: int = 1
    """Untimed steps at the start of every repeat (two more after building each system)."""
    lr: float = 1e-3
    """AdamW learning rate, every parameter."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (ndim >= 2); biases and norms get none."""
    seed: int = 0
    """Seed of the parameters (zero.workloads.models init) and of the data (gpt_microbatches)."""
    quiet_cores: float = 0.3
    """Cores that other processes may use during a repeat before it counts as disturbed and is
    timed again ([Note: disturbed repeats]); before each repeat the driver also waits until
    they use at most this much. Measured on Linux with local ranks; elsewhere never applied."""
    retries: int = 3
    """Times a disturbed repeat is timed again; the last attempt is kept whatever its noise."""
    quiet_wait_s: float = 120.0
    """Longest wait for a quiet machine before a repeat (it then runs anyway, recorded)."""
    profile: bool = False
    """After timing, time each system's phases over `steps` more steps (module docstring)."""
    memory: bool = True
    """After timing, build each system once more and measure its peak tensor bytes per rank over
    MEMORY_STEPS steps (measure/tensor_memory.py says what that sees); --no-memory skips it."""
    watchdog: str = "calls"
    """Our engine's ZeroConfig.watchdog ('calls', 'collectives' or 'off'): a run with 'off'
    beside one with the default measures what the watchdog's checks cost."""
    release_grads: bool | None = None
    """Our engine's ZeroConfig.release_grads: None, its default by device (kept on a CPU, released
    on CUDA); True releases each unit's gradient buffer after every update (a lower peak, at the
    cost of page faults every step on a CPU), False keeps it."""
    malloc: str = "system"
    """How glibc treats freed blocks in the ranks, for every system alike: 'system' leaves its
    defaults; 'keep' fixes its thresholds so that blocks up to 32 MiB stay in the heap for reuse
    instead of returning through page faults every step ([Note: malloc keeps freed blocks] in
    measure/resident.py; what --release-grads costs on a CPU depends on it). CPU ranks only."""
    timeout_s: float = 900.0
    """Seconds one call into the ranks may take before they are killed (a hang is an error)."""
    note: str = ""
    """A remark kept in every record's config (e.g. that the machine was loaded)."""
    group: str = ""
    """A name for a run of some of the systems, where all of them do not fit in memory at once
    (`large`): the ratios pair records of the same group and N only, so each group needs `ddp`
    and each deterministic stage its fast one ([Note: system groups] in measure/bench_table.py).
    Runs of different groups merge with `--from-json a.json b.json --json all.json`."""
    deepspeed_bucket: int | None = None
    """DeepSpeed's `reduce_bucket_size` and `allgather_bucket_size`, in elements. None: its
    defaults, 5·10⁸ elements, whose reduce bucket is one fp32 buffer of 1.9 GiB allocated whole at
    any model size (the peak of DeepSpeed's every stage here); 6553600 (25 MiB of fp32, DDP's
    bucket_cap_mb) sizes it like the other systems' buckets for a memory comparison."""

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: allowed are {tuple(MODELS)}")
        for name in ("repeats", "steps"):  # frozen: set once, before anyone reads it
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(MODELS[self.model], name))
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad or not self.systems or len(set(self.systems)) != len(self.systems):
            raise ValueError(f"systems={self.systems!r}: allowed are distinct names from {SYSTEMS}")
        if not self.world_sizes or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.world_sizes
        ):
            raise ValueError(f"world_sizes={self.world_sizes!r}: allowed are integers >= 1")
        for name, low in (("repeats", 1), ("steps", 1), ("warmup", 0), ("retries", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: allowed are integers >= {low}")
        for name, low in (("lr", None), ("weight_decay", 0), ("quiet_cores", 0)):
            value = getattr(self, name)  # finite first: inf and nan pass a range check
            if not cli.is_real(value) or (value <= 0 if low is None else value < low):
                allowed = "> 0" if low is None else f">= {low}"
                raise ValueError(f"{name}={value!r}: allowed are finite values {allowed}")
        if not (cli.is_real(self.quiet_wait_s) and 0 <= self.quiet_wait_s <= MAX_TIMEOUT_S):
            raise ValueError(
                f"quiet_wait_s={self.quiet_wait_s!r}: allowed are seconds in [0, {MAX_TIMEOUT_S}]"
            )
        check_timeout(self.timeout_s)
        b = self.deepspeed_bucket
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"deepspeed_bucket={b!r}: allowed are None or integers >= 1")
        if self.malloc not in MALLOC_MODES:
            raise ValueError(f"malloc={self.malloc!r}: allowed are {MALLOC_MODES}")
        if self.watchdog not in WATCHDOG_MODES:
            raise ValueError(f"watchdog={self.watchdog!r}: allowed are {WATCHDOG_MODES}")
        if any(s in MP_SYSTEMS for s in self.systems):
            check_config(self)

    @property
    def workload(self) -> BenchModel:
        return MODELS[self.model]


def layout(name: str, n: int) -> tuple[int, int, int, bool]:
    """(stage, N_d, N_m, deterministic) of MP system `name` in a world of n ranks."""
    stage, mp, det = mp_layout(name)
    mp = n if mp is None else mp
    if n % mp:
        raise ValueError(f"world_sizes: N={n} for {name}: allowed are multiples of N_m={mp}")
    return stage, n // mp, mp, det


def check_config(cfg) -> None:
    """Refuse a BenchConfig whose MP systems cannot run: N not a multiple of N_m (naming
    world_sizes), or a GPT that N_m cannot split (naming n_head or vocab_size)."""
    for name in cfg.systems:
        if name not in MP_SYSTEMS:
            continue
        for n in cfg.world_sizes:
            _, _, mp, _ = layout(name, n)
            check_split(cfg.workload.gpt, mp)
