"""ZeroEngine: ZeRO stages 0-2 around an unchanged nn.Module, one data-parallel group.

    engine = ZeroEngine(model, ZeroConfig(stage=2, micro_batches=8, ...), group=dp_group)
    for batch in my_micro_batches:            # M/N of them per step on each rank
        _, loss = engine(*batch)               # forward, on the compute-dtype working copy
        engine.backward(loss)                  # backward; reductions launch as units finish
    result = engine.step()                     # global loss, global grad norm, skipped?

Legend: N ranks in `group`, M micro-batches per step over all ranks, S loss scale, t optimizer
steps taken, R the reduced gradient. A step is exactly reference/step.py's, computed on shards:
  1. every micro-step, each unit's gradients are reduced as the stage says (zero/stage*.py);
  2. overflow: any non-finite in R on any rank ([Note: overflow detection]);
  3. g = fp32(R) · s(1/(S·M)); the global norm from chunk partials; clipping;
  4. the optimizer on this rank's extent (zero/optim.py), then the new working copy.

[Note: overflow detection] The reference checks every micro-batch gradient and R. Once a
non-finite value enters an IEEE sum, the sum stays non-finite (inf + x is inf or NaN; NaN
propagates), and casting to a wider dtype cannot overflow, so "some g_j is non-finite" implies "R
is non-finite". Each rank checks the part of R it alone accounts for, through its norm partials,
and the step's one control exchange tells every rank ([Note: one control exchange]).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from reference.optim import state_names
from reference.precision import f32, scaler_init, scaler_update
from reference.step import clip_coefficient
from reference.tree import global_norm

from . import collectives as C
from .activations import check_not_nested, checkpoint_units
from .config import ZeroConfig
from .contiguous import Arena, CheckpointArena, span
from .offload import HostOffload
from .optim import step_runs
from .partition import UnitPartition
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3
from .unit import FlatUnit

STAGE_CLASSES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}


@dataclass(frozen=True, kw_only=True)
class StepResult:
    loss: float  # mean loss over all M micro-batches of the step, on every rank
    norm: float | None  # global gradient norm before clipping (None when skipped)
    skipped: bool  # overflow: nothing but the loss scale changed
    scale: float  # the loss scale S this step used


def backward_scaled(loss: torch.Tensor, scale: float | None) -> None:
    """Backward of S·loss (fp16) or of loss. Verification computes single-process micro-batch
    gradients through this same function, so that they are the engine's bits."""
    (loss if scale is None else loss.float() * scale).backward()


def cast_inputs(args, dtype: torch.dtype) -> list:
    """Floating tensors among the positional inputs, in the compute dtype (as FSDP's default
    mixed precision does); verification applies the same cast to its single-process run."""
    return [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]


def chunk_sumsq(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """reference.tree.chunk_sumsq in torch: float64 squares, pairwise halving per chunk. In
    place on one float64 copy: the same elementwise additions as the reference, no temporaries."""
    s = x.to(torch.float64, copy=True).view(-1, chunk)
    s.mul_(s)
    while s.shape[1] > 1:
        h = s.shape[1] // 2
        s[:, :h].add_(s[:, h:])
        s = s[:, :h]
    return s[:, 0].clone()


class ZeroEngine(nn.Module):
    def __init__(
        self, module: nn.Module, config: ZeroConfig, *, group=None, device=None, init_seed=0
    ):
        """module may live on the meta device: each unit is then materialised on `device`
        alone, with zero.models' counter-based values for `init_seed` (None: zeros, for a
        simulated rank whose values do not matter), so the whole model never exists at once."""
        super().__init__()
        self.module, self.config = module, config
        self.group = group if group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        n = self.world_size
        if config.bucket_elements is not None and config.bucket_elements < n:
            raise ValueError(
                f"bucket_elements={config.bucket_elements}: must be at least the world size {n} "
                "(every rank gets at least one element of each piece)"
            )
        if config.micro_batches % n:
            raise ValueError(
                f"micro_batches={config.micro_batches}: must be a multiple of the world size {n}"
            )
        if config.activation_checkpointing:
            check_not_nested(config.units)
        self.counter = C.CommCounter(step=-1)  # construction's checks are "step -1"
        self.step_config = config.step_config(n)
        # control tensors live here too: NCCL takes only CUDA tensors
        first = next(module.parameters()).device
        meta = first.type == "meta"
        self.device = device = torch.device(device) if device is not None else first
        if meta and device.type == "meta":
            raise ValueError("device='meta': a meta-device model needs a real device to build on")
        values = self._start_values(init_seed) if meta else None
        named = self._collect_units()
        self.group_index = self._group_index(named)
        self.fake = dist.get_backend(self.group) == "fake"  # a simulated rank: no real peers
        if not self.fake:
            self._check_ranks_agree(named)
        self.units: list[FlatUnit] = []
        self.pad_rs, self.pad_ag, self.extra_partials = [], [], []
        self.impl = STAGE_CLASSES[config.stage](self)
        self.offload = HostOffload(self) if config.offload_optimizer else None
        parts = [
            UnitPartition.build(
                [(p_name, p.shape) for p_name, p in params],
                world_size=n,
                rank=self.rank,
                groups=[self.group_index[p_name] for p_name, _ in params],
                chunk=config.chunk,
            )
            for _, params in named
        ]
        self.grad_arena, self.host_grad_arena = self._grad_arenas(parts)
        for i, ((uname, params), part) in enumerate(zip(named, parts, strict=True)):
            u = FlatUnit(i, uname, params, part, config.compute_dtype, device, values)
            if u.replaced:
                self._rebind(u.replaced)
            real = [part.real_elements(r) for r in range(n)]
            L = part.shard_numel
            self.pad_rs.append(sum(L - real[r] for r in range(n) if r != self.rank))
            self.pad_ag.append((n - 1) * (L - real[self.rank]))
            self.extra_partials.append(0)
            self.units.append(u)
            # allocate now, unit by unit: at stage 3 a rank never holds more than one full unit
            self.impl.allocate(u)
            if self.offload is not None:  # ZeRO-Offload (zero/offload.py)
                self.offload.place(u, self.impl.grad_on_host(u.part))
            u.initial = None  # the fp32 start values are now in the master
        for arena in (self.grad_arena, self.host_grad_arena):  # each handed out exactly
            assert arena is None or arena.cursor == arena.nbytes, (arena.cursor, arena.nbytes)
        self.runs = [self.impl.runs(u) for u in self.units]
        self.counter.step = 0
        self.scaler = scaler_init(config.scaler) if config.precision == "fp16" else None
        self.t, self.data_step, self.microstep = 0, 0, 0
        self.transient_peak = 0
        self._losses: list[float] = []
        for u in self.units:
            for _, p in u.params:
                p.register_post_accumulate_grad_hook(self._hook(u))
        mods = dict(self.module.named_modules())
        self.impl.register_hooks({u.name: mods[u.name] for u in self.units} | {"": self.module})
        self.activation_arena: CheckpointArena | None = None
        if config.activation_checkpointing:  # ZeRO-R (zero/activations.py)
            if config.contiguous_memory:  # M_D: checkpoints in one buffer (zero/contiguous.py)
                host = config.offload_activations
                self.activation_arena = CheckpointArena(
                    units=sum(1 for u in self.units if u.name),
                    device="cpu" if host else device,
                    pin=host and device.type == "cuda",
                )
            checkpoint_units(self, mods)

    # -- construction helpers ----------------------------------------------------------------

    def _grad_arenas(self, parts: list[UnitPartition]) -> tuple[Arena | None, Arena | None]:
        """contiguous_memory: (device, host) gradient arenas, each sized to exactly the sum of
        the buffers it will hand out, in unit order ([Note: contiguous memory]). Device: every
        u.grad that stays on the device. Host (offload_optimizer): every unit's host gradient
        buffer, the reduced gradient of its extent (at stages 2-3 that is u.grad itself, so
        the device arena then holds only stage-3 persistent units, or is not created at all).
        One dtype (the reduction dtype) for all gradients: one arena per placement."""
        if not self.config.contiguous_memory:
            return None, None
        dtype, impl, off = self.config.grad_dtype, self.impl, self.offload
        on_device = [
            span(impl.grad_numel(p), dtype)
            for p in parts
            if off is None or not impl.grad_on_host(p)
        ]
        device = Arena.zeros(sum(on_device), device=self.device) if sum(on_device) else None
        host = None
        if off is not None:
            ext = [impl.extent(p) for p in parts]
            host = Arena(off.empty(sum(span(e.stop - e.start, dtype) for e in ext), torch.uint8))
        return device, host

    def _collect_units(self) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
        """[(unit name, [(param name, param)])], root first; shared parameters go to the root."""
        mods = dict(self.module.named_modules())
        owner: dict[int, str] = {}
        for uname in self.config.units:
            if uname not in mods:
                raise ValueError(f"units: {uname!r} is not a submodule of the model")
            for p in mods[uname].parameters():
                owner[id(p)] = "" if owner.get(id(p), uname) != uname else uname
        named = {uname: [] for uname in ("", *self.config.units)}
        for p_name, p in self.module.named_parameters():  # each Parameter once, tied ones too
            named[owner.get(id(p), "")].append((p_name, p))
        return [(k, v) for k, v in named.items() if v]

    def _start_values(self, seed):
        """Start values of a meta model's parameters, by name (zero.models' counter-based rule)."""
        from .init import init_value, param_init

        def value(name: str, shape) -> torch.Tensor:
            if seed is None:
                return torch.zeros(shape)
            rule = param_init(self.module, name)
            return init_value(seed, name, shape, rule.kind, std=rule.std)

        return value

    def _rebind(self, replaced: dict[int, nn.Parameter]) -> None:
        """Put materialised parameters in place of their meta originals in every module that
        holds them (so a tied weight stays one Parameter)."""
        for mod in self.module.modules():
            for key, p in list(mod._parameters.items()):
                if p is not None and id(p) in replaced:
                    mod._parameters[key] = replaced[id(p)]

    def _group_index(self, named) -> dict[str, int]:
        fn, k = self.config.group_of, len(self.config.groups)
        out = {pn: (fn(pn, p) if fn else 0) for _, ps in named for pn, p in ps}
        for pn, g in out.items():
            if not 0 <= g < k:
                raise ValueError(f"group_of({pn!r})={g}: allowed are 0..{k - 1}")
        return out

    def _check_ranks_agree(self, named) -> None:
        """Different models, unit orders, configs or initial values on different ranks would
        hang or silently diverge: compare digests and name the first rank and unit that differ."""
        cfg = {
            f.name: repr(getattr(self.config, f.name))
            for f in fields(self.config)
            if f.name != "group_of"
        }
        rows = [("config", json.dumps(cfg, sort_keys=True))]
        for uname, ps in named:
            shape = [(pn, tuple(p.shape), str(p.dtype), self.group_index[pn]) for pn, p in ps]
            rows.append((f"unit {uname or '<root>'} structure", repr(shape)))
            if not any(p.is_meta for _, p in ps):  # meta values come from (seed, name) alone
                vals = b"".join(p.detach().float().cpu().numpy().tobytes() for _, p in ps)
                rows.append((f"unit {uname or '<root>'} initial values", vals))
        digests = [
            int.from_bytes(
                hashlib.blake2b(v if isinstance(v, bytes) else v.encode(), digest_size=7).digest(),
                "little",
            )
            for _, v in rows
        ]
        mine = torch.tensor([len(named), *digests], dtype=torch.int64, device=self.device)
        counts = C.gather_control(mine[:1], group=self.group, counter=self.counter, phase="agree")
        for r, c in enumerate(counts[:, 0].tolist()):
            if c != counts[0, 0]:
                raise ValueError(
                    f"rank {r} has {c} units, rank 0 has {int(counts[0, 0])}: the ranks built "
                    "different models or unit lists"
                )
        every = C.gather_control(mine, group=self.group, counter=self.counter, phase="agree")
        for r in range(self.world_size):
            for i, (what, _) in enumerate(rows):
                if every[r, 1 + i] != every[0, 1 + i]:
                    raise ValueError(f"rank {r} disagrees with rank 0 on {what}")

    # -- the lifecycle hooks (no math here) ---------------------------------------------------

    def _hook(self, u: FlatUnit):
        def post_accumulate(_param) -> None:
            u.ready += 1
            if u.ready == len(u.params):  # overlap only decides whether it runs asynchronously
                u.fired = True
                self.impl.post_backward(u)

        return post_accumulate

    def forward(self, *args, **kwargs):
        """The wrapped module's forward; floating inputs are cast to the compute dtype."""
        if self.activation_arena is not None and torch.is_grad_enabled():
            self.activation_arena.begin()  # [Note: checkpoint generations]
        return self.module(*cast_inputs(args, self.config.compute_dtype), **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (mean over its samples), then finalize_backward."""
        self._losses.append(float(loss.detach().float()))
        backward_scaled(loss, None if self.scaler is None else self.scaler.scale)
        self.finalize_backward()

    def inject_gradients(self, grads: dict[str, torch.Tensor], loss: float = 0.0) -> None:
        """One micro-batch's backward without autograd, for verification: `grads` maps every
        parameter name to what backward would have left in its .grad (the compute dtype, of the
        loss times the scaler's scale). Each unit then takes the path an autograd hook starts,
        last unit first, so partitioning, reduction and the optimizer see inputs that no model
        would produce (extremes, inf/NaN). At stage 3 no parameter is gathered: nothing reads
        them."""
        missing = [n for n in self.group_index if n not in grads]
        if missing:
            raise ValueError(f"grads: no gradient for parameter {missing[0]!r}")
        self._losses.append(float(loss))
        for u in reversed(self.units):
            for name, p in u.params:
                g = grads[name]
                if tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype:
                    raise ValueError(
                        f"grads[{name!r}]: shape {tuple(g.shape)} dtype {g.dtype}; the parameter "
                        f"needs shape {tuple(p.shape)} dtype {p.dtype}"
                    )
                p.grad = g.to(p.device)
            u.fired = True
            self.impl.post_backward(u)
        self.finalize_backward()

    def finalize_backward(self) -> None:
        for u in reversed(self.units):  # units with parameters that got no gradient
            if not u.fired:
                self.impl.post_backward(u)
        self.impl.drain()
        for u in self.units:
            self.impl.end_microstep(u)
            u.ready, u.fired = 0, False
        self.microstep += 1

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> StepResult:
        k = self.config.micro_batches // self.world_size
        if self.microstep != k:
            raise RuntimeError(
                f"step() after {self.microstep} micro-steps on rank {self.rank}; "
                f"micro_batches={self.config.micro_batches} at N="
                f"{self.world_size} needs {k}"
            )
        held = [self.impl.finish_reduction(u) for u in self.units]
        if self.offload is not None:  # R's extent to the host, where the optimizer runs
            held = [
                h if self.offload.is_host(h) else self.offload.down(u, u.host_grad, h)
                for u, h in zip(self.units, held, strict=True)
            ]
            self.offload.synchronize()
        scale = 1.0 if self.scaler is None else self.scaler.scale
        inv = f32(1.0 / (scale * self.config.micro_batches))
        c = {h.device: torch.tensor(inv, device=h.device) for h in held}
        g = [h.float() * c[h.device] for h in held]
        overflow, bad, loss, partials = self._exchange(held, g, inv)
        norm = None
        if overflow:
            if self.scaler is None and self.config.nonfinite == "raise":
                raise FloatingPointError(
                    f"non-finite gradient at data step {self.data_step} "
                    f"(rank {self.rank} saw it: {bad}) with precision="
                    f"{self.config.precision!r}; nonfinite='skip' skips"
                )
        else:
            self.last_reduced = held  # R as this rank holds it (valid until the next backward)
            norm = global_norm(partials)
            coef = clip_coefficient(norm, self.config.clip_norm)
            if coef is not None:
                for x in g:
                    x.mul_(torch.tensor(coef, device=x.device))
            self.t += 1
            for u, gu, runs in zip(self.units, g, self.runs, strict=True):
                step_runs(
                    self.config.optimizer,
                    self.config.groups,
                    runs,
                    self.t,
                    u.master,
                    gu,
                    u.opt,
                    deterministic=self.config.deterministic,
                )
                self.impl.refresh_working(u)  # may launch its all-gather and return
            self.impl.finish_step()
        if self.scaler is not None:
            self.scaler = scaler_update(self.scaler, overflow, self.config.scaler)
        self.data_step, self.microstep = self.data_step + 1, 0
        self.counter.step += 1
        return StepResult(
            loss=loss, norm=None if norm is None else float(norm), skipped=overflow, scale=scale
        )

    def _exchange(self, held, g, inv: np.float32):
        """[Note: one control exchange] Everything a step needs from the other ranks besides
        R travels in one small all-gather of float64 values: this rank's loss sum and count, its
        overflow flag, and the chunk partials of the part of g it alone holds (its shard; at
        stage 0 the shard's extent of the whole). Chunks never straddle shards and shards are
        in rank order, so rank-major order is the global chunk order (reference/layout.py).
        The flag: g = fp32(R)·inv, and with inv ≤ 1 g is finite exactly where R is; the
        squares of finite float32 values cannot overflow float64, so a non-finite partial
        means a non-finite R ([Note: overflow detection]). With inv > 1 (a loss scale below
        1/M) g could overflow where R did not, so R itself is checked.
        Returns (overflow anywhere, on this rank, global mean loss, per-unit partials)."""
        mine = [chunk_sumsq(self._own(u, x), self.config.chunk) for u, x in zip(self.units, g)]
        partials = torch.cat(mine).to(self.device)  # host partials with offload_optimizer
        if inv <= 1:
            bad = not bool(torch.isfinite(partials).all())
        else:
            bad = any(not bool(torch.isfinite(h).all()) for h in held)
        head = torch.tensor(
            [sum(self._losses), len(self._losses), float(bad)],
            dtype=torch.float64,
            device=self.device,
        )
        every = C.gather_control(
            torch.cat([head, partials]), group=self.group, counter=self.counter, phase="step"
        )
        self._losses = []
        loss = float(every[:, 0].sum() / every[:, 1].sum())
        overflow = bool(every[:, 2].max() > 0)
        per_unit, at = [], len(head)
        for u, x in zip(self.units, mine, strict=True):
            per_unit.append(
                every[:, at : at + x.numel()].reshape(-1)[: u.part.layout.num_chunks].cpu().numpy()
            )
            at += x.numel()
        return overflow, bad, loss, per_unit

    @staticmethod
    def _own(u: FlatUnit, x: torch.Tensor) -> torch.Tensor:
        """The part of a unit-sized or shard-sized buffer that this rank alone accounts for."""
        return x[u.part.own] if x.numel() == u.part.padded_numel else x

    # -- checkpoints (zero/checkpoint.py) -------------------------------------------------------

    def save(self, directory, **kwargs):
        """A sharded, atomically committed checkpoint of every rank's state (zero/checkpoint.py)."""
        from . import checkpoint

        return checkpoint.save(self, directory, **kwargs)

    def load(self, directory, **kwargs):
        """Load a checkpoint saved at any world size and stage, resharding on load."""
        from . import checkpoint

        return checkpoint.load(self, directory, **kwargs)

    # -- bookkeeping used by the stages and by verification ------------------------------------

    def gathered_params(self):
        """Context manager: the module's full working parameters are readable inside (stage 3
        all-gathers every unit and frees them on exit; stages 0-2 hold them anyway)."""
        return self.impl.gathered()

    def state_names(self, group: int) -> tuple[str, ...]:
        return state_names(self.config.optimizer, self.config.groups[group])

    def note_partials(self, u: FlatUnit, peak: int) -> None:
        self.extra_partials[u.index] = max(self.extra_partials[u.index], peak)

    def note_transient(self, t: torch.Tensor | int) -> None:
        """Reductions in flight each hold an arrival and a receive buffer of t's size (bytes)."""
        nbytes = t if isinstance(t, int) else t.nbytes
        held = 2 * nbytes * max(1, min(len(self.impl.inflight), self.impl.max_inflight))
        self.transient_peak = max(self.transient_peak, held)

    def _resident(self) -> dict[str, list[torch.Tensor]]:
        """The resident tensors by category. With offload_optimizer: host gradient buffers
        under grads, and the compute-dtype upload staging as its own category."""
        grads = [u.grad for u in self.units]
        out = {
            "params": [self.impl.working_extent(u)[0] for u in self.units],
            "grads": grads,
            "master": [u.master for u in self.units],
            "optimizer": [t for u in self.units for t in u.opt.values()],
        }
        if self.offload is not None:
            grads += [t for u in self.units for t in (u.host_grad, u.host_stage) if t is not None]
            staging = [u.staging for u in self.units if u.staging is not None]
            if staging:
                out["staging"] = staging
        return out

    def memory_report(self) -> dict[str, int]:
        """Resident bytes by category, each storage counted once (a view owns nothing new:
        with contiguous_memory each gradient arena counts once, whole, under grads), wherever
        they live (memory_split() tells device from host)."""
        split = self.memory_split()
        return {k: split["device"][k] + split["host"][k] for k in split["device"]}

    def memory_split(self) -> dict[str, dict[str, int]]:
        """memory_report's categories split by placement: {"device": {...}, "host": {...}}.
        Host is what offload_optimizer placed there (a placement, also on a CPU-only machine);
        the streaming tree's partial sums and the communication buffers are device memory."""
        seen: set[int] = set()
        is_host = self.offload.is_host if self.offload is not None else (lambda t: False)

        def owned(tensors, host: bool) -> int:
            total = 0
            for t in tensors:
                s = t.untyped_storage()
                if is_host(t) == host and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
            return total

        extra = sum(
            p * u.part.shard_numel * self.config.grad_dtype.itemsize
            for p, u in zip(self.extra_partials, self.units, strict=True)
        )
        resident = self._resident()
        device = {k: owned(v, False) for k, v in resident.items()}
        host = {k: owned(v, True) for k, v in resident.items()}
        device["grads"] += extra
        device["comm_buffers"], host["comm_buffers"] = self.transient_peak, 0
        order = ["params", "grads", "master", "optimizer", "comm_buffers", "staging"]
        return {
            "device": {k: device[k] for k in order if k in device},
            "host": {k: host[k] for k in order if k in host},
        }

    def unit_specs(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """The units as the reference describes them: [[(param name, shape)], ...]."""
        return [[(s.name, s.shape) for s in u.part.layout.slots] for u in self.units]

    def gather_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """The full fp32 master and optimizer states by parameter name, on every rank (an
        all-gather of the shards, counted as control traffic)."""
        master: dict[str, torch.Tensor] = {}
        opt: dict[str, dict[str, torch.Tensor]] = {pn: {} for pn in self.group_index}
        for u in self.units:
            for key, t in {"master": u.master, **u.opt}.items():
                full = self._full(u, t)
                for s, (pn, _) in zip(u.part.layout.slots, u.params, strict=True):
                    v = full[s.offset : s.offset + s.numel].view(s.shape).clone()
                    if key == "master":
                        master[pn] = v
                    elif key in self.state_names(self.group_index[pn]):
                        opt[pn][key] = v
        return master, opt

    def load_full_state(self, master, opt, *, t: int, data_step: int, scaler=None) -> None:
        """Set every model state from full fp32 arrays by parameter name. No communication:
        each rank takes its own extent. Verification runs fast mode in lock-step with it."""

        def padded(u: FlatUnit, arrays) -> torch.Tensor:
            full = torch.zeros(u.part.padded_numel, device=u.working.device)
            u.part.flatten_into(
                full, {k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()}
            )
            return full

        if self.offload is not None:  # no upload may still read a host buffer written here
            self.offload.synchronize()
        for u in self.units:
            ext = self.impl.master_extent(u)
            full = padded(u, {k: master[k] for k, _ in u.params})
            resident, held = self.impl.working_extent(u)
            resident.copy_(full[held])  # the master rounded to the compute dtype
            if u.master.untyped_storage().data_ptr() != resident.untyped_storage().data_ptr():
                u.master.copy_(full[ext])
            for x, state in u.opt.items():
                zeros = {k: np.zeros(tuple(p.shape), np.float32) for k, p in u.params}
                state.copy_(padded(u, {k: opt[k].get(x, zeros[k]) for k, _ in u.params})[ext])
        self.t, self.data_step, self.scaler = t, data_step, scaler

    def _full(self, u: FlatUnit, t: torch.Tensor) -> torch.Tensor:
        if t.numel() == u.part.padded_numel:
            return t
        every = C.gather_control(
            t.to(self.device).contiguous(),
            group=self.group,
            counter=self.counter,
            phase="gather_state",
        )
        return every.reshape(-1)
