"""The harness has teeth: deliberately broken engines must be reported failing.

Each bug is planted by patching the engine inside the worker function (pytest.MonkeyPatch, undone
when the cells are done), and run on cells of the --quick preset where verify.matrix.OBSERVABLE
says it is observable. Every such cell must fail; the same cells pass unpatched in the --quick
run (tests/distributed/test_verify_cli.py). The fast tier runs the two cheapest observable cells
per bug;
the release tier runs every observable cell of --quick, which also checks the predicates.

The bugs:
  one_ulp                     one element of one shard of the fp32 master, on the last rank,
                              one ULP off after the first optimizer step
  shard_offset                every rank r >= 1 takes its shard one element early
  one_over_n_for_m            averaging by 1/(S·N) instead of 1/(S·M) (a missing 1/M when
                              several micro-batches accumulate)
  bias_correction_t_minus_1   Adam's bias corrections computed with the previous step count
  reduce_order                the deterministic reduce-scatter sums in ring order (rank r from
                              rank r+1 onwards, left to right) instead of the tree T
  stale_prefetch              stage 3: a prefetched unit is not re-gathered, so forward uses
                              the values of its previous gather (the previous step's parameters)
  overflow_one_rank           ranks 1..N-1 ignore the agreed overflow flag: rank 0 alone skips
  loss_m_over_n               the reported loss is M/N times the mean (a per-rank sum of the
                              micro-batch losses divided by N, not by M): the state is right
  extra_all_gather_stage3     stage 3 gathers one more unit per step (and frees it again): the
                              same bits, one all-gather too many
  decay_on_biases             the engine's grouping puts every parameter, biases included, in
                              group 0 (weight decay); the reference takes its groups from the
                              config's group_of, not from the engine
  uncapped_clip               the clip coefficient is not capped at 1: a step whose norm is below
                              clip_norm scales its gradients up
  unchecked_reduced_overflow  with a loss scale below 1/M the engine no longer checks R itself
                              for overflow (docs/design.md §2): an inf in R only is not skipped
  extra_partial_sum           the streaming tree keeps one partial-sum shard more than it needs
                              (docs/design.md §3: floor(log2(M/N))): the same bits, more memory
  half_width_pieces           C_B pieces half as wide as C_B allows: the same bits and volume,
                              twice the reduce-scatter calls
  fast_norm_misreported       in fast mode the step reports its norm one part in 10^6 too large
                              (the norm used for clipping is right)
  t_advances_on_skip          a skipped step still counts as an optimizer step (harmless to SGD's
                              state, so only the reported step count shows it)
  unused_updated              a parameter no micro-batch had a gradient for is still updated
                              with zeros (decay and moments move it), where torch.optim skips it
"""

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from reference.step import CLIP_EPS
from verify import matrix
from verify.harness import run_cells
from verify.report import merge
from zero import build, collectives
from zero import engine as engine_module
from zero import optim as zoptim
from zero.engine import ZeroEngine
from zero.launch import get_pool
from zero.partition import UnitPartition
from zero.stages.base import Accounting
from zero.stages.stage3 import PartitionState, Stage3
from zero.zero_r.buckets import ConstantBuffers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def plant_one_ulp(mp):
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

    mp.setattr(ZeroEngine, "step", step)


def plant_shard_offset(mp):
    def own(self):
        start = self.rank * self.shard_numel - (1 if self.rank else 0)
        return slice(start, start + self.shard_numel)

    mp.setattr(UnitPartition, "own", property(own))


def plant_one_over_n_for_m(mp):
    original = ZeroEngine.step

    def step(self):
        k = self.config.micro_batches // self.world_size  # s(1/(S·M)) · M/N = s(1/(S·N))
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(engine_module, "f32", lambda x: np.float32(x * k))
            return original(self)

    mp.setattr(ZeroEngine, "step", step)


def plant_bias_correction_t_minus_1(mp):
    original = zoptim._scalars

    def stale(kind, hp, t, device):
        s = original(kind, hp, t, device)
        if kind != "sgd" and t > 1:
            prev = original(kind, hp, t - 1, device)
            s["step_size"], s["inv_sqrt_bc2"] = prev["step_size"], prev["inv_sqrt_bc2"]
        return s

    mp.setattr(zoptim, "_scalars", stale)


def plant_reduce_order(mp):
    def ring(xs):
        n, r = len(xs), dist.get_rank()
        acc = xs[(r + 1) % n]
        for i in range(2, n + 1):
            acc = acc + xs[(r + i) % n]
        return acc

    mp.setattr(collectives, "tree_sum", ring)


class _Nothing:
    def wait(self):
        return None


def plant_stale_prefetch(mp):
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

    mp.setattr(Stage3, "_transition", transition)


def plant_overflow_one_rank(mp):
    if hasattr(ZeroEngine, "_exchange"):  # the flag travels in the step's control exchange
        original = ZeroEngine._exchange

        def exchange(self, *a, **kw):
            overflow, *rest = original(self, *a, **kw)
            return (overflow if self.rank == 0 else False, *rest)

        mp.setattr(ZeroEngine, "_exchange", exchange)
    else:  # the flag is its own MAX all-reduce
        original = collectives.any_flag

        def any_flag(flag, **kw):
            agreed = original(flag, **kw)
            return agreed if dist.get_rank() == 0 else False

        mp.setattr(collectives, "any_flag", any_flag)


def plant_loss_m_over_n(mp):
    original = ZeroEngine._exchange

    def exchange(self, *a, **kw):
        overflow, bad, loss, *rest = original(self, *a, **kw)
        k = self.config.micro_batches // self.world_size
        return overflow, bad, loss * k, *rest

    mp.setattr(ZeroEngine, "_exchange", exchange)


def plant_extra_all_gather_stage3(mp):
    original = Stage3.end_backward

    def end_backward(self):
        if self.ctx.clock.microstep == 0 and self.units:  # once per step: a wasted gather
            u = self.units[-1]
            if u.state is PartitionState.SHARDED:
                self.gather(u, "param_fwd")
                self.transition(u, PartitionState.SHARDED)
        original(self)

    mp.setattr(Stage3, "end_backward", end_backward)


def plant_decay_on_biases(mp):
    def group_index(config, named):
        return {pn: 0 for _, ps in named for pn, _ in ps}

    mp.setattr(build, "group_index", group_index)


def plant_uncapped_clip(mp):
    def clip_coefficient(norm, clip_norm):
        if clip_norm is None:
            return None
        return np.float32(clip_norm / (float(norm) + CLIP_EPS))

    mp.setattr(engine_module, "clip_coefficient", clip_coefficient)


def plant_unchecked_reduced_overflow(mp):
    original = ZeroEngine._exchange

    def exchange(self, held, g, inv):
        if inv > 1:  # the check of R itself sees only finite zeros
            held = [torch.zeros_like(h) for h in held]
        return original(self, held, g, inv)

    mp.setattr(ZeroEngine, "_exchange", exchange)


def plant_extra_partial_sum(mp):
    original = Accounting.partials

    def partials(self, u, peak):
        original(self, u, peak + 1)

    mp.setattr(Accounting, "partials", partials)


def plant_half_width_pieces(mp):
    original = ConstantBuffers.__init__

    def init(self, elements, world_size):
        original(self, elements, world_size)
        self.width = max(1, self.width // 2)

    mp.setattr(ConstantBuffers, "__init__", init)


def plant_fast_norm_misreported(mp):
    original = ZeroEngine.step

    def step(self):
        res = original(self)
        if self.config.deterministic or res.norm is None:
            return res
        return dataclasses.replace(res, norm=res.norm * (1 + 1e-6))

    mp.setattr(ZeroEngine, "step", step)


def plant_t_advances_on_skip(mp):
    original = ZeroEngine.step

    def step(self):
        res = original(self)
        if res.skipped:
            self.t += 1
        return res

    mp.setattr(ZeroEngine, "step", step)


def plant_unused_updated(mp):
    original = zoptim.live_runs

    def every_run(runs, slots, lo, used, steps):  # the old rule: used or not, updated
        return original(runs, slots, lo, [True] * len(used), steps)

    mp.setattr(engine_module, "live_runs", every_run)


BUGS = {
    "one_ulp": plant_one_ulp,
    "shard_offset": plant_shard_offset,
    "one_over_n_for_m": plant_one_over_n_for_m,
    "bias_correction_t_minus_1": plant_bias_correction_t_minus_1,
    "reduce_order": plant_reduce_order,
    "stale_prefetch": plant_stale_prefetch,
    "overflow_one_rank": plant_overflow_one_rank,
    "loss_m_over_n": plant_loss_m_over_n,
    "extra_all_gather_stage3": plant_extra_all_gather_stage3,
    "decay_on_biases": plant_decay_on_biases,
    "uncapped_clip": plant_uncapped_clip,
    "unchecked_reduced_overflow": plant_unchecked_reduced_overflow,
    "extra_partial_sum": plant_extra_partial_sum,
    "half_width_pieces": plant_half_width_pieces,
    "fast_norm_misreported": plant_fast_norm_misreported,
    "t_advances_on_skip": plant_t_advances_on_skip,
    "unused_updated": plant_unused_updated,
}


def run_planted(rank, n, bug, cells):
    with pytest.MonkeyPatch.context() as mp:
        BUGS[bug](mp)
        return run_cells(rank, n, cells)


def observable(bug):
    cells, _ = matrix.quick()
    return [c for c in cells if matrix.OBSERVABLE[bug](c)]


def cost(c):
    return c.world_size * c.micro_batches * c.steps * (4 if c.gradients == "backward" else 1)


def verdicts(bug, cells):
    rows = []
    for n in sorted({c.world_size for c in cells}):
        mine = [c for c in cells if c.world_size == n]
        per_rank = get_pool(n).run(run_planted, bug, mine, timeout_s=300)
        rows += [merge(c, [r[i] for r in per_rank]) for i, c in enumerate(mine)]
    return rows


def test_every_bug_has_a_predicate_and_the_quick_preset_a_cell_for_it():
    assert set(BUGS) == set(matrix.OBSERVABLE)
    for bug in BUGS:
        assert observable(bug), f"--quick has no cell where {bug} is observable"


@pytest.mark.parametrize("bug", list(BUGS))
def test_quick_cells_catch_the_planted_bug(bug):
    chosen = sorted(observable(bug), key=cost)[:2]
    rows = verdicts(bug, chosen)
    assert rows and all(not r["passed"] for r in rows), [
        (r["config"], r["first_mismatch"]) for r in rows if r["passed"]
    ]


@pytest.mark.full
@pytest.mark.parametrize("bug", list(BUGS))
def test_every_observable_quick_cell_catches_the_planted_bug(bug):
    rows = verdicts(bug, observable(bug))
    assert all(not r["passed"] for r in rows), [
        (r["config"], r["first_mismatch"]) for r in rows if r["passed"]
    ]
