"""measure.bench's model-parallel systems: Megatron-style tensor parallelism (zero/mp/) alone, and
ZeRO inside the data-parallel groups of a DP × MP mesh, at a fixed world of N ranks.

    python -m measure.bench --model anchor --world-sizes 4 --systems ddp megatron-lm \\
        zero-s1-mp1 zero-s1-mp2 zero-s1-mp4 zero-s3-mp1 zero-s3-mp2 zero-s3-mp4

Systems (measure.bench_table.MP_SYSTEMS; [Note: model-parallel systems]): "megatron-lm" (N_m = N),
zero-s<stage>-mp<N_m> (N_d = N/N_m), each with -det for deterministic mode. Every record also
carries one steady step's counted traffic per rank (step_traffic): kind "model" (docs/design.md
§2's ZeRO collectives in the DP group) and kind "mp" (§6's table). The timing, the repeats, the
noise rules and the memory pass are measure/bench.py's, unchanged.
Legend: N world size, N_d DP degree, N_m MP degree, B sequences per micro-batch of DDP.
"""

# [Note: model-parallel systems] Every system does the same work per step: the N micro-batches
# of B sequences that DDP's N ranks run (gpt_microbatches, count N). DP index d of an N_d × N_m
# mesh runs micro-batches d·N_m .. d·N_m + N_m - 1 as one micro-batch of N_m·B sequences on its
# N_m ranks (M = N_d, one micro-step), so the step's loss is the mean over the same N·B
# sequences. The model is TPGPT.build (the N_m = 1 GPT's start values, cut; zero/mp/gpt.py),
# AdamW as for our other systems. "megatron-lm" is Megatron-LM's tensor parallelism with no data
# parallelism and no ZeRO: N_m = N, N_d = 1, our engine at stage 0 over its DP group of one
# rank, whose reduction moves nothing and whose optimizer is plain AdamW on the whole slice
# (docs/design.md §6: stage 0 at N_d = 1 is §2's step of one rank). It is the name of
# zero-s0-mp<N>, kept apart because it is the paper's baseline.

from __future__ import annotations

import dataclasses

import torch

from zero.collectives import CommCounter
from zero.mp import TPGPT, Mesh, MPContext, tp_num_params
from zero.workloads.models import gpt_microbatches

from .parts.bench_config import layout
from .parts.trainers import Ours, Trainer, zero_config

_GROUPS: dict = {}
"""Per worker process: this rank's MeshGroups by (N_d, N_m), created once (new_group is
collective and every rank must call it in the same order: every rank builds the same system)."""


def mesh_groups(dp: int, mp: int):
    if (dp, mp) not in _GROUPS:
        _GROUPS[(dp, mp)] = Mesh(dp=dp, mp=mp).groups()
    return _GROUPS[(dp, mp)]


class MPProbe(Trainer):
    """An MP system's model and data on one rank, without an engine (the memory pass's probe of
    saved activations)."""

    def __init__(self, name, rank, n, cfg):
        Trainer.__init__(self, name, rank, n, cfg)  # not Ours' (MPTrainer's next in line)
        self.stage, self.dp, self.mp, self.deterministic = layout(name, n)
        self.groups = mesh_groups(self.dp, self.mp)
        self.ctx = MPContext.of(
            self.groups.mp_group, counter=CommCounter(), deterministic=self.deterministic
        )

    def model(self) -> TPGPT:
        return TPGPT.build(self.cfg.workload.gpt, self.ctx, seed=self.cfg.seed, device=self.device)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        w, d, k = self.cfg.workload, self.groups.d, self.mp
        every = gpt_microbatches(
            w.gpt, seed=self.cfg.seed, data_step=self.data_step, count=self.n,
            batch_size=w.batch_size,
        )  # fmt: skip
        mine = every[d * k : (d + 1) * k]  # [Note: model-parallel systems]
        x, y = (torch.cat([b[i] for b in mine]) for i in (0, 1))
        return x.to(self.device), y.to(self.device)


class MPTrainer(MPProbe, Ours):
    """MP system `name` on one rank: the engine on this rank's TPGPT slice, in its DP group.
    step() and the profile's phases are Ours' (zero.workloads.train, one micro-step)."""

    def __init__(self, name, rank, n, cfg):
        MPProbe.__init__(self, name, rank, n, cfg)
        from zero.engine import ZeroEngine

        base = zero_config(self.stage, self.deterministic, n, cfg)
        self.config = dataclasses.replace(base, micro_batches=self.dp)
        self.engine = ZeroEngine(self.model(), self.config, group=self.groups.dp_group, mp=self.ctx)

    def options(self) -> dict:
        return {
            **super().options(),
            "mesh": {"dp": self.dp, "mp": self.mp, "d": self.groups.d, "m": self.groups.m},
            "sequences_per_micro_batch": self.mp * self.cfg.workload.batch_size,
        }


def config_fields(name: str, n: int, cfg) -> dict:
    """The record's config entries of an MP system (they replace measure.bench's defaults)."""
    stage, dp, mp, det = layout(name, n)
    return {
        "family": "baseline" if name.startswith("megatron-lm") else "ours",
        "stage": stage,
        "mode": "deterministic" if det else "fast",
        "mp": mp,
        "dp": dp,
        "micro_batches": dp,
        "sequences_per_micro_batch": mp * cfg.workload.batch_size,
        "slice_params": tp_num_params(cfg.workload.gpt, mp),
        "model_parallel": "tensor (Megatron-style, zero/mp/; docs/design.md §6)",
    }


def step_traffic(counter: CommCounter, step: int | None = None) -> dict:
    """One step's counted traffic of this rank (default: the last finished step): elements per
    kind, kind "model" per "op:phase" as [calls, elements, padding], and kind "mp" as the
    sorted [op, phase, elements] of every collective."""
    step = counter.step - 1 if step is None else step
    model: dict[str, list[int]] = {}
    for r in counter.of_step(step, "model"):
        row = model.setdefault(f"{r.op}:{r.phase}", [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + r.elements, row[2] + r.padding
    mp = sorted([r.op, r.phase, r.elements] for r in counter.of_step(step, "mp"))
    return {
        "step": step,
        "elements": {k: sum(r.elements for r in counter.of_step(step, k)) for k in KINDS},
        "model": model,
        "mp": mp,
    }


KINDS = ("model", "mp", "control")
"""The counter kinds a record totals: ZeRO's model states, the tensor-parallel collectives and
the step's control exchanges."""
