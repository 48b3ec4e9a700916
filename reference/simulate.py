"""ZeRO stages 0-3 on N simulated ranks, in NumPy: explicit buffers, counted collectives.

For teaching and property tests. Every rank is an object with its own flat buffers; collectives
are functions over all ranks' buffers that also log what each rank sends. The result must be the
same bits as reference/step.py's train_step (deterministic mode), which is what makes the claim
"partitioning changes nothing numerically" checkable.

The shape is the engine's ladder (zero/stages/stage0.py .. stage3.py) and notebook 02's stage cells:
Stage0 holds the whole step; Stage1, Stage2 and Stage3 are small subclasses that override only
what their partition changes (extent, grad_numel, allocate, reduce_microstep, finish_reduction,
norm_partials, refresh_working, pre_forward/pre_backward). World(..., stage=s) picks STAGES[s].

Legend (ZeRO paper §5, docs/design.md §2-§3):
    stage 0  baseline data parallelism: everything replicated
    stage 1  P_os: fp32 master and optimizer states partitioned
    stage 2  P_os+g: + reduced gradients partitioned
    stage 3  P_os+g+p: + working parameters partitioned, gathered per unit for fwd and bwd
    L        shard length of a unit, N*L its padded length; rank r owns [r*L, (r+1)*L)
    Ψ        real parameter count; volumes below are per rank, in elements, per step

Communication per step (× (N-1)/N, M micro-batches): stage 0-2 deterministic (M/N + 1)Ψ
(reduce-scatter each micro-step, then one all-gather: of gradients at stage 0, of parameters at
1-2); fast 2Ψ at stages 0-1 (local accumulation, then all-reduce or reduce-scatter + all-gather)
and (M/N + 1)Ψ at stage 2; stage 3 3Ψ·M/N in both modes. Elements sent include padding; the log
also says how many of them are padding. Control traffic (overflow flag, used-parameter flags, norm
partials) is logged as kind="control" and kept apart. The ranks' buffers and the collectives
between them are reference/ranks.py's (importable from here too).

Fast mode sums in another order (local accumulation first, then across ranks), so it is *not*
the reference's bits; it is within the summation's forward-error bound instead.
"""

from __future__ import annotations

import numpy as np

from . import optim
from .precision import DTYPES, cast, f32, scaler_update
from .ranks import Rank, Sent, all_gather, all_reduce, all_reduce_max, reduce_scatter
from .step import (
    ModelSpec,
    StepConfig,
    StepInfo,
    TrainState,
    clip_coefficient,
    complete,
    init_state,
    used_names,
)
from .tree import StreamingTree, chunk_sumsq, global_norm

MODES = ("deterministic", "fast")


class Stage0:
    """Stage 0, baseline data parallelism, on N simulated ranks: every rank holds everything.

    The step's skeleton lives here, as in zero/stages/stage0.py; Stage1-3 below override only what
    their partition changes, so each reads as a diff of the one before. Starts from the same
    state as the reference's init_state(master, spec, cfg).
    """

    stage = 0

    def __init__(
        self, master, spec: ModelSpec, cfg: StepConfig, *, mode: str = "deterministic", frozen=()
    ):
        """frozen: [(unit name, UnitLayout, {name: value})] of the units' frozen parameters
        (docs/design.md §2): held in the compute dtype, never reduced nor updated; stage 3
        shards them and gathers them with their unit (forward; backward but for the root)."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: allowed are {MODES}")
        self.spec, self.cfg, self.mode = spec, cfg, mode
        self.n = n = cfg.world_size
        self.state = init_state(master, spec, cfg)  # scalars only are read from it below
        self.log: list[list[Sent]] = [[] for _ in range(n)]  # this step's traffic, per rank
        self.ranks = [Rank(r) for r in range(n)]
        self.shard = [lay.shard_numel(n) for lay in spec.layouts]  # L per unit
        # padding[u][r]: padding elements inside rank r's shard of unit u
        self.padding = [
            [int((~m[r * L : (r + 1) * L]).sum()) for r in range(n)]
            for m, L in zip((lay.real_mask(n) for lay in spec.layouts), self.shard, strict=True)
        ]
        self.red = DTYPES[cfg.reduction]
        for u, lay in enumerate(spec.layouts):
            master_full = lay.flatten(self.state.master, n, np.float32)
            names = sorted({x for s in lay.slots for x in self._state_names(s.name)})
            for rk in self.ranks:
                self.allocate(rk, u, master_full)
                rk.opt.append({x: np.zeros(rk.master[u].size, np.float32) for x in names})
                rk.grad.append(np.zeros(self.grad_numel(u), self.red))
                rk.peak_partials.append(0)
        self.frozen = [(name, lay) for name, lay, _ in frozen]
        self.frozen_shard = [lay.shard_numel(n) for _, lay in self.frozen]
        self.frozen_padding = [
            [int((~lay.real_mask(n)[r * L : (r + 1) * L]).sum()) for r in range(n)]
            for (_, lay), L in zip(self.frozen, self.frozen_shard, strict=True)
        ]
        for f, (_, lay, values) in enumerate(frozen):
            full = cast(lay.flatten(values, n, np.float32), cfg.precision)
            for rk in self.ranks:
                rk.frozen.append(self.hold_frozen(rk, f, full))

    # -- what the partition decides (the methods Stage1-3 override) ------------------------

    def own(self, rk: Rank, u: int) -> slice:
        """Rank rk's shard of unit u in the padded buffer."""
        return slice(rk.rank * self.shard[u], (rk.rank + 1) * self.shard[u])

    def extent(self, rk: Rank, u: int) -> slice:
        """The part of unit u whose master, optimizer states and gradient rk keeps: all of it."""
        return slice(0, self.n * self.shard[u])

    def allocate(self, rk: Rank, u: int, master_full: np.ndarray) -> None:
        """The full working copy; the master is its view in pure fp32, else an fp32 copy."""
        rk.working.append(cast(master_full, self.cfg.precision))
        fp32 = self.cfg.precision == "fp32"
        ext = self.extent(rk, u)
        rk.master.append(rk.working[u][ext] if fp32 else master_full[ext].copy())

    def grad_numel(self, u: int) -> int:
        return self.n * self.shard[u]  # a full-size gradient buffer

    def held_grad(self, rk: Rank, u: int) -> np.ndarray:
        """The part of R that rk optimises, a view into its gradient buffer."""
        return rk.grad[u][self.extent(rk, u)]

    def hold_frozen(self, rk: Rank, f: int, full: np.ndarray) -> np.ndarray:
        """Frozen unit f's buffer on rk: all of it."""
        return full.copy()

    def gather_frozen(self, f: int, phase: str) -> None:
        """Frozen parameters are resident: nothing to gather."""

    def pre_forward(self, u: int) -> None:
        """Every unit's parameters are resident: nothing to gather."""

    def pre_backward(self, u: int) -> None:
        """Every unit's parameters are resident: nothing to gather."""

    def reduce_microstep(self, u: int, bufs, streams, acc) -> None:
        """One micro-step's gradients of unit u: reduce-scatter now and stream the parts into
        the tree (deterministic), or accumulate locally, as DDP's no_sync (fast)."""
        if self.mode == "fast":
            _accumulate(acc, bufs)
            return
        for s, part in zip(streams, self._reduce_scatter(u, bufs, "grad"), strict=True):
            s.push(part)

    def finish_reduction(self, u: int, streams, acc) -> list[np.ndarray]:
        """Every rank needs all of R: all-gather the reduced shards (or all-reduce, fast)."""
        if self.mode == "fast":
            return all_reduce(acc, self.shard[u], self.padding[u], self.log, **self._tag(u, "grad"))
        parts = self._tree_results(u, streams)
        return all_gather(parts, self.padding[u], self.log, **self._tag(u, "grad_gather"))

    def norm_partials(self, u: int, g_u) -> np.ndarray:
        """Every rank holds the whole gradient: its chunk partials, no traffic."""
        return chunk_sumsq(g_u[0], self.spec.layouts[u].chunk)

    def refresh_working(self, u: int) -> None:
        """Cast the updated master locally (in pure fp32 the master is the working copy)."""
        if self.cfg.precision != "fp32":
            for rk in self.ranks:
                rk.working[u][:] = cast(rk.master[u], self.cfg.precision)

    # -- one step (shared by every stage) --------------------------------------------------

    def step(self, grads) -> StepInfo:
        """grads[j]: micro-batch j's gradients (name -> compute-dtype array), on rank j mod N."""
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected, then skipped
            return self._step(grads)

    def _step(self, grads) -> StepInfo:
        cfg, n, state, units = self.cfg, self.n, self.state, range(len(self.spec.layouts))
        m = len(grads)
        if m != cfg.micro_batches:
            raise ValueError(f"grads: got {m} micro-batches, config says {cfg.micro_batches}")
        self.log = [[] for _ in range(n)]
        scale = state.scaler.scale if state.scaler is not None else 1.0
        local_bad = [False] * n
        streams = [[StreamingTree() for _ in range(n)] for _ in units]  # deterministic mode
        acc: list[list] = [[None] * n for _ in units]  # fast mode's running sums
        # [Note: unused parameters] each rank ORs "had a gradient" over its micro-batches;
        # the absent ones enter its buffers as zeros
        mine = [
            set().union(*(used_names(grads[j : j + 1], self.spec) for j in range(r, m, n)))
            for r in range(n)
        ]
        grads = [complete(g, self.spec, cfg.precision) for g in grads]
        for k in range(m // n):
            for u in units:
                self.pre_forward(u)
            for f, (name, _) in enumerate(self.frozen):  # the frozen parts, with their units
                self.gather_frozen(f, "param_fwd")
                if name:  # the root stays gathered through backward
                    self.gather_frozen(f, "param_bwd")
            for u in reversed(units):  # backward runs the units in reverse
                self.pre_backward(u)
                bufs = [
                    self.spec.layouts[u].flatten(grads[k * n + r], n, self.red) for r in range(n)
                ]
                local_bad = [b or not_finite(x) for b, x in zip(local_bad, bufs, strict=True)]
                self.reduce_microstep(u, bufs, streams[u], acc[u])
        for u in units:
            out = self.finish_reduction(u, streams[u], acc[u])
            for rk in self.ranks:
                self.held_grad(rk, u)[:] = out[rk.rank]
        held = [[self.held_grad(rk, u) for rk in self.ranks] for u in units]
        local_bad = [b or any(not_finite(h[r]) for h in held) for r, b in enumerate(local_bad)]
        overflow, used = all_reduce_max(local_bad, self.log, (mine, len(self.spec.names)))
        if overflow:
            return self._skip(scale)

        c = f32(1.0 / (scale * m))
        g = [[x.astype(np.float32) * c for x in per_rank] for per_rank in held]
        # the chunk partials, N-padding chunks dropped ([Note: norm invariance], layout.py)
        norm = global_norm(
            [
                self.norm_partials(u, g[u])[: lay.num_chunks]
                for u, lay in enumerate(self.spec.layouts)
            ]
        )
        coef = clip_coefficient(norm, cfg.clip_norm)
        if coef is not None:
            g = [[x * coef for x in per_rank] for per_rank in g]
        t = state.t + 1
        steps = {x: state.step_of(x) + (x in used) for x in self.spec.names}
        for u in units:
            for rk in self.ranks:
                self._optimizer_step(rk, u, g[u][rk.rank], steps, used)
            self.refresh_working(u)
        scaler = None if state.scaler is None else scaler_update(state.scaler, False, cfg.scaler)
        self.state = TrainState(
            master={}, opt={}, t=t, data_step=state.data_step + 1, scaler=scaler, steps=steps
        )
        return StepInfo(
            overflow=False, skipped=False, scale=scale, norm=norm, clip_coef=coef, reduced={}
        )

    def _tag(self, u: int, phase: str) -> dict:
        return {"phase": phase, "unit": u, "kind": "model"}

    def _reduce_scatter(self, u: int, bufs, phase: str) -> list[np.ndarray]:
        return reduce_scatter(bufs, self.shard[u], self.padding[u], self.log, **self._tag(u, phase))

    def _tree_results(self, u: int, streams) -> list[np.ndarray]:
        """Each rank's streamed tree, finished; its peak partial sums are counted as gradients."""
        for rk, s in zip(self.ranks, streams, strict=True):
            rk.peak_partials[u] = s.peak_partials
        return [s.result() for s in streams]

    def _state_names(self, name):
        return optim.state_names(self.cfg.optimizer, self.cfg.groups[self.spec.group_of[name]])

    def _optimizer_step(self, rk: Rank, u: int, g: np.ndarray, steps, used) -> None:
        """Update the segments of used parameters inside rk's extent, each with its group's
        hyper-parameters and its own step count ([Note: op-ordered optimizers]: elementwise,
        so slices are exact; [Note: unused parameters]: the others are skipped)."""
        lay, cfg = self.spec.layouts[u], self.cfg
        start = self.extent(rk, u).start
        stop = start + rk.master[u].size
        for s in lay.slots:
            a, b = max(s.offset, start), min(s.offset + s.numel, stop)
            if a >= b or s.name not in used:
                continue
            hp = cfg.groups[self.spec.group_of[s.name]]
            loc = slice(a - start, b - start)
            st = {x: rk.opt[u][x][loc] for x in optim.state_names(cfg.optimizer, hp)}
            p, new = optim.step(cfg.optimizer, rk.master[u][loc], g[loc], st, hp, steps[s.name])
            rk.master[u][loc] = p
            for x, arr in new.items():
                rk.opt[u][x][loc] = arr

    def _skip(self, scale: float) -> StepInfo:
        """Overflow on some rank: every rank skips; only the scaler and data step move."""
        state, cfg = self.state, self.cfg
        if state.scaler is None and cfg.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradient at data step {state.data_step} with precision="
                f"{cfg.precision!r}; set nonfinite='skip' to skip such steps"
            )
        scaler = None if state.scaler is None else scaler_update(state.scaler, True, cfg.scaler)
        self.state = TrainState(
            master={},
            opt={},
            t=state.t,
            data_step=state.data_step + 1,
            scaler=scaler,
            steps=state.steps,
        )
        return StepInfo(
            overflow=True, skipped=True, scale=scale, norm=None, clip_coef=None, reduced={}
        )

    # -- views for checking ----------------------------------------------------------------

    def _full_unit(self, u: int, extent) -> np.ndarray:
        """Unit u's padded buffer assembled from each rank's extent(rank) (shards, or the
        whole buffer when every rank holds it)."""
        parts = [extent(rk) for rk in self.ranks]
        whole = self.n * self.shard[u]
        return parts[0] if parts[0].size == whole else np.concatenate(parts)

    def full_master(self) -> dict[str, np.ndarray]:
        """The fp32 master weights by name, gathered from the ranks."""
        out = {}
        for u, lay in enumerate(self.spec.layouts):
            out.update(lay.unflatten(self._full_unit(u, lambda rk, u=u: rk.master[u])))
        return {k: v.copy() for k, v in out.items()}

    def full_opt(self) -> dict[str, dict[str, np.ndarray]]:
        """The optimizer state arrays by parameter name, gathered from the ranks."""
        out: dict[str, dict[str, np.ndarray]] = {name: {} for name in self.spec.names}
        for u, lay in enumerate(self.spec.layouts):
            for x in self.ranks[0].opt[u]:
                full = lay.unflatten(self._full_unit(u, lambda rk, u=u, x=x: rk.opt[u][x]))
                for s in lay.slots:
                    if x in self._state_names(s.name):
                        out[s.name][x] = full[s.name].copy()
        return out

    def resident_bytes(self, rank: int) -> dict[str, int]:
        """Rank's owned bytes by category (params, grads, master, optimizer)."""
        return self.ranks[rank].resident_bytes([L * self.red.itemsize for L in self.shard])

    def traffic(self, rank: int, kind: str = "model") -> tuple[int, int]:
        """(elements, of which padding) that rank sent this step, for model or control traffic."""
        sent = [s for s in self.log[rank] if s.kind == kind]
        return sum(s.elements for s in sent), sum(s.padding for s in sent)


class Stage1(Stage0):
    """P_os: each rank keeps the master and optimizer states of its own shard only."""

    stage = 1

    def extent(self, rk: Rank, u: int) -> slice:
        return self.own(rk, u)

    def finish_reduction(self, u: int, streams, acc) -> list[np.ndarray]:
        """The reduce-scatter already left shard r of R on rank r: no gradient all-gather."""
        if self.mode == "fast":
            return self._reduce_scatter(u, acc, "grad")
        return self._tree_results(u, streams)

    def norm_partials(self, u: int, g_u) -> np.ndarray:
        """Each rank has its shard's chunk partials: all-gather them (control traffic)."""
        mine = [chunk_sumsq(x, self.spec.layouts[u].chunk) for x in g_u]
        all_gather(mine, [0] * self.n, self.log, phase="norm", unit=u, kind="control")
        return np.concatenate(mine)

    def refresh_working(self, u: int) -> None:
        """Cast the updated shard, then all-gather the working copy."""
        mine = [cast(rk.master[u], self.cfg.precision) for rk in self.ranks]
        full = all_gather(mine, self.padding[u], self.log, **self._tag(u, "param_update"))
        for rk in self.ranks:
            rk.working[u][:] = full[rk.rank]


class Stage2(Stage1):
    """P_os+g: + the reduced gradient kept as a shard; so it is reduced every micro-step."""

    stage = 2

    def grad_numel(self, u: int) -> int:
        return self.shard[u]

    def held_grad(self, rk: Rank, u: int) -> np.ndarray:
        return rk.grad[u]  # the buffer is the shard

    def reduce_microstep(self, u: int, bufs, streams, acc) -> None:
        """Reduce-scatter every micro-step in both modes (fast: the parts add up locally)."""
        parts = self._reduce_scatter(u, bufs, "grad")
        if self.mode == "fast":
            _accumulate(acc, parts)
            return
        for s, part in zip(streams, parts, strict=True):
            s.push(part)

    def finish_reduction(self, u: int, streams, acc) -> list[np.ndarray]:
        return acc if self.mode == "fast" else self._tree_results(u, streams)


class Stage3(Stage2):
    """P_os+g+p: + the working parameters kept as a shard, gathered per unit for fwd and bwd."""

    stage = 3

    def __init__(self, *args, **kwargs):
        self.gathered: dict[int, np.ndarray] = {}  # last full unit gathered for forward
        super().__init__(*args, **kwargs)

    def allocate(self, rk: Rank, u: int, master_full: np.ndarray) -> None:
        own, fp32 = self.own(rk, u), self.cfg.precision == "fp32"
        rk.working.append(cast(master_full, self.cfg.precision)[own].copy())
        rk.master.append(rk.working[u] if fp32 else master_full[own].copy())

    def pre_forward(self, u: int) -> None:
        self.gathered[u] = self._gather_params(u, "param_fwd")

    def pre_backward(self, u: int) -> None:
        self._gather_params(u, "param_bwd")

    def hold_frozen(self, rk: Rank, f: int, full: np.ndarray) -> np.ndarray:
        L = self.frozen_shard[f]
        return full[rk.rank * L : (rk.rank + 1) * L].copy()

    def gather_frozen(self, f: int, phase: str) -> None:
        shards = [rk.frozen[f] for rk in self.ranks]
        tag = self._tag(len(self.spec.layouts) + f, phase)
        all_gather(shards, self.frozen_padding[f], self.log, **tag)

    def refresh_working(self, u: int) -> None:
        Stage0.refresh_working(self, u)  # the shard is cast locally; gathered when next used

    def _gather_params(self, u: int, phase: str) -> np.ndarray:
        """All-gather unit u's working shards; returns the full unit (rank 0's copy)."""
        shards = [rk.working[u] for rk in self.ranks]
        return all_gather(shards, self.padding[u], self.log, **self._tag(u, phase))[0]


STAGES = (Stage0, Stage1, Stage2, Stage3)


def World(master, spec: ModelSpec, cfg: StepConfig, *, stage: int, mode: str, frozen=()) -> Stage0:  # noqa: N802
    """N simulated ranks running ZeRO `stage` in `mode`: STAGES[stage](...)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: allowed are 0, 1, 2, 3")
    return STAGES[stage](master, spec, cfg, mode=mode, frozen=frozen)


def _accumulate(acc: list, parts) -> None:
    """Fast mode's running sums, one per rank, in arrival order."""
    for r, p in enumerate(parts):
        acc[r] = p if acc[r] is None else acc[r] + p


def not_finite(x: np.ndarray) -> bool:
    return not np.isfinite(x.astype(np.float32)).all()
