"""The systems a benchmark times, inside one rank: our engine and the peers (DDP, FSDP2,
DeepSpeed), each a Trainer whose step is forward + backward + update. The workloads they run and
the benchmark's configuration are measure/parts/bench_config.py's. measure/bench.py drives them
over ranks and repeats; measure/bench_mp.py adds the model-parallel systems.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from reference.optim import Hyper
from zero.config import ZeroConfig, decay_matrices_only
from zero.loop import train_steps
from zero.workloads.models import GPT, gpt_microbatches

from .bench_config import BenchConfig

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
