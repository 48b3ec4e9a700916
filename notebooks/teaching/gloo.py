"""Real ranks: zero/ on local gloo ranks, one forked world per call, for notebooks 02 and 04.

A Job says what to train (a small GPT, zero.workloads.models) and what to record; run_on_gloo runs a
list of them on N ranks and returns, per job and rank, a RankRun: plain data (traffic per step, the
memory report, the blocks of the rank's buffers, the final master, and optionally a trace of
compute intervals and collectives, FLOP counts, and the single-process gradients that the
simulation needs to replay the same steps).

_run_jobs is what the forked ranks run; it stays module-level so that it can also be passed by
reference (zero.ranks.local.WorkerPool pickles the function it runs).

Legend: see the package docstring; L is a unit's shard length, Ψ_pad = N·ΣL.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from reference import Hyper, ModelSpec, StepConfig, init_state, train_step

from .pictures import Block, engine_blocks


@dataclass(frozen=True, kw_only=True)
class Job:
    """One engine run inside a gloo world: what to train and what to record."""

    stage: int
    deterministic: bool = True
    micro_batches: int | None = None  # M; None means M = N
    steps: int = 1
    overlap: bool = True
    precision: str = "bf16"
    reduce_dtype: str | None = "bf16"
    n_layer: int = 2
    n_embd: int = 32
    block_size: int = 16
    batch_size: int = 4
    trace: bool = False  # FLOPs per micro-step (step 0), compute intervals (last step)
    reference_grads: bool = False  # rank 0 returns the single-process micro-batch gradients

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r}: allowed are 0, 1, 2, 3")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps!r}: must be >= 1")
        if self.trace and self.steps < 2:
            raise ValueError(
                f"steps={self.steps} with trace=True: tracing needs >= 2 steps (FLOPs are "
                "counted in the first, the timeline is taken in the last)"
            )


@dataclass(kw_only=True)
class RankRun:
    """What one rank measured in one Job (plain data: it crosses the process boundary)."""

    rank: int
    world_size: int
    stage: int
    volume: list[tuple[int, int]]  # per step: model-state (elements, padding) sent
    control: list[tuple[int, int]]  # per step: control traffic
    counts: list[dict[str, int]]  # per step: calls per op (model states)
    memory: dict[str, int]  # memory_report() after the last step
    blocks: list[Block]
    master: dict[str, np.ndarray]  # full fp32 master after the last step, by name
    losses: list[float]
    records: list[dict] = field(default_factory=list)  # CommRecords of the last step
    events: list[dict] = field(default_factory=list)  # compute intervals of the last step
    flops: list[int] = field(default_factory=list)  # per micro-step of step 0 (trace)
    unit_names: list[str] = field(default_factory=list)  # by unit index; "root" for the root
    shards: list[int] = field(default_factory=list)  # L per unit
    numel: int = 0  # Ψ, real parameters
    deterministic: bool = True
    micro_batches: int = 0  # M
    # rank 0 with reference_grads only:
    grads: list[list[dict[str, np.ndarray]]] | None = None  # per step, per micro-batch
    spec: ModelSpec | None = None
    step_config: StepConfig | None = None
    init: dict[str, np.ndarray] | None = None
    single_process_flops: int | None = None  # one micro-batch, forward + backward, plain model

    @property
    def psi_padded(self) -> int:
        """Ψ_pad = N·ΣL, the padded parameter count the volumes are measured against."""
        return self.world_size * sum(self.shards)


def _gpt_config(job: Job):
    from zero.workloads.models import GPTConfig

    return GPTConfig(
        vocab_size=64, block_size=job.block_size, n_layer=job.n_layer, n_head=2, n_embd=job.n_embd
    )


def _zero_config(job: Job, units, world_size: int):
    from zero.config import ZeroConfig, decay_matrices_only

    return ZeroConfig(
        stage=job.stage,
        precision=job.precision,
        reduce_dtype=job.reduce_dtype,
        deterministic=job.deterministic,
        optimizer="adamw",
        groups=(Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=2e-2)),
        group_of=decay_matrices_only,
        micro_batches=world_size if job.micro_batches is None else job.micro_batches,
        clip_norm=1.0,
        units=tuple(units),
        overlap=job.overlap,
        chunk=128,
    )


def _attach_tracer(model, unit_names, events: list):
    """Forward and backward hooks on each unit that append compute intervals to `events`.
    Registered after the engine's own hooks, so a stage-3 gather happens before the clock starts."""
    mods = dict(model.named_modules())
    now = time.perf_counter
    for name in unit_names:
        m = mods[name]
        m.register_forward_pre_hook(
            lambda _m, _a, n=name: events.append(["forward", n, now(), None])
        )
        m.register_forward_hook(lambda _m, _a, _o, n=name: _close(events, "forward", n, now()))
        m.register_full_backward_pre_hook(
            lambda _m, _g, n=name: events.append(["backward", n, now(), None])
        )
        m.register_full_backward_hook(
            lambda _m, _gi, _go, n=name: _close(events, "backward", n, now())
        )


def _close(events: list, phase: str, name: str, t: float) -> None:
    for e in reversed(events):
        if e[0] == phase and e[1] == name and e[3] is None:
            e[3] = t
            return


def _run_job(rank: int, world_size: int, job: Job) -> RankRun:
    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from verify.checks.compare import to_numpy
    from zero.engine import ZeroEngine
    from zero.workloads.models import GPT, gpt_microbatches

    torch.set_num_threads(1)
    gcfg = _gpt_config(job)
    model = GPT(gcfg, seed=0)
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    cfg = _zero_config(job, model.unit_names(), world_size)
    eng = ZeroEngine(model, cfg)
    per_rank = cfg.micro_batches // world_size
    names = {u.index: (u.name or "root") for u in eng.units}
    events: list = []
    if job.trace:
        _attach_tracer(model, model.unit_names(), events)
    run = _new_run(rank, world_size, job, eng, names)
    single = _SingleProcess(run, eng, init) if job.reference_grads and rank == 0 else None
    for step in range(job.steps):
        batches = gpt_microbatches(
            gcfg, seed=0, data_step=step, count=cfg.micro_batches, batch_size=job.batch_size
        )
        if single is not None:
            single.step(batches)
        # Tracing: FLOPs are counted in step 0 and the timeline is taken in the last step, so
        # the counter's dispatch overhead (and first-use costs) stay out of the timeline.
        count_flops, last = job.trace and step == 0, step == job.steps - 1
        if last:
            if world_size > 1:
                dist.barrier()  # the ranks start the timed step together (not counted traffic)
            events.clear()
            t0 = time.perf_counter()
        for k in range(per_rank):
            batch = batches[k * world_size + rank]
            with FlopCounterMode(display=False) if count_flops else nullcontext() as fc:
                _, loss = eng(*batch)
                eng.backward(loss)
            if count_flops:
                run.flops.append(int(fc.get_total_flops()))
        t_step = time.perf_counter()
        result = eng.step()
        if last:
            events.append(["step", "optimizer step", t_step, time.perf_counter()])
        run.losses.append(result.loss)
        s = eng.counter.step - 1
        run.volume.append(eng.counter.volume(s))
        run.control.append(eng.counter.volume(s, kind="control"))
        run.counts.append(eng.counter.counts(s))
    run.records = _last_step_records(eng, names, t0)
    run.events = [
        {"phase": p, "name": nm, "start": a - t0, "end": b - t0}
        for p, nm, a, b in events
        if b is not None
    ]
    run.memory = eng.memory_report()
    run.blocks = engine_blocks(eng)
    master, _ = eng.gather_state()
    run.master = {k: to_numpy(v).copy() for k, v in master.items()}
    if job.trace and rank == 0:
        run.single_process_flops = _plain_flops(job)
    return run


def _new_run(rank: int, world_size: int, job: Job, eng, names: dict[int, str]) -> RankRun:
    """The RankRun of one job before its first step: the engine's units and their shards."""
    return RankRun(
        rank=rank,
        world_size=world_size,
        stage=job.stage,
        volume=[],
        control=[],
        counts=[],
        memory={},
        blocks=[],
        master={},
        losses=[],
        unit_names=[names[i] for i in sorted(names)],
        shards=[u.part.shard_numel for u in eng.units],
        numel=sum(u.numel for u in eng.units),
        deterministic=job.deterministic,
        micro_batches=eng.config.micro_batches,
    )


class _SingleProcess:
    """The single-process run beside the engine (reference.train_step on one GPT from the same
    start values): each step it records every micro-batch's gradients in `run`, the replay the
    simulation needs, then takes the step."""

    def __init__(self, run: RankRun, eng, init: dict[str, np.ndarray]):
        from zero.workloads.models import GPT

        cfg = eng.config
        spec = ModelSpec.build(eng.unit_specs(), eng.group_index, chunk=cfg.chunk)
        rcfg = cfg.step_config(eng.world_size)
        self.state, self.model = init_state(init, spec, rcfg), GPT(eng.module.cfg, seed=0)
        self.run, self.spec, self.rcfg, self.dtype = run, spec, rcfg, cfg.compute_dtype
        run.grads, run.spec, run.step_config, run.init = [], spec, rcfg, init

    def step(self, batches) -> None:
        from reference import working_copy
        from verify.checks.harness import microbatch_grads

        work = working_copy(self.state, self.rcfg)
        grads = [microbatch_grads(self.model, work, b, self.dtype, None) for b in batches]
        self.run.grads.append(grads)
        self.state, _ = train_step(self.state, grads, self.spec, self.rcfg)


def _last_step_records(eng, names: dict[int, str], t0: float) -> list[dict]:
    """The counter's records of the last step, as plain data, times from t0."""
    s = eng.counter.step - 1
    return [
        {
            "op": r.op,
            "phase": r.phase,
            "kind": r.kind,
            "unit": r.unit,
            "unit_name": None if r.unit is None else names[r.unit],
            "elements": r.elements,
            "nbytes": r.nbytes,
            "start": r.start - t0,
            "end": None if r.end is None else r.end - t0,
        }
        for r in eng.counter.records
        if r.step == s
    ]


def _plain_flops(job: Job) -> int:
    """FLOPs of one micro-batch, forward and backward, on the plain GPT (no engine)."""
    from torch.utils.flop_counter import FlopCounterMode

    from zero.workloads.models import GPT, gpt_microbatches

    gcfg = _gpt_config(job)
    plain = GPT(gcfg, seed=0)
    batch = gpt_microbatches(gcfg, seed=0, data_step=0, count=1, batch_size=job.batch_size)[0]
    with FlopCounterMode(display=False) as fc:
        _, loss = plain(*batch)
        loss.backward()
    return int(fc.get_total_flops())


def _run_jobs(rank: int, world_size: int, jobs: Sequence[Job]) -> list[RankRun]:
    return [_run_job(rank, world_size, job) for job in jobs]


def _warm_up(job: Job) -> None:
    """Import, in this process, what every rank would otherwise import for itself after the
    fork: building a module on the meta device imports torch._dynamo (about 3 s), and forked
    ranks inherit what the parent has imported."""
    import torch.utils.flop_counter  # noqa: F401

    import verify.checks.harness  # noqa: F401
    from zero.workloads.models import GPT

    GPT(_gpt_config(job), seed=0)


def run_on_gloo(jobs: Sequence[Job], world_size: int, *, timeout_s: float = 300):
    """Run every job, in order, on `world_size` local gloo ranks (one forked world for all
    of them, zero.ranks.local.spawn). Returns runs[job][rank] of RankRun."""
    from zero.ranks.local import spawn

    jobs = list(jobs)
    for j in jobs:
        if not isinstance(j, Job):
            raise ValueError(f"jobs: {j!r} is not a Job")
    _warm_up(jobs[0])
    per_rank = spawn(_run_jobs, world_size, jobs, timeout_s=timeout_s)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(jobs))]
