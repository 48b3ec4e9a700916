"""ZeRO stages 0-3 on N simulated ranks, in NumPy: explicit buffers, counted collectives.

For teaching and property tests. Every rank is an object with its own flat buffers; collectives
are functions over all ranks' buffers that also log what each rank sends. The result must be the
same bits as reference/step.py's train_step (deterministic mode), which is what makes the claim
"partitioning changes nothing numerically" checkable.

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
also says how many of them are padding. Control traffic (overflow flag, norm partials) is logged
as kind="control" and kept apart.

Fast mode sums in another order (local accumulation first, then across ranks), so it is *not*
the reference's bits; it is within the summation's forward-error bound instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import optim
from .precision import DTYPES, cast, f32, scaler_update
from .step import ModelSpec, StepConfig, StepInfo, TrainState, clip_coefficient, init_state
from .tree import StreamingTree, chunk_sumsq, global_norm, tree_sum

MODES = ("deterministic", "fast")


@dataclass(frozen=True, kw_only=True)
class Sent:
    """What one rank sent in one collective."""

    op: str  # reduce_scatter | all_gather | all_reduce | all_reduce_max
    phase: str  # grad | grad_gather | param_update | param_fwd | param_bwd | overflow | norm
    unit: int | None
    elements: int  # elements this rank sent, padding included
    padding: int  # how many of them are padding
    kind: str  # "model" (model states) or "control"


# --- simulated collectives: lists indexed by rank in, lists indexed by rank out -------------


def reduce_scatter(bufs, shard: int, padding, log, **tag):
    """Rank r gets T over ranks (rank order) of everyone's slice r; each sends (N-1)·L.

    Realised as an all-to-all followed by a local tree sum, which fixes the order (docs/design.md
    §2).
    """
    n = len(bufs)
    out = [tree_sum([b[r * shard : (r + 1) * shard] for b in bufs]) for r in range(n)]
    for r in range(n):
        pad = sum(padding[s] for s in range(n) if s != r)
        log[r].append(Sent(op="reduce_scatter", elements=(n - 1) * shard, padding=pad, **tag))
    return out


def all_gather(shards, padding, log, **tag):
    """Every rank gets the concatenation of all shards; each sends its shard to N-1 ranks."""
    n = len(shards)
    for r in range(n):
        el, pad = (n - 1) * shards[r].size, (n - 1) * padding[r]
        log[r].append(Sent(op="all_gather", elements=el, padding=pad, **tag))
    full = np.concatenate(shards)
    return [full.copy() for _ in range(n)]


def all_reduce(bufs, shard: int, padding, log, **tag):
    """Counted as reduce-scatter + all-gather (2(N-1)·L per rank), the bandwidth-optimal ring."""
    n = len(bufs)
    inner: list[list[Sent]] = [[] for _ in range(n)]
    full = all_gather(reduce_scatter(bufs, shard, padding, inner, **tag), padding, inner, **tag)
    for r in range(n):
        el, pad = sum(s.elements for s in inner[r]), sum(s.padding for s in inner[r])
        log[r].append(Sent(op="all_reduce", elements=el, padding=pad, **tag))
    return full


def all_reduce_max(flags, log):
    """Control: every rank learns whether any rank saw an overflow; a one-element all-reduce,
    counted as N-1 elements per rank."""
    tag = {"phase": "overflow", "unit": None, "kind": "control", "padding": 0}
    for r in range(len(flags)):
        log[r].append(Sent(op="all_reduce_max", elements=len(flags) - 1, **tag))
    return any(flags)


# --- the simulated world --------------------------------------------------------------------


class Rank:
    """One rank's buffers, unit by unit (lists indexed by unit)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.working: list[np.ndarray] = []  # compute dtype: padded unit (stages 0-2) or shard (3)
        self.master: list[np.ndarray] = []  # fp32: padded unit (stage 0) or shard (1-3)
        self.opt: list[dict[str, np.ndarray]] = []  # fp32, same extent as master
        self.grad: list[np.ndarray] = []  # reduction dtype: padded unit (0-1) or shard (2-3)
        self.peak_partials: list[int] = []  # extra streaming-tree buffers, per unit (shards)

    def resident_bytes(self, shard_nbytes: Sequence[int]) -> dict[str, int]:
        """Bytes this rank owns, by category, each buffer counted once: a view (the fp32
        master inside an fp32 working copy) or the same array in two roles owns nothing new.
        The streaming tree's extra partial sums (shards) count as gradients."""
        seen: set[int] = set()

        def owned(arrays) -> int:
            total = 0
            for a in arrays:
                if a.base is None and id(a) not in seen:
                    seen.add(id(a))
                    total += a.nbytes
            return total

        extra = sum(p * b for p, b in zip(self.peak_partials, shard_nbytes, strict=True))
        return {
            "params": owned(self.working),
            "grads": owned(self.grad) + extra,
            "master": owned(self.master),
            "optimizer": sum(owned(st.values()) for st in self.opt),
        }


class World:
    """N simulated ranks running ZeRO `stage` in `mode`, starting from the same state as the
    reference's init_state(master, spec, cfg)."""

    def __init__(self, master, spec: ModelSpec, cfg: StepConfig, *, stage: int, mode: str):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={stage}: allowed are 0, 1, 2, 3")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: allowed are {MODES}")
        self.spec, self.cfg, self.stage, self.mode = spec, cfg, stage, mode
        self.n = n = cfg.world_size
        self.state = init_state(master, spec, cfg)  # scalars only are read from it below
        self.log: list[list[Sent]] = [[] for _ in range(n)]  # this step's traffic, per rank
        self.ranks = [Rank(r) for r in range(n)]
        self.shard = [lay.shard_numel(n) for lay in spec.layouts]
        # padding[u][r]: padding elements inside rank r's shard of unit u
        self.padding = [
            [int((~m[r * L : (r + 1) * L]).sum()) for r in range(n)]
            for m, L in zip((lay.real_mask(n) for lay in spec.layouts), self.shard, strict=True)
        ]
        self.red = red = DTYPES[cfg.reduction]
        self.gathered: dict[int, np.ndarray] = {}  # stage 3: last full unit gathered for forward
        work = cfg.precision
        for u, lay in enumerate(spec.layouts):
            master_full = lay.flatten(self.state.master, n, np.float32)
            for rk in self.ranks:
                own = slice(rk.rank * self.shard[u], (rk.rank + 1) * self.shard[u])
                full_work = cast(master_full, work)
                if stage == 3:
                    rk.working.append(full_work[own].copy())
                else:
                    rk.working.append(full_work)
                if work == "fp32":  # pure fp32: the working copy *is* the master
                    rk.master.append(rk.working[u] if stage in (0, 3) else rk.working[u][own])
                else:
                    rk.master.append(master_full.copy() if stage == 0 else master_full[own].copy())
                names = {x for s in lay.slots for x in self._state_names(s.name)}
                rk.opt.append({x: np.zeros(rk.master[u].size, np.float32) for x in sorted(names)})
                rk.grad.append(np.zeros(n * self.shard[u] if stage < 2 else self.shard[u], red))
                rk.peak_partials.append(0)

    def _state_names(self, name):
        return optim.state_names(self.cfg.optimizer, self.cfg.groups[self.spec.group_of[name]])

    # -- one step --------------------------------------------------------------------------

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
        for k in range(m // n):
            if self.stage == 3:  # forward: gather every unit just before it runs
                for u in units:
                    self.gathered[u] = self._gather_params(u, "param_fwd")
            for u in reversed(units):  # backward runs the units in reverse
                if self.stage == 3:
                    self._gather_params(u, "param_bwd")
                bufs = [
                    self.spec.layouts[u].flatten(grads[k * n + r], n, self.red) for r in range(n)
                ]
                local_bad = [b or not_finite(x) for b, x in zip(local_bad, bufs, strict=True)]
                self._reduce_microstep(u, bufs, streams[u], acc[u])
        for u in units:
            self._finish_reduction(u, streams[u], acc[u])
        held = [[self._held_grad(rk, u) for rk in self.ranks] for u in units]
        local_bad = [b or any(not_finite(h[r]) for h in held) for r, b in enumerate(local_bad)]
        if all_reduce_max(local_bad, self.log):
            return self._skip(scale)

        c = f32(1.0 / (scale * m))
        g = [[x.astype(np.float32) * c for x in per_rank] for per_rank in held]
        norm = self._norm(g)
        coef = clip_coefficient(norm, cfg.clip_norm)
        if coef is not None:
            g = [[x * coef for x in per_rank] for per_rank in g]
        t = state.t + 1
        for u in units:
            for rk in self.ranks:
                self._optimizer_step(rk, u, g[u][rk.rank], t)
            self._refresh_working(u)
        scaler = None if state.scaler is None else scaler_update(state.scaler, False, cfg.scaler)
        self.state = TrainState(
            master={}, opt={}, t=t, data_step=state.data_step + 1, scaler=scaler
        )
        return StepInfo(
            overflow=False, skipped=False, scale=scale, norm=norm, clip_coef=coef, reduced={}
        )

    def _gather_params(self, u: int, phase: str) -> np.ndarray:
        """Stage 3: all-gather unit u's working shards; returns the full unit (rank 0's copy)."""
        shards = [rk.working[u] for rk in self.ranks]
        return all_gather(shards, self.padding[u], self.log, phase=phase, unit=u, kind="model")[0]

    def _reduce_microstep(self, u: int, bufs, streams, acc) -> None:
        """One micro-step's gradients of unit u: reduce now, or (fast, stages 0-1) accumulate."""
        if self.mode == "fast" and self.stage < 2:  # local accumulation, as DDP's no_sync
            for r, b in enumerate(bufs):
                acc[r] = b if acc[r] is None else acc[r] + b
            return
        tag = {"phase": "grad", "unit": u, "kind": "model"}
        parts = reduce_scatter(bufs, self.shard[u], self.padding[u], self.log, **tag)
        for r, part in enumerate(parts):
            if self.mode == "fast":
                acc[r] = part if acc[r] is None else acc[r] + part
            else:
                streams[r].push(part)

    def _finish_reduction(self, u: int, streams, acc) -> None:
        """Complete R for unit u and store each rank's part in its gradient buffer."""
        L, pad, tag = self.shard[u], self.padding[u], {"unit": u, "kind": "model"}
        if self.mode == "fast" and self.stage == 0:
            out = all_reduce(acc, L, pad, self.log, phase="grad", **tag)
        elif self.mode == "fast" and self.stage == 1:
            out = reduce_scatter(acc, L, pad, self.log, phase="grad", **tag)
        elif self.mode == "fast":
            out = acc
        else:
            out = [s.result() for s in streams]
            for rk, s in zip(self.ranks, streams, strict=True):
                rk.peak_partials[u] = s.peak_partials
            if self.stage == 0:  # every rank needs the whole reduced gradient
                out = all_gather(out, pad, self.log, phase="grad_gather", **tag)
        for rk in self.ranks:
            if out[rk.rank].size == rk.grad[u].size:
                rk.grad[u][:] = out[rk.rank]
            else:  # stage 1: the reduced shard lands in the rank's own slice of the full buffer
                rk.grad[u][rk.rank * L : (rk.rank + 1) * L] = out[rk.rank]

    def _held_grad(self, rk: Rank, u: int) -> np.ndarray:
        """The part of R this rank optimises: all of it at stage 0, its own shard otherwise."""
        if self.stage == 1:
            L = self.shard[u]
            return rk.grad[u][rk.rank * L : (rk.rank + 1) * L]
        return rk.grad[u]

    def _norm(self, g) -> np.float64:
        """Chunk partials of each rank's part, all-gathered (control), N-padding chunks dropped
        ([Note: norm invariance] in reference/layout.py)."""
        partials = []
        for u, lay in enumerate(self.spec.layouts):
            if self.stage == 0:  # every rank holds the whole gradient: no traffic
                per_unit = chunk_sumsq(g[u][0], lay.chunk)
            else:
                mine = [chunk_sumsq(x, lay.chunk) for x in g[u]]
                all_gather(mine, [0] * self.n, self.log, phase="norm", unit=u, kind="control")
                per_unit = np.concatenate(mine)
            partials.append(per_unit[: lay.num_chunks])
        return global_norm(partials)

    def _optimizer_step(self, rk: Rank, u: int, g: np.ndarray, t: int) -> None:
        """Update the parameter segments inside this rank's extent, each with its group's
        hyper-parameters ([Note: op-ordered optimizers]: elementwise, so slices are exact)."""
        lay, cfg = self.spec.layouts[u], self.cfg
        start = 0 if self.stage == 0 else rk.rank * self.shard[u]
        stop = start + rk.master[u].size
        for s in lay.slots:
            a, b = max(s.offset, start), min(s.offset + s.numel, stop)
            if a >= b:
                continue
            hp = cfg.groups[self.spec.group_of[s.name]]
            loc = slice(a - start, b - start)
            st = {x: rk.opt[u][x][loc] for x in optim.state_names(cfg.optimizer, hp)}
            p, new = optim.step(cfg.optimizer, rk.master[u][loc], g[loc], st, hp, t)
            rk.master[u][loc] = p
            for x, arr in new.items():
                rk.opt[u][x][loc] = arr

    def _refresh_working(self, u: int) -> None:
        """The new working copy: cast locally (stages 0, 3), or cast the shard and all-gather
        it (stages 1, 2). In pure fp32 the master is a view of the working copy already."""
        prec = self.cfg.precision
        if self.stage in (1, 2):
            mine = [cast(rk.master[u], prec) for rk in self.ranks]
            tag = {"phase": "param_update", "unit": u, "kind": "model"}
            full = all_gather(mine, self.padding[u], self.log, **tag)
            for rk in self.ranks:
                rk.working[u][:] = full[rk.rank]
        elif prec != "fp32":
            for rk in self.ranks:
                rk.working[u][:] = cast(rk.master[u], prec)

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
            master={}, opt={}, t=state.t, data_step=state.data_step + 1, scaler=scaler
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


def not_finite(x: np.ndarray) -> bool:
    return not np.isfinite(x.astype(np.float32)).all()
