"""python -m measure.bench: one training step of our stages 0-3 timed beside torch DDP,
ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO-1/2/3, same GPT, same data, same N, one run,
then each system's peak tensor bytes per rank. DeepSpeed runs where it is installed
(`DS_BUILD_OPS=0 pip install deepspeed`; on a CPU the benchmark sets DS_ACCELERATOR=cpu); where
it is not, its rows say "not installed" and the other systems run.

    python -m measure.bench --model anchor --world-sizes 2 4 --repeats 8 --steps 6 --json b.json
    python -m measure.bench --model mid --world-sizes 2 4 --json mid.json   # 26.3M, fewer steps
    python -m measure.bench --from-json b.json --markdown          # the tables again, from records
    torchrun --standalone --nproc-per-node 1 -m measure.bench --world-sizes 1   # one GPU, NCCL

Systems (SYSTEMS): zero-s{0..3} (fast mode), zero-s{0..3}-det (deterministic), ddp,
zero-redundancy, fsdp2, fsdp2-reshard, deepspeed-s{1,2,3}; fp32 AdamW, M = N. Model parallelism
(named only, never by default): megatron-lm, zero-s{0..3}-mp{1,2,4}[-det] (measure/bench_mp.py).
Memory (--memory, on by default; [Note: the memory pass]): peak MiB per rank, measured by
measure/tensor_memory.py, beside the analytic model states of the system's sharding level
(zero/memory.py) and the activations autograd saves; ×DDP and ×best peer at the same level;
for ours, the bound derived from the model's shape ([Note: the memory bound] in
measure/bench_table.py) and the peak over it.
Legend: N ranks; ms/step the slowest rank's step, median over repeats × steps (IQR its spread);
×DDP / ×fast / ×s2 / ×<peer> ratios of medians; MFU model FLOPs ÷ step time ÷ measured peak
(measure/mfu.py); Δloss the largest loss difference from DDP. Every system, column and rule is
described in benchmarks/cpu-2core-2026-11.md, section "How the step time is taken".
"""

# [Note: alternating repeats] Machine noise comes in bursts of seconds, so repeats go round-robin
# over the systems (repeat 1 of every system, then repeat 2, ...), each round starting one system
# further along; every system lives in the same worker processes, built once. A barrier lines the
# ranks up before each timed step, whose time is the slowest rank's. Speed is reported, never
# asserted: tests check the records.
#
# [Note: disturbed repeats] With local ranks on Linux the driver measures how many cores *other*
# processes used during each repeat (/proc/stat's busy time minus our ranks' and our own). A repeat
# during which they used more than quiet_cores is timed again (up to `retries` times), and before
# each repeat the driver waits (at most quiet_wait_s) for a quiet machine. Every repeat's figure is
# kept in its record ("other_cores"). This drops disturbed samples; it never selects fast ones.

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
import traceback
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from reference.optim import Hyper
from zero import cli
from zero import engine as engine_module
from zero.config import WATCHDOG_MODES, ZeroConfig, decay_matrices_only
from zero.launch import MAX_TIMEOUT_S, check_timeout
from zero.models import GPT, GPTConfig, gpt_microbatches
from zero.results import make_record, provenance, read_json, write_json
from zero.train import train_steps

from . import mfu, tensor_memory
from .bench_table import (
    DEFAULT_SYSTEMS,
    MP_SYSTEMS,
    OURS,
    SHARDING_LEVEL,
    SYSTEMS,
    add_ratios,
    analytic_states_bytes,
    format_all,
    merge_records,
)

KIND = "bench.step_time"
"""The results-record kind (zero.results) of one (system, N) measurement."""
MALLOC_MODES = ("system", "keep")
"""BenchConfig.malloc: glibc's defaults, or [Note: malloc keeps freed blocks]."""

_REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """A workload: the GPT, its micro-batch size, and how long a run of it is by default."""

    gpt: GPTConfig
    """The model (zero.models.GPT); sequences are gpt.block_size tokens long."""
    batch_size: int
    """B: sequences per micro-batch; each rank runs one micro-batch per step (M = N)."""
    repeats: int = 5
    """BenchConfig.repeats when the command leaves it out."""
    steps: int = 6
    """BenchConfig.steps when the command leaves it out."""


# [Note: bench model sizes] Our GPT ties the output layer to the token embedding, so
#   Ψ = V·d + T·d + L·(12d² + 13d) + 2d
# (per block: qkv 3d² + 3d, attention projection d² + d, MLP 8d² + 5d, two LayerNorms 4d; then
# the final LayerNorm). Vocabulary 2048 and sequence 128 at every size but the test's: the sizes
# differ in depth and width only, so a larger one weighs communication and the optimizer (Ψ)
# more against the activations (B·T·d·L).
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
    """Seed of the parameters (zero.models init) and of the data (gpt_microbatches)."""
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
            from .bench_mp import check_config

            check_config(self)

    @property
    def workload(self) -> BenchModel:
        return MODELS[self.model]


# ---------------------------------------------------------------------------------------------
# Inside a rank: the systems


def _device() -> torch.device:
    # Forked local ranks are gloo on CPU; under torchrun with CUDA the group is NCCL and
    # zero.launch.init_from_env has made this rank's GPU current.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
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


class _Phases:
    """Seconds per named phase, summed over the calls of one step (profiling only)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.device = torch.device("cpu")

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            _sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(self.device)
                self.seconds[name] += time.perf_counter() - t0

        return timed


class _Trainer:
    """One system on one rank: step() = forward + backward + optimizer update of this rank's
    micro-batch of the next data step. forward/backward/update are attributes, not methods, so
    that profiling can wrap them on the instance."""

    def __init__(self, name: str, rank: int, n: int, cfg: BenchConfig):
        self.name, self.rank, self.n, self.cfg = name, rank, n, cfg
        self.device = _device()
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

    def instrument(self, ph: _Phases) -> contextlib.AbstractContextManager:
        """Wrap the phases in timers for the duration of the context."""
        return _patched([(self, k, ph.wrap(k, getattr(self, k))) for k in _PEER_PHASES])

    def options(self) -> dict:
        """The system's own settings, for the record's config."""
        return {}


_PEER_PHASES = ("forward", "backward", "update")


@contextlib.contextmanager
def _patched(patches):
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


class _Ours(_Trainer):
    def __init__(self, name, rank, n, cfg):
        super().__init__(name, rank, n, cfg)
        self.stage, self.deterministic = int(name[6]), name.endswith("-det")
        from zero.engine import ZeroEngine

        self.config = zero_config(self.stage, self.deterministic, n, cfg)
        self.engine = ZeroEngine(self.model(), self.config)

    def step(self, batch) -> float:
        # The one training loop (zero.train), one step; M = N makes micro-batch j = rank ours.
        (result,) = train_steps(self.engine, lambda step, j: batch, 1, start_step=self.data_step)
        self.data_step += 1
        return result.loss  # already the global mean; averaging over ranks keeps it

    def instrument(self, ph: _Phases) -> contextlib.AbstractContextManager:
        eng, impl = self.engine, self.engine.impl
        # Engine methods are looked up on the instance at call time (the autograd hooks call
        # self.impl.post_backward), so instance attributes intercept them; step_shards is a
        # module global of zero.engine.
        return _patched(
            [
                (eng, "forward", ph.wrap("forward", eng.forward)),
                (eng, "backward", ph.wrap("backward", eng.backward)),
                (eng, "finalize_backward", ph.wrap("backward.finalize", eng.finalize_backward)),
                (impl, "post_backward", ph.wrap("backward.hooks", impl.post_backward)),
                (eng, "step", ph.wrap("update", eng.step)),
                (impl, "finish_reduction", ph.wrap("update.reduce", impl.finish_reduction)),
                (eng, "_exchange", ph.wrap("update.control", eng._exchange)),
                (
                    engine_module,
                    "step_shards",
                    ph.wrap("update.optimizer", engine_module.step_shards),
                ),
                (impl, "refresh_working", ph.wrap("update.refresh", impl.refresh_working)),
                (impl, "finish_step", ph.wrap("update.finish", impl.finish_step)),
            ]
        )

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


class _TorchPeer(_Trainer):
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


class _DeepSpeed(_Trainer):
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


BUILD_WARMUP = 2
"""Untimed steps right after building a system (data steps 0 and 1)."""

_LIVE: dict[str, _Trainer] = {}
"""The systems built in this rank, by name: they persist between pool calls."""


def prepare_deepspeed(rank: int, n: int) -> str | None:
    """Import DeepSpeed and join its communication layer to the existing group, one rank at a
    time: the first import JIT-compiles a small C++ op, and ranks compiling into the same
    directory at once race. Returns None, or why DeepSpeed cannot run here."""
    device = _device()
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Kept between runs (the build is ~30 s); .cache/ is in the ignored build area.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO_ROOT / ".cache" / "torch_extensions"))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    why = None
    for turn in range(n):
        if turn == rank:
            try:
                import deepspeed

                deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
                import logging

                logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            except ModuleNotFoundError as e:
                why = "not installed" if e.name == "deepspeed" else f"unavailable: {e}"
            except Exception as e:  # a broken install must not take the other systems down
                why = f"unavailable: {type(e).__name__}: {e}"
        dist.barrier()
    return why


def _ours(trainer: _Trainer) -> bool:
    # by the engine, not the class: under `python -m measure.bench` this module is __main__,
    # and measure/bench_mp.py's systems subclass the _Ours of measure.bench, another copy
    from zero.engine import ZeroEngine

    return isinstance(getattr(trainer, "engine", None), ZeroEngine)


def _make(name: str, rank: int, n: int, cfg: BenchConfig) -> _Trainer:
    if name in MP_SYSTEMS:
        from .bench_mp import MPTrainer as kind
    else:
        kind = _Ours if name in OURS else _DeepSpeed if name.startswith("deep") else _TorchPeer
    return kind(name, rank, n, cfg)


def _build(rank: int, n: int, name: str, cfg: BenchConfig) -> dict:
    """Build one system in this rank (and warm it up), or say why it cannot run."""
    if name.startswith("deepspeed"):
        why = prepare_deepspeed(rank, n)
        if why is not None:
            return {"status": why}
    try:
        trainer = _make(name, rank, n, cfg)
        # DDP rebuilds its buckets, and allocators settle, in the first steps
        losses = [trainer.step(trainer.batch()) for _ in range(BUILD_WARMUP)]
    except Exception:
        # A rank that fails half-way through a collective leaves its peers waiting; the pool's
        # timeout names them. A failure on every rank (a version mismatch) is reported here.
        return {"status": "failed", "error": traceback.format_exc(limit=8)}
    _LIVE[name] = trainer
    from .bench_mp import step_traffic

    return {
        # the counted collectives of the last warm-up step (a steady one), this rank's
        "traffic": step_traffic(trainer.engine.counter) if _ours(trainer) else None,
        "status": "ok",
        "options": trainer.options(),
        "threads": torch.get_num_threads(),
        "device": str(trainer.device),
        "num_params": GPT(cfg.workload.gpt, device="meta").num_params(),
        "build_losses": losses,  # data steps 0, 1: the same for every system, always
    }


# [Note: CPU time per step] Each rank's CPU time over its timed steps: every thread of the
# process (the compute thread, gloo's, the kernel's work on the rank's behalf in its sockets),
# from the process clock (time.process_time, nanoseconds), and the kernel's part from os.times()
# (clock ticks, 10 ms here: at a step of a few ms only the total is precise). On a machine with
# as many cores as ranks, a rank that is never idle has CPU ≈ wall, and then whatever CPU a
# system spends beyond DDP's, on copying or sending bytes, is wall time too: no overlap hides
# work from a core that has no other to give. Where the ranks outnumber the cores, CPU < wall by
# the time a rank waits for a core. The table (format_cpu) sets each system's CPU per step
# beside its wall time and DDP's.


def _repeat(rank: int, n: int, name: str, steps: int, warmup: int) -> dict:
    """One repeat of one system: warm-up steps, then `steps` timed steps. Per-step seconds."""
    trainer = _LIVE[name]
    cpu0 = time.process_time()
    for _ in range(warmup):
        trainer.step(trainer.batch())
    seconds, losses = [], []
    gc.collect()
    gc.disable()  # a collection pause would be charged to whichever system ran into it
    # [Note: CPU time per step]: this rank's threads over the timed steps (barriers included)
    span0, cpu_t0, times0 = time.perf_counter(), time.process_time(), os.times()
    try:
        for _ in range(steps):
            batch = trainer.batch()  # data is made outside the timed region
            _sync(trainer.device)
            dist.barrier()
            t0 = time.perf_counter()
            loss = trainer.step(batch)
            _sync(trainer.device)
            seconds.append(time.perf_counter() - t0)
            losses.append(loss)
    finally:
        gc.enable()
    span, cpu_t, times1 = time.perf_counter() - span0, time.process_time() - cpu_t0, os.times()
    return {
        "seconds": seconds,
        "losses": losses,
        "first_step": trainer.data_step - steps,
        "cpu_s": time.process_time() - cpu0,  # every thread of this rank
        "span_s": span,  # wall time of the timed steps' loop
        "timed_cpu_s": cpu_t,  # its CPU time (the process clock: nanoseconds)
        "system_s": times1.system - times0.system,  # of which the kernel's (clock ticks)
    }


def _profile(rank: int, n: int, name: str, steps: int) -> dict:
    """`steps` steps with phase timers: "phases", per step the seconds by phase (plus "step",
    the total), and "cpu_s"."""
    trainer = _LIVE[name]
    cpu0 = time.process_time()
    out = []
    for _ in range(steps):
        batch = trainer.batch()
        ph = _Phases()
        ph.device = trainer.device
        with trainer.instrument(ph):
            _sync(trainer.device)
            dist.barrier()
            t0 = time.perf_counter()
            trainer.step(batch)
            _sync(trainer.device)
            ph.seconds["step"] = time.perf_counter() - t0
        out.append(dict(ph.seconds))
    return {"phases": out, "cpu_s": time.process_time() - cpu0}


MEMORY_STEPS = 3
"""Steps of the memory pass: the first allocates the optimizer states of torch.optim (lazily),
the second is the first steady one, the third shows drift ([Note: the memory pass])."""


def _memory(rank: int, n: int, name: str, cfg: BenchConfig) -> dict:
    """[Note: the memory pass] A fresh copy of system `name`, built and stepped MEMORY_STEPS
    times inside measure.tensor_memory.tracking, so that every byte it holds was allocated in the
    block: "peak_bytes" is the most tensor bytes alive at once during the steps, "resident_bytes"
    those alive after the last, "build_peak_bytes" the construction's peak, "drift_bytes" the
    growth from the second step's end to the third's (0 in steady state; see tensor_memory's
    docstring for what would make it positive). "activation_bytes": what autograd saves for
    backward in a plain GPT's forward of this rank's micro-batch (measure.resident)."""
    from measure.resident import release_free_memory, saved_activations

    device = _device()
    cpu0 = time.process_time()
    probe_of = _Trainer
    if name in MP_SYSTEMS:  # the rank's slice and its micro-batch
        from .bench_mp import MPProbe as probe_of
    probe = probe_of(name, rank, n, cfg)
    model, batch = probe.model(), probe.batch()
    with saved_activations(model.parameters()) as saved:
        model(*batch)
    acts = saved.nbytes
    del model, batch, saved
    gc.collect()
    states = None
    with tensor_memory.tracking(device) as (mark, trace):
        mark("build")
        trainer = _make(name, rank, n, cfg)
        for i in range(MEMORY_STEPS):
            batch = trainer.batch()
            mark(f"step {i + 1}")
            trainer.step(batch)
            del batch
        mark("end")
        if _ours(trainer):
            report = trainer.engine.memory_report()  # model states; comm_buffers are transient
            states = sum(report.get(k, 0) for k in ("params", "frozen", "grads", "master"))
            states += report["optimizer"]
        del trainer
        gc.collect()
    release_free_memory()  # the next system's pass starts from what this rank held before this one
    last = f"step {MEMORY_STEPS}"
    return {
        "peak_bytes": trace.peak("step 1"),
        "resident_bytes": trace.end(last),
        "build_peak_bytes": trace.peak_of("build"),
        "drift_bytes": trace.end(last) - trace.end(f"step {MEMORY_STEPS - 1}"),
        "engine_states_bytes": states,
        "activation_bytes": acts,
        "method": tensor_memory.method(device),
        "cpu_s": time.process_time() - cpu0,
    }


def _peak(rank: int, n: int) -> dict:
    """This rank's measured peak FLOP/s, every rank at once ([Note: the peak a rank can reach]
    in measure/mfu.py)."""
    device = _device()
    cpu0 = time.process_time()
    peak = mfu.measure_peak_flops(device)
    return {
        "peak_flops": peak,
        "dtype": str(mfu.PEAK_DTYPE[device.type]).removeprefix("torch."),
        "cpu_s": time.process_time() - cpu0,
    }


def _keep_freed_blocks(rank: int, n: int) -> None:
    from measure.resident import keep_freed_blocks

    if _device().type == "cpu" and not keep_freed_blocks():
        raise RuntimeError(f"rank {rank}: malloc='keep' needs glibc's mallopt, not found here")


def _drop_all(rank: int, n: int) -> None:
    """Free every system in this rank (a shared pool outlives the benchmark), and hand malloc's
    free pages back to the kernel: without the trim a rank's resident memory stays at the sum of
    every system it has built (glibc keeps freed heap pages), and at `mid` the memory pass that
    follows the timing ran two ranks out of a 24 GiB machine."""
    from measure.resident import release_free_memory

    _LIVE.clear()
    release_free_memory()


# ---------------------------------------------------------------------------------------------
# The driver (the parent process, or every rank under torchrun)


class _World:
    """Runs fn(rank, N, *args) on every rank of one world, returning the results in rank order:
    through a pool of forked local ranks, or on this rank of a torchrun world, gathered."""

    def __init__(self, n: int, pool=None, timeout_s: float = 900.0):
        self.n, self.pool, self.timeout_s = n, pool, timeout_s

    def run(self, fn, *args) -> list:
        if self.pool is not None:
            return self.pool.run(fn, *args, timeout_s=self.timeout_s)
        mine = fn(dist.get_rank(), self.n, *args)
        every: list = [None] * self.n
        dist.all_gather_object(every, mine)
        return every


def _stats(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    p25, median, p75 = np.percentile(a, [25, 50, 75])
    return {
        "median_ms": float(median),
        "p25_ms": float(p25),
        "p75_ms": float(p75),
        "min_ms": float(a.min()),
        "max_ms": float(a.max()),
    }


def bench_world(n: int, cfg: BenchConfig, *, pool=None, say=print) -> list[dict]:
    """Build every system of cfg in one world of n ranks, time them round-robin, and return
    one zero.results record per system (status "ok", "not installed", "unavailable: ...", or
    "failed"). `pool`: a zero.launch WorkerPool of n ranks, or None under torchrun."""
    world = _World(n, pool, cfg.timeout_s)
    if cfg.malloc == "keep":  # before any system allocates: every one runs under it
        world.run(_keep_freed_blocks)
    built: dict[str, list[dict]] = {}
    for name in cfg.systems:
        t0 = time.perf_counter()
        built[name] = world.run(_build, name, cfg)
        status = {b["status"] for b in built[name]}
        say(f"  N={n} {name}: {'/'.join(sorted(status))} ({time.perf_counter() - t0:.1f} s)")
    ready = [s for s in cfg.systems if all(b["status"] == "ok" for b in built[s])]
    # [Note: alternating repeats]
    timings: dict[str, list[list[dict]]] = {s: [] for s in ready}
    redone: dict[str, list[float]] = {s: [] for s in ready}
    meter = _Meter(cfg) if pool is not None else None  # other hosts' load is not visible here
    for r in range(cfg.repeats):
        t0 = time.perf_counter()
        order = ready[r % len(ready) :] + ready[: r % len(ready)] if ready else []
        for name in order:
            per_rank, noisy = _undisturbed(world, meter, cfg, _repeat, name, cfg.steps, cfg.warmup)
            timings[name].append(per_rank)
            redone[name] += noisy
        others = [timings[s][-1][0]["other_cores"] for s in order]
        busiest = max((x for x in others if x is not None), default=None)
        say(
            f"  N={n} repeat {r + 1}/{cfg.repeats} ({time.perf_counter() - t0:.1f} s"
            + ("" if busiest is None else f"; others used <= {busiest:.2f} cores")
            + f"; {sum(len(v) for v in redone.values())} repeats redone so far)"
        )
    peaks = _undisturbed(world, meter, cfg, _peak)[0] if ready else None
    profiles = {}
    if cfg.profile:
        for name in ready:
            per_rank, _ = _undisturbed(world, meter, cfg, _profile, name, cfg.steps)
            profiles[name] = [x["phases"] for x in per_rank]
    memory = {}
    if cfg.memory:
        world.run(_drop_all)  # the timed copies are not needed any more: room for the fresh ones
        for name in ready:
            memory[name] = world.run(_memory, name, cfg)
            say(
                f"  N={n} {name}: peak {max(m['peak_bytes'] for m in memory[name]) / 2**20:.1f} MiB"
            )
    world.run(_drop_all)
    prov = provenance()
    return [
        _record(
            name, n, cfg, built[name], timings.get(name), profiles.get(name), prov, redone, peaks,
            memory.get(name),
        )
        for name in cfg.systems
    ]  # fmt: skip


def _undisturbed(world: _World, meter, cfg: BenchConfig, fn, *args) -> tuple[list, list]:
    """world.run(fn, *args), timed again while others used more than cfg.quiet_cores
    ([Note: disturbed repeats]). fn returns a dict per rank with "cpu_s"; each gets
    "other_cores" and "waited_s". Returns (the kept results, other_cores of those redone)."""
    redone = []
    for attempt in range(cfg.retries + 1):
        waited = meter.wait_quiet() if meter else 0.0
        before = meter.read() if meter else None
        per_rank = world.run(fn, *args)
        other = meter.other_cores(before, per_rank) if meter else None
        for x in per_rank:
            x.update(other_cores=other, waited_s=waited)
        if other is None or other <= cfg.quiet_cores or attempt == cfg.retries:
            return per_rank, redone
        redone.append(other)
    raise AssertionError("unreachable: the last attempt returns")


class _Meter:
    """CPU time of the whole machine (Linux /proc/stat), so that the parent can tell how many
    cores processes other than ours used while a repeat ran ([Note: disturbed repeats]).

    Our own CPU time is the ranks' process times (every thread, gloo's included) plus this
    process's; the rest of the machine's busy time belongs to others."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def busy(self) -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                cpu = f.readline().split()
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
        ticks = [int(x) for x in cpu[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / self.tick

    def read(self) -> tuple[float | None, float, float]:
        return self.busy(), time.process_time(), time.perf_counter()

    def other_cores(self, before, per_rank: list[dict] | None = None) -> float | None:
        busy, cpu, wall = self.read()
        if busy is None or before[0] is None:
            return None
        ours = (cpu - before[1]) + sum(x["cpu_s"] for x in per_rank or ())
        return max(0.0, (busy - before[0] - ours) / max(wall - before[2], 1e-9))

    def wait_quiet(self) -> float:
        """Wait (probing half a second at a time, at most quiet_wait_s) until others use at most
        quiet_cores while our ranks sit idle; returns the seconds waited."""
        if self.cfg.quiet_wait_s <= 0:
            return 0.0
        t0 = time.perf_counter()
        while True:
            before = self.read()
            time.sleep(0.5)
            other = self.other_cores(before)
            waited = time.perf_counter() - t0
            if other is None or other <= self.cfg.quiet_cores or waited >= self.cfg.quiet_wait_s:
                return waited


def _base_config(name: str, n: int, cfg: BenchConfig) -> dict:
    w = cfg.workload
    stage = int(name[6]) if name in OURS else int(name[-1]) if name.startswith("deep") else None
    config = {
        "benchmark": "step_time",
        "system": name,
        "family": "ours" if name in OURS else "peer",
        "stage": stage,
        "mode": ("deterministic" if name.endswith("-det") else "fast") if name in OURS else None,
        "world_size": n,
        "micro_batches": n,
        "precision": "fp32",
        "reduce_dtype": "fp32",
        "optimizer": "adamw",
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "weight_decay_on": "matrices (ndim >= 2); none on biases and norms",
        "model": cfg.model,
        "gpt": asdict(w.gpt),
        "batch_size": w.batch_size,
        "seq_len": w.gpt.block_size,
        "seed": cfg.seed,
        "repeats": cfg.repeats,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "build_warmup": BUILD_WARMUP,
        "quiet_cores": cfg.quiet_cores,
        "retries": cfg.retries,
        "note": cfg.note,
        "group": cfg.group,
        "malloc": cfg.malloc,
    }
    if name in MP_SYSTEMS:
        from .bench_mp import config_fields

        config.update(config_fields(name, n, cfg))
    return config


def _record(name, n, cfg, built, timing, profile, prov, redone, peaks, memory=None) -> dict:
    config = _base_config(name, n, cfg)
    first = built[0]
    if first["status"] != "ok" or timing is None:
        statuses = sorted({b["status"] for b in built})
        result = {"status": "failed" if "failed" in statuses else statuses[0]}
        errors = [b.get("error") for b in built if b.get("error")]
        if errors:
            result["error"] = errors[0]
        return make_record(config=config, result=result, kind=KIND, provenance=prov)
    config.update(
        num_params=first["num_params"],
        threads_per_rank=max(b["threads"] for b in built),
        device=first["device"],
        backend=_backend(first["device"]),
        options=first["options"],
    )
    # timing[r][rank] = {"seconds": [...], "losses": [...], "first_step": s}
    rank_ms = [[[1e3 * t for t in per_rank["seconds"]] for per_rank in rep] for rep in timing]
    step_ms = [[max(col) for col in zip(*rep)] for rep in rank_ms]
    losses = [[float(np.mean(col)) for col in zip(*(p["losses"] for p in rep))] for rep in timing]
    samples = [t for rep in step_ms for t in rep]
    result = {
        "status": "ok",
        **_stats(samples),
        "repeat_medians_ms": [float(np.median(rep)) for rep in step_ms],
        "step_ms": step_ms,
        "rank_step_ms": rank_ms,
        "losses": losses,
        "first_data_steps": [rep[0]["first_step"] for rep in timing],
        "build_losses": [float(np.mean(col)) for col in zip(*(b["build_losses"] for b in built))],
        # cores other processes used during each kept repeat (None: not measurable here),
        # and during the repeats that were timed again because of them
        "other_cores": [rep[0]["other_cores"] for rep in timing],
        "redone_other_cores": redone.get(name, []),
        "waited_for_quiet_s": sum(rep[0]["waited_s"] for rep in timing),
        "traffic_per_step": [b["traffic"] for b in built],  # per rank; None: not our engine
        # [Note: CPU time per step]: per repeat and rank, ms per timed step of the loop's wall
        # time, its CPU time and the kernel's part of it
        "rank_span_ms": [[1e3 * p["span_s"] / cfg.steps for p in rep] for rep in timing],
        "rank_cpu_ms": [[1e3 * p["timed_cpu_s"] / cfg.steps for p in rep] for rep in timing],
        "rank_system_ms": [[1e3 * p["system_s"] / cfg.steps for p in rep] for rep in timing],
    }
    # MFU (measure/mfu.py): this rank's model FLOPs over the step's median time (the slowest
    # rank's), against the median over ranks of the peak each measured
    flops = mfu.step_flops(cfg.workload.gpt, cfg.workload.batch_size)
    peak = float(np.median([p["peak_flops"] for p in peaks]))
    config["peak_dtype"] = peaks[0]["dtype"]
    use = mfu.utilisation(flops, result["median_ms"] / 1e3, peak)
    result.update(
        flops_per_rank_step=flops,
        peak_flops_per_rank=peak,
        rank_peak_flops=[p["peak_flops"] for p in peaks],
        achieved_flops_per_rank=use["achieved_flops"],
        mfu=use["mfu"],
    )
    if profile is not None:
        result["profile_ms"], result["profile_steps_ms"] = _profile_summary(profile)
    if memory is not None:
        params = config.get("slice_params", config["num_params"])
        result["memory"] = _memory_summary(name, n, params, memory, config.get("mp", 1))
    return make_record(config=config, result=result, kind=KIND, provenance=prov)


def _memory_summary(name: str, n: int, num_params: int, per_rank: list[dict], mp=1) -> dict:
    """The memory pass's figures, the largest over ranks (the rank a budget must fit), with
    every rank's peak and the analytic model states of the system's sharding level."""
    states = [m["engine_states_bytes"] for m in per_rank]
    return {
        "peak_bytes": max(m["peak_bytes"] for m in per_rank),
        "rank_peak_bytes": [m["peak_bytes"] for m in per_rank],
        "resident_bytes": max(m["resident_bytes"] for m in per_rank),
        "build_peak_bytes": max(m["build_peak_bytes"] for m in per_rank),
        "drift_bytes": max(m["drift_bytes"] for m in per_rank),
        "activation_bytes": max(m["activation_bytes"] for m in per_rank),
        "engine_states_bytes": None if None in states else max(states),
        "analytic_states_bytes": analytic_states_bytes(name, n, num_params, mp),
        "sharding_level": SHARDING_LEVEL[name],
        "steps": MEMORY_STEPS,
        "method": per_rank[0]["method"],
    }


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _profile_summary(per_rank: list[list[dict[str, float]]]) -> tuple[dict, dict]:
    """Per phase: the median over steps of the mean over ranks, in ms; and the per-step means
    themselves. The phases nest within each step (a sub-phase inside its phase, the phases inside
    the step), so the per-step values add up; the medians need not (a median of a sum is not the
    sum of the medians)."""
    phases = sorted({k for rank in per_rank for step in rank for k in step})
    medians, steps = {}, {}
    for k in phases:
        per_step = [
            1e3 * float(np.mean([rank[i].get(k, 0.0) for rank in per_rank]))
            for i in range(len(per_rank[0]))
        ]
        medians[k], steps[k] = float(np.median(per_step)), per_step
    return medians, steps


def run_bench(cfg: BenchConfig, *, pools=None, say=print, done=None) -> list[dict]:
    """Every world size of cfg; returns the records with ratios filled in.

    pools: a function N -> WorkerPool to run in (e.g. zero.launch.get_pool); None starts a fresh
    pool per N and closes it afterwards. Under torchrun, only the launched world size runs.
    done: called with the records so far after each world size (main writes them, so that a
    failure at one N keeps the measurements of the others).
    """
    from zero import launch

    records = []
    if launch.under_torchrun():
        if not dist.is_initialized():
            launch.init_from_env()
        if _device().type == "cpu":
            torch.set_num_threads(1)  # as the forked ranks have: one thread per rank
        n = dist.get_world_size()
        records += bench_world(n, cfg, say=say)
    else:
        for n in cfg.world_sizes:
            if pools is not None:
                records += bench_world(n, cfg, pool=pools(n), say=say)
            else:
                with launch.WorkerPool(n, timeout_s=cfg.timeout_s) as pool:
                    records += bench_world(n, cfg, pool=pool, say=say)
            if done is not None and n != cfg.world_sizes[-1]:
                add_ratios(records)
                done(records)
    add_ratios(records)
    return records


def parse(argv=None) -> tuple[BenchConfig, argparse.Namespace]:
    """The configuration and the output options of a command line."""
    p = cli.new_parser("python -m measure.bench", __doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--from-json", nargs="+", default=None,
        help="print the tables of results files only (several: merged; with --json, written)",
    )  # fmt: skip
    return cli.parse(
        BenchConfig, argv, parser=p, aliases={"timeout_s": ("--timeout",)},
        choices={"model": MODELS, "systems": SYSTEMS},
    )  # fmt: skip


def main(argv=None) -> int:
    cfg, args = parse(argv)
    for path in args.from_json or ():
        if not os.path.isfile(path):
            raise ValueError(f"from_json={path!r}: no such file; allowed are results files")
    if args.json is not None:
        cli.check_writable("json", args.json, file=True)  # before the timing, not after it
    if args.from_json:
        records = merge_records([read_json(p)["records"] for p in args.from_json])
        add_ratios(records)  # the ratios follow from the timings; recomputed, never trusted
        if args.json is not None:
            write_json(args.json, {"section": KIND, "records": records})
        print("\n\n".join(format_all(records, markdown=args.markdown)))
        return 0
    lead = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 alone prints and writes

    def say(*a):
        if lead:
            print(*a, flush=True)

    def keep(records):
        if args.json and lead:
            write_json(args.json, {"section": KIND, "records": records})

    started = time.time()
    records = run_bench(cfg, say=say, done=keep)
    say("\n\n".join(format_all(records, markdown=args.markdown)))
    psi = next((r["config"]["num_params"] for r in records if "num_params" in r["config"]), 0)
    say(
        f"model {cfg.model}: Ψ = {psi:,}, B = {cfg.workload.batch_size}, "
        f"seq {cfg.workload.gpt.block_size}; {time.time() - started:.0f} s"
    )
    keep(records)
    return 0 if any(r["result"]["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    cli.run(main, "python -m measure.bench")
