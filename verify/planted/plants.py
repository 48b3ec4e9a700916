"""The plant functions of verify/planted/suite.py's bugs, and Patch, the monkeypatch they use.

Each plant_<name>(p) patches the library through p (a Patch, undone on exit), so that the
library's own code path never changes: the bug exists only while planted. Each patch is the
smallest change that makes a realistic mistake (an off-by-one, a stale copy, a wrong factor, a
wrong neighbour) in one place: the engine's step, a stage, a ZeRO-R policy, the training loop,
the model, or the checkpoint code. What each breaks and where it must show: verify/planted/suite.py.
The bugs of a feature (verify/features/) live in its record, beside the feature.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch
import torch.distributed as dist


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
        other modules imported by name, as `from zero.loop import train_steps` does)."""
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
    from zero.optim import update as zoptim

    original = zoptim.step_scalars  # both kernels (compiled loop, torch ops) read it

    def stale(kind, hp, t):
        s = dict(original(kind, hp, t))
        if kind != "sgd" and t > 1:
            prev = original(kind, hp, t - 1)
            s["step_size"], s["inv_sqrt_bc2"] = prev["step_size"], prev["inv_sqrt_bc2"]
        return s

    p.setattr(zoptim, "step_scalars", stale)


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
    from zero import control

    original = control.step_exchange  # the flag travels in the step's control exchange

    def exchange(engine, *a, **kw):
        agreed = original(engine, *a, **kw)
        return dataclasses.replace(agreed, overflow=agreed.overflow and engine.rank == 0)

    p.setattr(control, "step_exchange", exchange)


def plant_loss_m_over_n(p: Patch) -> None:
    from zero import control

    original = control.step_exchange

    def exchange(engine, *a, **kw):
        agreed = original(engine, *a, **kw)
        k = engine.config.micro_batches // engine.world_size
        return dataclasses.replace(agreed, loss=agreed.loss * k)

    p.setattr(control, "step_exchange", exchange)


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


def plant_decay_rule_vectors(p: Patch) -> None:
    """The library's grouping predicate itself off by one dimension: every parameter decays.
    verify's reference side once called the same predicate, so this moved both sides alike."""
    from zero import config

    def decay_matrices_only(name, param):
        del name
        return 0 if param.ndim >= 1 else 1

    p.everywhere(config.decay_matrices_only, decay_matrices_only)


def plant_uncapped_clip(p: Patch) -> None:
    from reference.step import CLIP_EPS
    from zero import engine as engine_module

    def clip_coefficient(norm, clip_norm):
        if clip_norm is None:
            return None
        return np.float32(clip_norm / (float(norm) + CLIP_EPS))

    p.setattr(engine_module, "clip_coefficient", clip_coefficient)


def plant_unchecked_reduced_overflow(p: Patch) -> None:
    from zero import control

    original = control.step_exchange

    def exchange(engine, held, g, inv):
        if inv > 1:  # the check of R itself sees only finite zeros
            held = [torch.zeros_like(h) for h in held]
        return original(engine, held, g, inv)

    p.setattr(control, "step_exchange", exchange)


def plant_extra_partial_sum(p: Patch) -> None:
    from zero.stages.base import Accounting

    original = Accounting.partials

    def partials(self, u, peak):
        original(self, u, peak + 1)

    p.setattr(Accounting, "partials", partials)


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


def plant_unused_updated(p: Patch) -> None:
    from zero import engine as engine_module
    from zero.optim import update as zoptim

    original = zoptim.live_runs

    def every_run(runs, slots, lo, used, steps):  # the old rule: used or not, updated
        return original(runs, slots, lo, [True] * len(used), steps)

    p.setattr(engine_module, "live_runs", every_run)


# -- prefetch, scaler, clipping, groups, data, model, files ---------------------------------------


def plant_microbatch_rank_major(p: Patch) -> None:
    import zero.workloads.train

    original = zero.loop.train_steps

    def train_steps(engine, microbatch, steps, **kw):
        n, k = engine.world_size, engine.config.micro_batches // engine.world_size

        def mapped(step, j):  # j = k'·N + r on input; the bug hands out r·K + k'
            return microbatch(step, (j % n) * k + j // n)

        return original(engine, mapped, steps, **kw)

    p.everywhere(original, train_steps)


def plant_clip_first_unit_only(p: Patch) -> None:
    from zero import engine as engine_module

    original_coef, original_update = engine_module.clip_coefficient, engine_module.step_shards
    pending: dict = {}

    def clip_coefficient(norm, clip_norm):
        pending["coef"] = original_coef(norm, clip_norm)
        return None  # the step's own loop scales nothing ...

    def step_shards(kind, groups, shards, *, deterministic):
        coef = pending.pop("coef", None)  # ... and only the first unit's gradient is scaled
        if coef is not None and shards:
            shards[0].grad.mul_(torch.tensor(coef))
        original_update(kind, groups, shards, deterministic=deterministic)

    p.setattr(engine_module, "clip_coefficient", clip_coefficient)
    p.setattr(engine_module, "step_shards", step_shards)


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


def plant_model_scales_input_in_place(p: Patch) -> None:
    from zero.workloads.models import MLP

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


# -- the bugs of base pairs (verify/cells/interactions.py): each shows only where the pair meets
# -------


def plant_runs_cut_on_use_only(p: Patch) -> None:
    """[Note: skipping unused parameters] with runs cut where use changes but not where the step
    count does: a piece spanning two parameters takes the first one's t_p. With one parameter
    per run (two alternating groups) nothing spans, so only unused × one group × one unit
    shows it."""
    from zero import engine as engine_module
    from zero.partition import Run

    def live_runs(runs, slots, lo, used, steps):
        out = []
        for run in runs:
            pieces = []
            for slot, use, t_p in zip(slots, used, steps, strict=True):
                a = max(slot.offset - lo, run.start)
                b = min(slot.offset + slot.numel - lo, run.stop)
                if a < b and (not pieces or pieces[-1][1] != use):
                    pieces.append((a if pieces else run.start, use, t_p + 1))
            for i, (start, use, t_p) in enumerate(pieces):
                stop = pieces[i + 1][0] if i + 1 < len(pieces) else run.stop
                if use:
                    out.append((Run(start=start, stop=stop, group=run.group), t_p))
        return out

    p.setattr(engine_module, "live_runs", live_runs)
