"""What fits a per-rank memory budget: the paper's configurations C1-C5 (Table 3) at our scale.

Runs each configuration on one simulated rank (measure.fake_rank, measured by measure.resident):
the largest model within the budget (Figure 6), the peak of two fixed models (Figure 7), and the
largest batch and its step time (Figure 8). Used by paper_figures/zero_r_configs.py
(`python -m paper_figures --only zero_r_configs`). Without model parallelism C2 = C1, C4 = C3
and C5 is C3 with offload_activations (docs/zero_r.md); measurements are in
benchmarks/cpu-2core-2026-11.md and paper_figures/measured/zero_r_configs.json. With Setup.mp =
N_m > 1 the rank is (0, 0) of an N_d × N_m mesh and all five differ (paper_figures/zero_r_mp.py).

Legend: L transformer blocks, h hidden size, b batch per rank (one micro-batch), s sequence length,
N = N_d data-parallel ranks, B the per-rank budget in bytes.
"""

# [Note: measured, not modelled] Every number comes from one simulated rank running real steps;
# its *device peak* is the peak above its baseline over construction and the steps. On CUDA that is
# the allocator's peak. On a CPU-only machine the host is the device, so checkpoints kept "in host
# memory" stay in the process: their bytes, counted exactly by the engine (kind='offload'), are
# subtracted, since they are all held at once from their forward to the start of backward, where
# the peak lies. The largest model is searched for with measured probes; a linear fit of two small
# probes only guides where the search starts.
#
# [Note: the second step] A probe runs two steps and keeps the higher peak. The first step runs
# before anything a step leaves resident exists (optimizer states, what the allocator keeps of the
# step's buffers), so it peaks below the steady state; a one-step probe would accept a model that
# is over the budget from its second step on.

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from .fake_rank import measure_rank

__all__ = [
    "CONFIGURATIONS",
    "Configuration",
    "Setup",
    "device_peak",
    "largest_fitting",
    "largest_of",
    "probe",
    "step_time",
]


@dataclass(frozen=True, kw_only=True)
class Configuration:
    """One of the paper's configurations (Table 3) as engine options."""

    name: str
    paper: str
    """The paper's ZeRO-DP + ZeRO-R column, verbatim."""
    stage: int
    offload_activations: bool = False
    partition_activations: bool = False
    """P_a: the paper's C2, C4 and C5 (P_a+cpu with offload_activations). It acts only with
    model parallelism (Setup.mp > 1): with N_m = 1 it has nothing to partition."""
    same_as: str | None = None
    """Set where the configuration is identical to another one without model parallelism."""

    def options(self, setup: Setup) -> dict:
        """ZeroConfig fields beyond the stage: ZeRO-R's C_B and M_D and the checkpointing."""
        out = {
            "activation_checkpointing": True,
            "offload_activations": self.offload_activations,
            "bucket_elements": setup.bucket_elements,
            "chunk": setup.chunk,
        }
        if setup.contiguous_memory:
            out["contiguous_memory"] = True
        if setup.mp > 1 and self.partition_activations:
            out["partition_activations"] = True
        if not setup.deterministic:
            out["deterministic"] = False
        return out


CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration(name="C1", paper="P_os + C_B+M_D", stage=1),
    Configuration(
        name="C2", paper="P_os + C_B+M_D+P_a", stage=1, partition_activations=True, same_as="C1"
    ),
    Configuration(name="C3", paper="P_os+g + C_B+M_D", stage=2),
    Configuration(
        name="C4", paper="P_os+g + C_B+M_D+P_a", stage=2, partition_activations=True, same_as="C3"
    ),
    Configuration(
        name="C5",
        paper="P_os+g + C_B+M_D+P_a+cpu",
        stage=2,
        offload_activations=True,
        partition_activations=True,
    ),
)


def configurations(mp: int) -> tuple[Configuration, ...]:
    """C1-C5 at model-parallel degree N_m = mp: with N_m > 1 all five are distinct (P_a has
    N_m ranks to partition over), with N_m = 1 C2 and C4 are C1 and C3 (same_as)."""
    if mp == 1:
        return CONFIGURATIONS
    return tuple(replace(c, same_as=None) for c in CONFIGURATIONS)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The scaled-down experiment: a GPT of L blocks of width h on rank 0 of N, one step.

    The defaults keep the paper's proportions where they matter: batch 16 per rank (Figure 6's
    fixed batch), and checkpoint bytes per block about 1.2× a block's P_os model states and 2.3×
    its P_os+g states (the paper's 40B and 50B models at MP 16, N_d = 25: 1.2× and 2.1×)."""

    world_size: int = 64
    hidden: int = 64
    heads: int = 1
    seq: int = 128
    batch: int = 16
    vocab_size: int = 256
    chunk: int = 128
    """The clipping chunk: shards are padded to N·chunk elements per unit, so a small chunk
    keeps padding a small part of a block of 12h² parameters."""
    bucket_elements: int = 1 << 16
    """C_B: the fused reduction buffer's cap in elements."""
    contiguous_memory: bool = True
    """M_D: gradients and checkpoints in pre-allocated contiguous buffers."""
    malloc_mmap_threshold: int | None = 1 << 16
    """[Note: the CPU allocator] glibc's MALLOC_MMAP_THRESHOLD_ for the probes: tensors of at
    least this many bytes get their own mapping, returned to the system when freed. None keeps
    glibc's default (a threshold that rises to 32 MiB as blocks are freed), with which a step's
    freed temporaries stay in a heap that cannot shrink, and the RSS peak measures the heap's
    fragmentation as much as the configuration: at 145 blocks of C3, 192 MiB against 104 MiB
    with the threshold fixed. `fragmentation()` measures both."""
    budget_bytes: int = 128 * 2**20
    """B: what one rank may hold above its baseline at its peak."""
    device: str = "cpu"
    mp: int = 1
    """N_m: the probed rank is rank 0 = (0, 0) of an N_d × N_m mesh ([Note: simulated MP rank]
    in measure/fake_rank.py). heads and vocab_size must be multiples of it."""
    deterministic: bool = True
    """False: the fast mode (the MP sums by the backend's all-reduce, as Megatron's), whose
    transients are the paper's; True keeps the deterministic gather-based sums."""

    def __post_init__(self):
        names = ("world_size", "hidden", "heads", "seq", "batch", "vocab_size", "budget_bytes")
        for name in (*names, "mp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden}: must be a multiple of heads={self.heads}")
        for name in ("heads", "vocab_size"):
            if getattr(self, name) % self.mp:
                raise ValueError(
                    f"{name}={getattr(self, name)}: must be a multiple of mp={self.mp}"
                )

    def to_dict(self) -> dict:
        return asdict(self)


def device_peak(result: dict) -> int:
    """The rank's peak device bytes above its baseline ([Note: measured, not modelled])."""
    peak = result["rss_peak"]
    if not result["config"]["device"].startswith("cuda"):
        peak -= result["activation_host_bytes"]
    return peak


@dataclass
class Probe:
    """One measured step of configuration `name` with L blocks at batch b."""

    name: str
    layers: int
    batch: int
    num_params: int
    device_peak: int
    rss_peak: int
    activation_host_bytes: int
    model_states: int
    step_seconds: list[float] = field(default_factory=list)
    mp_traffic: dict[str, int] = field(default_factory=dict)
    """Elements sent per MP phase over the probe's steps (kind "mp"; empty without MP)."""

    def fits(self, budget: int) -> bool:
        return self.device_peak <= budget


def probe(
    setup: Setup, conf: Configuration, *, layers: int, batch: int | None = None, steps: int = 2
) -> Probe:
    """Measure `steps` steps of `conf` on a GPT of `layers` blocks (fresh process, fake group);
    two by default, the first to reach the steady state ([Note: the second step])."""
    b = setup.batch if batch is None else batch
    got = measure_rank(
        check_fits=False,
        params=0,  # unused: the shape is given
        world_size=setup.world_size,
        rank=0,
        stage=conf.stage,
        steps=steps,
        seq=setup.seq,
        batch=b,
        vocab_size=setup.vocab_size,
        device=setup.device,
        shape={"n_layer": layers, "n_embd": setup.hidden, "n_head": setup.heads},
        options=conf.options(setup),
        **({"mp": setup.mp} if setup.mp > 1 else {}),
        env=None
        if setup.malloc_mmap_threshold is None
        else {"MALLOC_MMAP_THRESHOLD_": str(setup.malloc_mmap_threshold)},
    )["result"]
    return Probe(
        name=conf.name,
        layers=layers,
        batch=b,
        num_params=got["config"]["num_params"],
        device_peak=device_peak(got),
        rss_peak=got["rss_peak"],
        activation_host_bytes=got["activation_host_bytes"],
        model_states=got["engine_model_states"],
        step_seconds=got["step_seconds"],
        mp_traffic=got.get("mp_traffic", {}),
    )


def largest_fitting(fits: Callable[[int], bool], *, guess: int, resolution: float = 0.01) -> int:
    """The largest x >= 1 with fits(x), for fits monotone (True up to some x, then False).

    Starts at `guess` (a model's prediction), widens a bracket geometrically (4%, 8%, ... of the
    guess) until it holds the boundary, then bisects until the bracket is at most
    max(1, resolution·x) wide. Returns 0 when not even x = 1 fits. Each fits(x) is one probe,
    so the count of calls is what a search costs; a good guess makes it about log2(4%/1%) + 2."""
    if guess < 1:
        raise ValueError(f"guess={guess}: must be >= 1")
    lo, hi = 0, None  # fits(lo) (0 fits vacuously), not fits(hi)
    x, widen = guess, max(1, math.ceil(0.04 * guess))
    if fits(x):
        lo = x
        while hi is None:
            x = lo + widen
            if fits(x):
                lo, widen = x, 2 * widen
            else:
                hi = x
    else:
        hi = x
        while lo == 0 and hi > 1:
            x = max(1, hi - widen)
            if fits(x):
                lo = x
            else:
                hi, widen = x, 2 * widen
        if lo == 0:
            return 0
    while hi - lo > max(1, int(resolution * lo)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_of(values, fits: Callable[[int], bool]):
    """The largest of the ascending `values` with fits(value), for fits monotone (True up to
    some value, then False), or None when not even the first fits. Bisects the list: about
    log2(len(values)) + 1 calls, each one probe."""
    values = list(values)
    if values != sorted(set(values)):
        raise ValueError(f"values={values!r}: must be strictly ascending")
    lo, hi = -1, len(values)  # values[lo] fits (lo = -1: nothing known to fit), values[hi] not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            lo = mid
        else:
            hi = mid
    return None if lo < 0 else values[lo]


def linear_guess(small: Probe, large: Probe, budget: int) -> int:
    """Blocks at which the line through two probes' device peaks reaches the budget."""
    slope = (large.device_peak - small.device_peak) / (large.layers - small.layers)
    if slope <= 0:
        return large.layers
    return max(1, int((budget - small.device_peak) / slope) + small.layers)


def compare(
    setup: Setup,
    *,
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    throughput: bool = True,
    fragmentation_probes: bool = True,
    resolution: float = 0.01,
    log=None,
) -> dict:
    """The C1-C5 comparison at our scale, every number measured (one probe per (C, L, b)).

    - Figure 6: each configuration's largest model (blocks) within the budget at the setup's
      batch, by largest_fitting, guided by the line through probes at 8 and 32 blocks.
    - Figure 7: each configuration's device peak on two fixed models: A, C1's largest, and B,
      half-way between C3's largest and C5's (over the budget for C1 and C3, like the paper's
      100B model, which had no bars for C1-C3).
    - Figure 8: on models A and B, each configuration's largest batch in `batches` that fits
      (largest_of: a bisection of the list), and its step time there (step_time of a fresh
      three-step probe; collectives on the fake group cost nothing, so this is one rank's
      compute, copies and optimizer). Skipped when `throughput` is False.

    Returns plain dicts (JSON-ready) with every probe."""
    say = log or (lambda _msg: None)
    probes = _Probes(setup, say)
    confs = configurations(setup.mp)
    distinct = [c for c in confs if c.same_as is None]
    largest = _largest_models(probes, distinct, resolution)
    # B: beyond C3's largest, as the paper's 100B; with MP, where C4 and C5 fit as there
    other = "C4" if setup.mp > 1 else "C5"
    models = {
        "A": largest["C1"]["layers"],
        "B": (largest["C3"]["layers"] + largest[other]["layers"]) // 2,
    }
    memory = {
        label: {c.name: asdict(probes(c, layers)) for c in distinct}
        for label, layers in models.items()
    }
    timed = _largest_batches(probes, distinct, models, batches) if throughput else {}
    return {
        "setup": setup.to_dict(),
        "fragmentation": fragmentation(setup, layers=largest["C3"]["layers"], log=say)
        if fragmentation_probes
        else [],
        "configurations": [asdict(c) for c in confs],
        "largest": largest,
        "models": models,
        "memory": memory,
        "throughput": timed,
        "probes": [asdict(p) for p in probes.taken.values()],
    }


class _Probes:
    """compare's probes, each (C, L, b) measured once and said as it is, kept in the order
    taken; calling it gives the probe of configuration `conf` at `layers` blocks and `batch`
    (the setup's batch if None)."""

    def __init__(self, setup: Setup, say):
        self.setup, self.say, self.budget = setup, say, setup.budget_bytes
        self.taken: dict[tuple, Probe] = {}

    def __call__(self, conf: Configuration, layers: int, batch: int | None = None) -> Probe:
        key = (conf.name, layers, self.setup.batch if batch is None else batch)
        if key not in self.taken:
            self.taken[key] = p = probe(self.setup, conf, layers=layers, batch=batch)
            self.say(
                f"{conf.name} L={layers} b={p.batch}: device peak {p.device_peak / 2**20:.1f} MiB "
                f"({'fits' if p.fits(self.budget) else 'over'} {self.budget / 2**20:.0f} MiB)"
            )
        return self.taken[key]


def _largest_models(probes: _Probes, distinct: list, resolution: float) -> dict[str, dict]:
    """Figure 6: each configuration's largest model (blocks) within the budget, by
    largest_fitting, guided by the line through probes at 8 and 32 blocks."""
    largest: dict[str, dict] = {}
    for conf in distinct:
        small, large = probes(conf, 8), probes(conf, 32)
        guess = linear_guess(small, large, probes.budget)
        layers = largest_fitting(
            lambda x, c=conf: probes(c, x).fits(probes.budget), guess=guess, resolution=resolution
        )
        largest[conf.name] = {
            "layers": layers,
            "num_params": probes(conf, layers).num_params if layers else 0,
            "guess": guess,
        }
    return largest


def _largest_batches(probes: _Probes, distinct: list, models: dict, batches) -> dict[str, dict]:
    """Figure 8: on each model, each configuration's largest batch in `batches` that fits and a
    fresh three-step probe there ([Note: step times]); None where no batch fits."""
    timed: dict[str, dict] = {}
    for label, layers in models.items():
        timed[label] = {}
        for conf in distinct:  # fits is monotone in the batch: bisect the list
            b = largest_of(
                batches,
                lambda b, c=conf, n=layers: probes(c, n, batch=b).fits(probes.budget),
            )
            # timed on a probe of its own: [Note: step times]
            setup = probes.setup
            best = None if b is None else probe(setup, conf, layers=layers, batch=b, steps=3)
            timed[label][conf.name] = None if best is None else asdict(best)
            if best is not None:
                probes.say(f"{conf.name} L={layers} b={b}: step {step_time(asdict(best)):.2f} s")
    return timed


def step_time(p: dict) -> float:
    """[Note: step times] A Figure 8 probe's step time: the median of its steps after the
    first. The first step also creates the optimizer states and the arenas' contents; one
    sample of a few seconds on a shared machine can be off by 2x, so Figure 8 times a fresh
    three-step probe at the chosen batch rather than reusing a memory probe's second step."""
    later = sorted(p["step_seconds"][1:])
    if not later:
        raise ValueError(f"step_seconds={p['step_seconds']!r}: a timed probe needs >= 2 steps")
    mid = len(later) // 2
    return later[mid] if len(later) % 2 else (later[mid - 1] + later[mid]) / 2


def fragmentation(setup: Setup, *, layers: int, log=None) -> list[dict]:
    """C3's device peak at `layers` blocks with M_D on and off, under glibc's default allocator
    and with the setup's fixed mmap threshold ([Note: the CPU allocator]): four probes."""
    from dataclasses import replace

    c3 = next(c for c in CONFIGURATIONS if c.name == "C3")
    rows = []
    for threshold in (None, setup.malloc_mmap_threshold or 1 << 16):
        for md in (False, True):
            here = replace(setup, malloc_mmap_threshold=threshold, contiguous_memory=md)
            p = probe(here, c3, layers=layers)
            rows.append(
                {
                    "malloc_mmap_threshold": threshold,
                    "contiguous_memory": md,
                    "device_peak": p.device_peak,
                    "model_states": p.model_states,
                }
            )
            if log:
                log(
                    f"C3 L={layers} M_D={md} threshold={threshold}: {p.device_peak / 2**20:.1f} MiB"
                )
    return rows
