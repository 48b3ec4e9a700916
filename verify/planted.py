"""Planted bugs: deliberately broken engines that verify must report failing.

    python -m verify.planted                         # every bug on every observable cell
    python -m verify.planted --cheap                 # the two cheapest cells per bug
    python -m verify.planted --bugs one_ulp shard_offset --json p.json --markdown p.md

Each bug (BUGS) is a name, one line on what it breaks, and a plant function that patches the
library through a Patch (undone afterwards), never touching the library's own code path when
not planted. A bug of kind "cells" runs on the --quick cells where verify.matrix.OBSERVABLE
says it is observable ([Note: observable] there), a bug of kind "resume" on the --resume rows
where RESUME_OBSERVABLE says so. Every such cell or row must fail; the same cells pass
unpatched in `python -m verify --quick --resume`. A bug that no --quick cell can catch is a bug
in the preset (verify/matrix.py's PLANTED_GAPS holds the cells added for that reason).
The table (bug, what it breaks, cells observable, cells that caught it, first check that
caught it) is printed and, with --markdown, written; docs/verification.md holds the last one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import matrix
from . import resume as resume_mod
from .harness import Cell, run_cells
from .report import merge


class Patch:
    """A monkeypatch: setattr now, every attribute restored (or removed) by undo()."""

    def __init__(self):
        self._undo: list = []

    def setattr(self, obj, name: str, value) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def everywhere(self, original, value) -> None:
        """Replace `original` under every name any loaded module binds it to (a function that
        other modules imported by name, as `from zero.train import train_steps` does)."""
        for mod in list(sys.modules.values()):
            for name, x in list(vars(mod).items() if mod is not None else ()):
                if x is original:
                    self.setattr(mod, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, had, old = self._undo.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


# -- the bugs, first the sixteen the harness was built against -----------------------------------


def plant_one_ulp(p: Patch) -> None:
    from zero.engine import ZeroEngine

    original = ZeroEngine.step

    def step(self):
        result = original(self)
        if self.rank == self.world_size - 1 and self.t == 1 and not getattr(self, "_ulp", False):
            self._ulp = True
            u = self.units[-1]
            ext = self.master_extent(u)
            # the first parameter element inside this rank's extent (else its first padding)
            i = next(
                (
                    max(s.offset, ext.start) - ext.start
                    for s in u.part.layout.slots
                    if s.offset < ext.stop and s.offset + s.numel > ext.start
                ),
                0,
            )
            u.master.view(torch.int32)[i] += 1
        return result

    p.setattr(ZeroEngine, "step", step)


def plant_shard_offset(p: Patch) -> None:
    from zero.partition import UnitPartition

    def own(self):
        start = self.rank * self.shard_numel - (1 if self.rank else 0)
        return slice(start, start + self.shard_numel)

    p.setattr(UnitPartition, "own", property(own))


def plant_one_over_n_for_m(p: Patch) -> None:
    from zero import engine as engine_module
    from zero.engine import ZeroEngine

    original = ZeroEngine.step

    def step(self):
        k = self.config.micro_batches // self.world_size  # s(1/(S·M)) · M/N = s(1/(S·N))
        with Patch() as inner:
            inner.setattr(engine_module, "f32", lambda x: np.float32(x * k))
            return original(self)

    p.setattr(ZeroEngine, "step", step)


def plant_bias_correction_t_minus_1(p: Patch) -> None:
    from zero import optim as zoptim

    original = zoptim._scalars

    def stale(kind, hp, t, device):
        s = original(kind, hp, t, device)
        if kind != "sgd" and t > 1:
            prev = original(kind, hp, t - 1, device)
            s["step_size"], s["inv_sqrt_bc2"] = prev["step_size"], prev["inv_sqrt_bc2"]
        return s

    p.setattr(zoptim, "_scalars", stale)


def plant_reduce_order(p: Patch) -> None:
    from zero import collectives

    def ring(xs):
        n, r = len(xs), dist.get_rank()
        acc = xs[(r + 1) % n]
        for i in range(2, n + 1):
            acc = acc + xs[(r + i) % n]
        return acc

    p.setattr(collectives, "tree_sum", ring)


class _Nothing:
    def wait(self):
        return None


def plant_stale_prefetch(p: Patch) -> None:
    from zero.stages.stage3 import PartitionState, Stage3

    original = Stage3._transition

    def transition(self, u, to, phase):
        if to is PartitionState.SHARDED:  # the buffer keeps the last gather's values
            u.state = to
            return
        if to is PartitionState.GATHERING and u.working.untyped_storage().nbytes():
            u.state = to  # the prefetch trusts the buffer instead of gathering
            self.gathering[u.index] = _Nothing()
            return
        original(self, u, to, phase)

    p.setattr(Stage3, "_transition", transition)


def plant_overflow_one_rank(p: Patch) -> None:
    from zero.engine import ZeroEngine

    original = ZeroEngine._exchange  # the flag travels in the step's control exchange

    def exchange(self, *a, **kw):
        overflow, *rest = original(self, *a, **kw)
        return (overflow if self.rank == 0 else False, *rest)

    p.setattr(ZeroEngine, "_exchange", exchange)


def plant_loss_m_over_n(p: Patch) -> None:
    from zero.engine import ZeroEngine

    original = ZeroEngine._exchange

    def exchange(self, *a, **kw):
        overflow, bad, loss, partials = original(self, *a, **kw)
        k = self.config.micro_batches // self.world_size
        return overflow, bad, loss * k, partials

    p.setattr(ZeroEngine, "_exchange", exchange)


def plant_extra_all_gather_stage3(p: Patch) -> None:
    from zero.stages.stage3 import PartitionState, Stage3

    original = Stage3.end_backward

    def end_backward(self):
        if self.ctx.clock.microstep == 0 and self.units:  # once per step: a wasted gather
            u = self.units[-1]
            if u.state is PartitionState.SHARDED:
                self.gather(u, "param_fwd")
                self.transition(u, PartitionState.SHARDED)
        original(self)

    p.setattr(Stage3, "end_backward", end_backward)


def plant_decay_on_biases(p: Patch) -> None:
    from zero import build

    def group_index(config, named):
        return {pn: 0 for _, ps in named for pn, _ in ps}

    p.setattr(build, "group_index", group_index)


def plant_uncapped_clip(p: Patch) -> None:
    from reference.step import CLIP_EPS
    from zero import engine as engine_module

    def clip_coefficient(norm, clip_norm):
        if clip_norm is None:
            return None
        return np.float32(clip_norm / (float(norm) + CLIP_EPS))

    p.setattr(engine_module, "clip_coefficient", clip_coefficient)


def plant_unchecked_reduced_overflow(p: Patch) -> None:
    from zero.engine import ZeroEngine

    original = ZeroEngine._exchange

    def exchange(self, held, g, inv):
        if inv > 1:  # the check of R itself sees only finite zeros
            held = [torch.zeros_like(h) for h in held]
        return original(self, held, g, inv)

    p.setattr(ZeroEngine, "_exchange", exchange)


def plant_extra_partial_sum(p: Patch) -> None:
    from zero.stages.base import Accounting

    original = Accounting.partials

    def partials(self, u, peak):
        original(self, u, peak + 1)

    p.setattr(Accounting, "partials", partials)


def plant_half_width_pieces(p: Patch) -> None:
    from zero.zero_r.buckets import ConstantBuffers

    original = ConstantBuffers.__init__

    def init(self, elements, world_size):
        original(self, elements, world_size)
        self.width = max(1, self.width // 2)

    p.setattr(ConstantBuffers, "__init__", init)


def plant_fast_norm_misreported(p: Patch) -> None:
    from zero.engine import ZeroEngine

    original = ZeroEngine.step

    def step(self):
        res = original(self)
        if self.config.deterministic or res.norm is None:
            return res
        return dataclasses.replace(res, norm=res.norm * (1 + 1e-6))

    p.setattr(ZeroEngine, "step", step)


def plant_t_advances_on_skip(p: Patch) -> None:
    from zero.engine import ZeroEngine

    original = ZeroEngine.step

    def step(self):
        res = original(self)
        if res.skipped:
            self.t += 1
        return res

    p.setattr(ZeroEngine, "step", step)


# -- the features: ZeRO-R, offload, prefetch, C_B, scaler, clipping, groups, data, model, files --


def plant_microbatch_rank_major(p: Patch) -> None:
    import zero.train

    original = zero.train.train_steps

    def train_steps(engine, microbatch, steps, **kw):
        n, k = engine.world_size, engine.config.micro_batches // engine.world_size

        def mapped(step, j):  # j = k'·N + r on input; the bug hands out r·K + k'
            return microbatch(step, (j % n) * k + j // n)

        return original(engine, mapped, steps, **kw)

    p.everywhere(original, train_steps)


def plant_clip_first_unit_only(p: Patch) -> None:
    from zero import engine as engine_module

    original_coef, original_runs = engine_module.clip_coefficient, engine_module.step_runs
    pending: dict = {}

    def clip_coefficient(norm, clip_norm):
        pending["coef"] = original_coef(norm, clip_norm)
        return None  # the step's own loop scales nothing ...

    def step_runs(kind, groups, runs, t, master, grad, states, *, deterministic):
        coef = pending.pop("coef", None)  # ... and only the first unit's gradient is scaled
        if coef is not None:
            grad.mul_(torch.tensor(coef, device=grad.device))
        original_runs(kind, groups, runs, t, master, grad, states, deterministic=deterministic)

    p.setattr(engine_module, "clip_coefficient", clip_coefficient)
    p.setattr(engine_module, "step_runs", step_runs)


def plant_scaler_backoff_quarter(p: Patch) -> None:
    from zero import engine as engine_module

    original = engine_module.scaler_update

    def scaler_update(state, overflow, cfg):
        new = original(state, overflow, cfg)
        if overflow:  # backs off by backoff² (1/4) instead of backoff (1/2)
            new = dataclasses.replace(new, scale=max(new.scale * cfg.backoff, cfg.min_scale))
        return new

    p.setattr(engine_module, "scaler_update", scaler_update)


def plant_group_run_boundary(p: Patch) -> None:
    from zero.partition import Run, UnitPartition

    original = UnitPartition.runs

    def runs(self, *, whole=False):
        out = original(self, whole=whole)
        lo = 0 if whole else self.own.start
        starts = sorted(s.offset - lo for s in self.layout.slots)
        for i in range(1, len(out)):  # the previous group's run takes the next group's first
            a, b = out[i - 1], out[i]  # parameter element
            s = next((x for x in starts if b.start <= x < b.stop - 1), None)
            if s is not None:
                out[i - 1] = Run(start=a.start, stop=s + 1, group=a.group)
                out[i] = Run(start=s + 1, stop=b.stop, group=b.group)
        return out

    p.setattr(UnitPartition, "runs", runs)


def plant_arena_slots_overlap(p: Patch) -> None:
    from zero.zero_r.contiguous import ALIGN, CheckpointArena

    original = CheckpointArena.store

    def store(self, t):
        saved = original(self, t)
        arena = self.gen.arena
        if arena.cursor >= ALIGN:  # the cursor forgets one alignment step: slots overlap
            arena.cursor -= ALIGN
        return saved

    p.setattr(CheckpointArena, "store", store)


def plant_offload_grad_one_late(p: Patch) -> None:
    from zero.zero_r.offload import HostOffload

    original = HostOffload.down
    last: dict = {}

    def down(self, u, dst, src):
        key = (id(self), dst.data_ptr())
        prev = last.get(key)
        last[key] = src.detach().clone()
        return original(self, u, dst, src if prev is None else prev)

    p.setattr(HostOffload, "down", down)


def plant_offloaded_checkpoints_rounded(p: Patch) -> None:
    from zero.zero_r import activations

    original = activations.ActivationOffload.__init__

    def init(self, counter, unit, arena=None):
        original(self, counter, unit, arena)
        pack = self.pack_hook

        def rounded(t):  # "saves host memory": the checkpoint kept in bf16
            if t.is_floating_point() and t.dtype != torch.bfloat16:
                t = t.to(torch.bfloat16).to(t.dtype)
            return pack(t)

        self.pack_hook = rounded

    p.setattr(activations.ActivationOffload, "__init__", init)


def plant_prefetch_wrong_unit(p: Patch) -> None:
    from zero.stages.stage3 import Stage3

    def pre_backward(self, u):
        self.gather(u, "param_bwd")
        self.prefetch(self._neighbour(self.order, u, +1), "param_bwd")  # the one just done

    p.setattr(Stage3, "pre_backward", pre_backward)


def plant_persist_threshold_off_by_one(p: Patch) -> None:
    from zero import engine as engine_module
    from zero.stages import STAGE_CLASSES
    from zero.stages.stage3 import Persistent

    def stage_class(stage, numel, persist_below):
        if stage == 3 and numel < persist_below:  # < where docs/design.md §3 says <=
            return Persistent
        return STAGE_CLASSES[stage]

    p.setattr(engine_module, "stage_class", stage_class)


def plant_piece_drops_boundary(p: Patch) -> None:
    from zero.zero_r.buckets import ConstantBuffers

    original = ConstantBuffers.reduce_scatter

    def reduce_scatter(self, ctx, u, fn, flat, grads, tag):
        n = ctx.world_size

        def dropping(buf, **kw):
            cols = buf.view(n, -1)
            if cols.shape[1] > 1:  # each piece's last column is lost at the boundary
                cols[:, -1] = 0
            return fn(buf, **kw)

        return original(self, ctx, u, dropping, flat, grads, tag)

    p.setattr(ConstantBuffers, "reduce_scatter", reduce_scatter)


def plant_model_scales_input_in_place(p: Patch) -> None:
    from zero.models import MLP

    original = MLP.forward

    def forward(self, x, targets=None):
        x.mul_(0.5)  # meant: x = x * 0.5; the caller's batch is halved each time it is used
        return original(self, x, targets)

    p.setattr(MLP, "forward", forward)


def plant_load_scaler_fresh(p: Patch) -> None:
    from reference.precision import scaler_init
    from zero.engine import ZeroEngine

    original = ZeroEngine.load

    def load(self, directory, **kw):
        out = original(self, directory, **kw)
        if self.scaler is not None:  # the saved scaler is read, then forgotten
            self.scaler = scaler_init(self.config.scaler)
        return out

    p.setattr(ZeroEngine, "load", load)


def plant_consolidate_swaps_moments(p: Patch) -> None:
    import importlib

    from zero import checkpoint

    consolidate_mod = importlib.import_module("zero.checkpoint.consolidate")

    original = consolidate_mod.consolidate

    def consolidate(directory):
        ck = original(directory)
        for entry in ck["optimizer"]["state"].values():
            if "exp_avg" in entry:
                entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg_sq"], entry["exp_avg"]
        return ck

    p.setattr(consolidate_mod, "consolidate", consolidate)
    p.setattr(checkpoint, "consolidate", consolidate)


@dataclass(frozen=True, kw_only=True)
class Bug:
    """One planted bug."""

    breaks: str
    """What it breaks, in one line (the table's second column)."""
    where: str
    """Where it is observable, in words (the predicate's summary)."""
    plant: Callable[[Patch], None]
    """Patches the library; Patch undoes it."""
    kind: str = "cells"
    """'cells': run on --quick cells (matrix.OBSERVABLE); 'resume': on --resume rows."""


_TABLE = (
    # name, what it breaks, where it is observable, plant, kind
    ("one_ulp", "one master element on rank N-1 one ULP off",
     "deterministic, N ≥ 2", plant_one_ulp, "cells"),
    ("shard_offset", "ranks >= 1 take their shard one element early",
     "deterministic, N ≥ 2, stage ≥ 1", plant_shard_offset, "cells"),
    ("one_over_n_for_m", "averages by 1/(S·N), not 1/(S·M)",
     "deterministic, M > N, clipping off", plant_one_over_n_for_m, "cells"),
    ("bias_correction_t_minus_1", "Adam's bias corrections use step t-1",
     "deterministic, Adam(W), two optimizer steps", plant_bias_correction_t_minus_1, "cells"),
    ("reduce_order", "reduce-scatter sums in ring order, not the tree T",
     "deterministic, N ≥ 3, fp32 or widely spread gradients", plant_reduce_order, "cells"),
    ("stale_prefetch", "stage 3: a prefetched unit keeps its previous gather",
     "stage 3, overlap, real forward, tiny units", plant_stale_prefetch, "cells"),
    ("overflow_one_rank", "ranks 1..N-1 ignore the agreed overflow flag",
     "stage 0, non-finite gradients", plant_overflow_one_rank, "cells"),
    ("loss_m_over_n", "the reported loss is M/N times the mean",
     "M > N (any mode)", plant_loss_m_over_n, "cells"),
    ("extra_all_gather_stage3", "stage 3 gathers one unit too many per step",
     "stage 3 (counted collectives)", plant_extra_all_gather_stage3, "cells"),
    ("decay_on_biases", "the engine's grouping decays every parameter",
     "every cell (groups compared)", plant_decay_on_biases, "cells"),
    ("uncapped_clip", "clip coefficient not capped at 1 (norm below the limit)",
     "clipping on some steps only (BRANCHES)", plant_uncapped_clip, "cells"),
    ("unchecked_reduced_overflow", "R unchecked for overflow when S < 1/M",
     "loss scale < 1/M, overflow in R only", plant_unchecked_reduced_overflow, "cells"),
    ("extra_partial_sum", "the streaming tree keeps one partial-sum shard too many",
     "deterministic (resident bytes)", plant_extra_partial_sum, "cells"),
    ("half_width_pieces", "C_B pieces half as wide as allowed",
     "bucket_elements set (reduce-scatter calls)", plant_half_width_pieces, "cells"),
    ("fast_norm_misreported", "fast mode reports its norm 1e-6 too large",
     "fast mode (norm bitwise against the pinned order)", plant_fast_norm_misreported, "cells"),
    ("t_advances_on_skip", "a skipped step counts as an optimizer step",
     "a skipped step", plant_t_advances_on_skip, "cells"),
    # the features: ZeRO-R, offload, prefetch, C_B, scaler, clipping, groups, data, model
    ("microbatch_rank_major", "rank r runs micro-batch r·K + k, not k·N + r",
     "deterministic, backward, N ≥ 2, M > N, fp32", plant_microbatch_rank_major, "cells"),
    ("clip_first_unit_only", "clipping (norm above the limit) scales the first unit only",
     "deterministic, tiny units, steps that clip", plant_clip_first_unit_only, "cells"),
    ("scaler_backoff_quarter", "the loss scaler backs off by 1/4, not 1/2",
     "fp16 with a skipped step", plant_scaler_backoff_quarter, "cells"),
    ("group_run_boundary", "a group's first element gets the previous group's hypers",
     "deterministic, a unit holding both groups", plant_group_run_boundary, "cells"),
    ("arena_slots_overlap", "M_D checkpoint arena: consecutive slots overlap",
     "deterministic, contiguous memory + checkpointing", plant_arena_slots_overlap, "cells"),
    ("offload_grad_one_late", "offload: the host gradient is one copy behind",
     "optimizer offload, two optimizer steps", plant_offload_grad_one_late, "cells"),
    ("offloaded_checkpoints_rounded", "offloaded activation checkpoints kept in bf16",
     "deterministic, checkpointing + offload, fp32/fp16",
     plant_offloaded_checkpoints_rounded, "cells"),
    ("prefetch_wrong_unit", "stage 3 backward prefetches the unit just done",
     "stage 3, overlap, real forward, tiny units", plant_prefetch_wrong_unit, "cells"),
    ("persist_threshold_off_by_one", "stage 3 persists numel < persist_below, not <=",
     "stage 3, a unit of exactly persist_below (PLANTED_GAPS)",
     plant_persist_threshold_off_by_one, "cells"),
    ("piece_drops_boundary", "C_B: each piece's last column is not reduced",
     "deterministic, bucket_elements set", plant_piece_drops_boundary, "cells"),
    ("model_scales_input_in_place", "model code: the MLP halves its input in place",
     "the MLP's own backward in fp32", plant_model_scales_input_in_place, "cells"),
    ("load_scaler_fresh", "load restores everything but the loss scaler",
     "fp16 resume rows", plant_load_scaler_fresh, "resume"),
    ("consolidate_swaps_moments", "consolidation swaps exp_avg and exp_avg_sq",
     "Adam(W) resume rows (consolidation)", plant_consolidate_swaps_moments, "resume"),
)  # fmt: skip
BUGS: dict[str, Bug] = {
    name: Bug(breaks=breaks, where=where, plant=plant, kind=kind)
    for name, breaks, where, plant, kind in _TABLE
}
"""The planted bugs by name, in the order of the table."""


RESUME_OBSERVABLE: dict[str, Callable] = {
    # the scaler is compared after the resume; only fp16 has one
    "load_scaler_fresh": lambda case: case.precision == "fp16",
    # the consolidated states are compared with the engine's bit for bit; Adam and AdamW only
    "consolidate_swaps_moments": lambda case: case.optimizer in ("adam", "adamw"),
}


def observable(name: str, *, quick=None) -> list:
    """The --quick cells (or --resume quick cases) where bug `name` must show."""
    if BUGS[name].kind == "resume":
        return [c for c in resume_mod.resume_cases(quick=True) if RESUME_OBSERVABLE[name](c)]
    cells = quick if quick is not None else matrix.quick()[0]
    return [c for c in cells if matrix.OBSERVABLE[name](c)]


def cost(c) -> int:
    """A rough cost to pick the cheapest cells (ranks · micro-batches · steps; forward 4x)."""
    if isinstance(c, Cell):
        return c.world_size * c.micro_batches * c.steps * (4 if c.gradients == "backward" else 1)
    return c.n1 + c.n2 + 8 * (c.model == "gpt")


def run_planted(rank: int, n: int, bug: str, cells: list[Cell]) -> list[dict]:
    """On every rank: run_cells with the bug planted (a pool worker's entry point)."""
    with Patch() as p:
        BUGS[bug].plant(p)
        return run_cells(rank, n, cells)


def planted_resume_rank(rank: int, n: int, *args, bug: str):
    """verify.resume.run_rank with the bug planted (a pool worker's entry point)."""
    with Patch() as p:
        BUGS[bug].plant(p)
        return resume_mod.run_rank(rank, n, *args)


def check_of(row: dict) -> str:
    """Which check a failing row failed first: reported / traffic / memory / state / ..."""
    why = row.get("first_mismatch", "")
    for word, check in (
        ("raised", "raised"),
        ("failed", "raised"),
        ("consolidat", "consolidation"),
        ("traffic", "traffic"),
        ("resident bytes", "memory"),
        ("units:", "units"),
        ("parameter groups", "groups"),
        ("bound exceeded", "bound"),
        ("loss", "reported"),
        ("global norm", "reported"),
        ("skip decision", "reported"),
        ("step count", "reported"),
        ("data step", "reported"),
        ("scaler", "state"),
    ):
        if word in why:
            return check
    return "state" if why else ""


def run_bug(name: str, chosen: list, *, timeout_s: float = 300) -> list[dict]:
    """Rows of bug `name` planted on `chosen` (cells or resume cases); each with `passed`."""
    from zero.launch import get_pool

    if BUGS[name].kind == "resume":
        rows = []
        runner = functools.partial(planted_resume_rank, bug=name)
        for case in chosen:
            with tempfile.TemporaryDirectory(prefix="zero-planted-") as tmp, Patch() as p:
                BUGS[name].plant(p)  # in this process too: consolidation runs here
                try:
                    rows.append(resume_mod.run_case(case, tmp, timeout_s=timeout_s, rank_fn=runner))
                except Exception as exc:  # a broken run is a caught bug, reported as raised
                    first = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    rows.append(
                        {
                            "passed": False,
                            "first_mismatch": first,
                            "config": dataclasses.asdict(case),
                        }
                    )
        return rows
    rows = []
    for n in sorted({c.world_size for c in chosen}):
        mine = [c for c in chosen if c.world_size == n]
        per_rank = get_pool(n).run(run_planted, name, mine, timeout_s=timeout_s)
        rows += [merge(c, [r[i] for r in per_rank]) for i, c in enumerate(mine)]
    return rows


def run(bugs=None, *, cheap: bool = False, say=print) -> list[dict]:
    """One summary per bug: {bug, breaks, kind, observable, ran, caught, first_check,
    first_mismatch, seconds, missed}. cheap: the two cheapest observable cells per bug."""
    quick = matrix.quick()[0]
    out = []
    for name in bugs or list(BUGS):
        every = observable(name, quick=quick)
        chosen = sorted(every, key=cost)[:2] if cheap else every
        started = time.perf_counter()
        rows = run_bug(name, chosen) if chosen else []
        caught = [r for r in rows if not r["passed"]]
        summary = {
            "bug": name,
            "breaks": BUGS[name].breaks,
            "kind": BUGS[name].kind,
            "observable": len(every),
            "ran": len(rows),
            "caught": len(caught),
            "first_check": check_of(caught[0]) if caught else "",
            "first_mismatch": caught[0].get("first_mismatch", "") if caught else "",
            "missed": [r["config"] for r in rows if r["passed"]],
            "seconds": round(time.perf_counter() - started, 1),
        }
        say(f"{name:<32} caught {summary['caught']}/{summary['ran']} "
            f"(observable {len(every)})  {summary['first_check']}: "
            f"{summary['first_mismatch'][:90]}")  # fmt: skip
        out.append(summary)
    return out


def markdown(summaries: list[dict]) -> str:
    """The table of a run: bug | breaks | observable where | caught / observable | first check."""
    lines = [
        "| planted bug | what it breaks | observable where | caught / observable | first check |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        where = "`--resume` rows" if s["kind"] == "resume" else "`--quick` cells"
        count = f"{s['caught']}/{s['observable']} {where}"
        if s["ran"] != s["observable"]:
            count = f"{s['caught']}/{s['ran']} run ({s['observable']} observable {where})"
        lines.append(
            f"| `{s['bug']}` | {s['breaks']} | {BUGS[s['bug']].where} | {count} "
            f"| {s['first_check']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m verify.planted", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--bugs", nargs="+", default=None, choices=list(BUGS))
    ap.add_argument("--cheap", action="store_true", help="the two cheapest cells per bug")
    ap.add_argument("--json", default=None, help="write the summaries here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    ap.add_argument("--list", action="store_true", help="print the bugs and their cells")
    args = ap.parse_args(argv)
    if args.list:
        quick = matrix.quick()[0]
        for name, bug in BUGS.items():
            print(f"{name:<32} {len(observable(name, quick=quick)):>4}  {bug.breaks}")
        return 0
    summaries = run(args.bugs, cheap=args.cheap)
    if args.json:
        from zero.results import write_json

        write_json(args.json, {"planted": summaries, "cheap": args.cheap})
    if args.markdown:
        Path(args.markdown).write_text(markdown(summaries))
    print(markdown(summaries))
    missed = [s["bug"] for s in summaries if s["caught"] < s["ran"] or not s["ran"]]
    if missed:
        print(f"NOT CAUGHT everywhere: {missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
