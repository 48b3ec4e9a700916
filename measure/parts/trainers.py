"""The systems a benchmark times, inside one rank: our engine and the peers (DDP, FSDP2,
DeepSpeed), each a Trainer whose step is forward + backward + update; the workloads they run
(BenchModel, MODELS) and the benchmark's configuration (BenchConfig), all importable from
measure.bench. measure/bench.py drives them over ranks and repeats; measure/bench_mp.py adds the
model-parallel systems.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.optim import Hyper
from zero.common import cli
from zero.config import WATCHDOG_MODES, ZeroConfig, decay_matrices_only
from zero.loop import train_steps
from zero.mp.gpt import check_split
from zero.ranks.launch import MAX_TIMEOUT_S, check_timeout
from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

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


# ---------------------------------------------------------------------------------------------
# Inside a rank: the systems


def rank_device() -> torch.device:
    # Forked local ranks are gloo on CPU; under torchrun with CUDA the group is NCCL and
    # zero.ranks.launch.init_from_env has made this rank's GPU current.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA returns before the kernels finish


def torch_param_groups(model: torch.nn.Module, cfg: BenchConfig) -> list[dict]:
    """torch.optim's parameter groups for the same split as our ZeroConfig: decay on matrices."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (decay if decay_matrices_only(name, p) == 0 else plain).append(p)
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


def zero_config(stage: int, deterministic: bool, n: int, cfg: BenchConfig) -> ZeroConfig:
    """Our engine's configuration for one of OURS at world size n (M = N, fp32, AdamW)."""
    return ZeroConfig(
        stage=stage,
        precision="fp32",
        deterministic=deterministic,
        optimizer="adamw",
        groups=(Hyper(lr=cfg.lr, weight_decay=cfg.weight_decay), Hyper(lr=cfg.lr)),
        group_of=decay_matrices_only,
        micro_batches=n,
        units=tuple(f"transformer.h.{i}" for i in range(cfg.workload.gpt.n_layer)),
        overlap=True,
        watchdog=cfg.watchdog,
        release_grads=cfg.release_grads,
    )


class Phases:
    """Seconds per named phase, summed over the calls of one step (profiling only)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.device = torch.device("cpu")

    @contextlib.contextmanager
    def timed(self, name: str):
        """Time the block under `name` (a ZeroEngine's phase hook)."""
        sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.seconds[name] += time.perf_counter() - t0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                self.seconds[name] += time.perf_counter() - t0

        return timed


class Trainer:
    """One system on one rank: step() = forward + backward + optimizer update of this rank's
    micro-batch of the next data step. forward/backward/update are attributes, not methods, so
    that profiling can wrap them on the instance."""

    def __init__(self, name: str, rank: int, n: int, cfg: BenchConfig):
        self.name, self.rank, self.n, self.cfg = name, rank, n, cfg
        self.device = rank_device()
        self.data_step = 0  # every system walks the same data steps in the same order

    def model(self) -> GPT:
        return GPT(self.cfg.workload.gpt, device=self.device, seed=self.cfg.seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.cfg.workload
        # micro-batch j = rank of the step (M = N, one micro-step): the rank's own, as in train
        x, y = gpt_microbatches(
            w.gpt,
            seed=self.cfg.seed,
            data_step=self.data_step,
            count=self.n,
            batch_size=w.batch_size,
        )[self.rank]
        return x.to(self.device), y.to(self.device)

    def step(self, batch) -> float:
        _, loss = self.forward(*batch)
        self.backward(loss)
        self.update()
        self.data_step += 1
        return float(loss.detach())  # this rank's loss; the caller averages over ranks

    def instrument(self, ph: Phases) -> contextlib.AbstractContextManager:
        """Wrap the phases in timers for the duration of the context."""
        return patched([(self, k, ph.wrap(k, getattr(self, k))) for k in PEER_PHASES])

    def options(self) -> dict:
        """The system's own settings, for the record's config."""
        return {}


PEER_PHASES = ("forward", "backward", "update")


@contextlib.contextmanager
def patched(patches):
    """Set (object, attribute, value) for the duration, then restore (or delete) each one."""
    saved = [(obj, k, obj.__dict__.get(k, _MISSING)) for obj, k, _ in patches]
    try:
        for obj, k, value in patches:
            setattr(obj, k, value)
        yield
    finally:
        for obj, k, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, k)
            else:
                setattr(obj, k, old)


_MISSING = object()


class Ours(Trainer):
    def __init__(self, name, rank, n, cfg):
        super().__init__(name, rank, n, cfg)
        self.stage, self.deterministic = int(name[6]), name.endswith("-det")
        from zero.engine import ZeroEngine

        self.config = zero_config(self.stage, self.deterministic, n, cfg)
        self.engine = ZeroEngine(self.model(), self.config)

    def step(self, batch) -> float:
        # The one training loop (zero.workloads.train), one step; M = N makes micro-batch j = rank
        # ours.
        (result,) = train_steps(self.engine, lambda step, j: batch, 1, start_step=self.data_step)
        self.data_step += 1
        return result.loss  # already the global mean; averaging over ranks keeps it

    def instrument(self, ph: Phases) -> contextlib.AbstractContextManager:
        # the engine names its phases itself ([Note: named phases], zero/hooks.py)
        return patched([(self.engine, "phase", ph.timed)])

    def options(self) -> dict:
        c = self.config
        return {
            "stage": c.stage,
            "deterministic": c.deterministic,
            "units": list(c.units),
            "overlap": c.overlap,
            "chunk": c.chunk,
            "clip_norm": c.clip_norm,
            "release_grads": c.releases_grads(self.device),
        }


class TorchPeer(Trainer):
    """DDP, ZeroRedundancyOptimizer + DDP, or FSDP2, each with torch.optim.AdamW's defaults."""

    def __init__(self, name, rank, n, cfg):
        super().__init__(name, rank, n, cfg)
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = self.model()
        ids = [self.device.index] if self.device.type == "cuda" else None
        if name == "ddp":
            self.module = DDP(model, device_ids=ids)
            self.opt = torch.optim.AdamW(torch_param_groups(model, cfg), lr=cfg.lr)
        elif name == "zero-redundancy":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.module = DDP(model, device_ids=ids)
            self.opt = ZeroRedundancyOptimizer(
                torch_param_groups(model, cfg), optimizer_class=torch.optim.AdamW, lr=cfg.lr
            )
        else:
            from torch.distributed.fsdp import fully_shard

            mesh, reshard = _mesh(self.device, n), name == "fsdp2-reshard"
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            self.module = model
            # after fully_shard: the parameters are DTensor shards, ndim as before
            self.opt = torch.optim.AdamW(torch_param_groups(model, cfg), lr=cfg.lr)
        self.forward = self.module
        self.backward = lambda loss: loss.backward()
        self.update = self._update

    def _update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def options(self) -> dict:
        if self.name.startswith("fsdp2"):
            return {
                "fully_shard": "every block and the root",
                "reshard_after_forward": self.name == "fsdp2-reshard",
            }
        out = {"ddp": "torch defaults (bucket_cap_mb 25)"}
        if self.name == "zero-redundancy":
            out["optimizer_class"] = "torch.optim.AdamW"
        return out


_MESHES: dict = {}


def _mesh(device: torch.device, n: int):
    # One mesh per worker: init_device_mesh would otherwise make a new group per FSDP2 build.
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, n)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (n,))
    return _MESHES[key]


class DeepSpeedPeer(Trainer):
    def __init__(self, name, rank, n, cfg):
        super().__init__(name, rank, n, cfg)
        import deepspeed  # imported by prepare_deepspeed on every rank already

        model = self.model()
        opt = torch.optim.AdamW(torch_param_groups(model, cfg), lr=cfg.lr)
        self.ds_config = {
            "train_micro_batch_size_per_gpu": cfg.workload.batch_size,
            "train_batch_size": cfg.workload.batch_size * n,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(name[-1])},
            "zero_allow_untested_optimizer": True,
            # DeepSpeed clips the global norm to 1.0 by default, which every other system here
            # does not: on the anchor model it scaled the first step's gradient by 0.64.
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,  # its progress lines would land inside timed steps
        }
        if cfg.deepspeed_bucket is not None:
            self.ds_config["zero_optimization"] |= {
                "reduce_bucket_size": cfg.deepspeed_bucket,
                "allgather_bucket_size": cfg.deepspeed_bucket,
            }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=self.ds_config)
        self.forward, self.backward, self.update = (
            self.engine,
            self.engine.backward,
            self.engine.step,
        )

    def options(self) -> dict:
        import deepspeed

        return {"deepspeed": deepspeed.__version__, "ds_config": self.ds_config}
