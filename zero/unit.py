"""A unit at runtime: its parameters, its flat buffers, and what is in flight.

Legend: N world size, L shard length, so a full flat buffer has N·L elements (UnitPartition).
Tensor comments give rank (1D), dtype and extent. Which of these a rank keeps full, keeps as a
shard, or never allocates is the stage's choice (zero/stages/), where, the placement's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from reference.tree import StreamingTree

from .partition import UnitPartition


class FlatUnit:
    """One unit's parameters, flattened into a working buffer that they become views of."""

    # Set by some configurations only, None otherwise. offload_optimizer (zero/zero_r/offload.py),
    # host memory: the reduced gradient's extent, and fast mode's addend.
    host_grad: torch.Tensor | None = None  # 1D, reduction dtype, the master's extent
    host_stage: torch.Tensor | None = None  # 1D, reduction dtype, L
    # Stage 3 (zero/stages/stage3.py): the PartitionState (zero/stages/sharded.py), the resident
    # shard of the working copy, and the autograd version counter a prefetch keeps ([Note:
    # re-gathering under saved views]).
    state = None
    shard: torch.Tensor | None = None  # 1D, compute dtype, L
    keep_version = None

    def __init__(
        self, index: int, name: str, params: list, part: UnitPartition, dtype, device, values=None
    ):
        """params: (name, nn.Parameter) pairs; dtype: the compute dtype. values(name, shape) ->
        fp32 tensor: each parameter's start value, for a model built on the meta device (one
        unit is materialised at a time); otherwise the parameters' own values are used."""
        self.index, self.name, self.part = index, name, part
        self.frozen = False  # a unit's frozen parameters (zero/build.py): no grad, no master
        # [Note: params as views] Each parameter's data becomes a view into `working`, at its
        # 256-byte-aligned offset (reference/layout.py), so that forward reads the flat buffer
        # that the all-gather writes, with no copy, and layouts are the same on every device.
        # the fp32 start values (1D, N·L); the stage takes the master from them, then drops them
        self.initial: torch.Tensor | None = torch.zeros(part.padded_numel, device=device)
        start = {n: values(n, tuple(p.shape)) if values else p.detach().float() for n, p in params}
        part.flatten_into(self.initial, start)
        del start
        # 1D, compute dtype, N·L: the fp32 values rounded to nearest even (the same tensor in fp32)
        self.working = self.initial if dtype == torch.float32 else self.initial.to(dtype)
        self.params: list[tuple[str, nn.Parameter]] = []
        self.replaced: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its real successor
        with torch.no_grad():
            views = part.views(self.working)
            for pname, p in params:
                if p.is_meta:  # a meta tensor cannot take a CPU/CUDA view as its data
                    new = nn.Parameter(views[pname], requires_grad=p.requires_grad)
                    self.replaced[id(p)] = new
                    p = new
                else:
                    p.data = views[pname]
                self.params.append((pname, p))
        self.master: torch.Tensor  # 1D, fp32, N·L (stage 0) or L; a view of working in fp32
        self.opt: dict[str, torch.Tensor] = {}  # 1D, fp32, the master's extent
        # 1D, reduction dtype, N·L (stages 0-1) or L (stages 2-3); with contiguous_memory a view
        # of the gradient arena (zero/zero_r/contiguous.py); with offload (stages 2-3) on the host.
        # Between steps it may be released ([Note: gradients live within a step]): the grad
        # property allocates it again, zeros, on its first use.
        self._grad: torch.Tensor | None = None
        self.renew_grad: Callable[[], torch.Tensor] | None = None  # set where it is releasable
        self.grad_nbytes = 0  # what u.grad holds within a step (counted while it is released)
        self.stream = StreamingTree()  # deterministic mode: B_k partial sums of this step
        self.pending = None  # fast mode: the reduction launched after the last micro-batch
        self.ready = 0  # parameters whose gradient arrived in the current backward
        # [Note: unused parameters] (reference/step.py), per parameter in slot order: whether
        # it had a gradient in some micro-batch of this step on this rank, and t_p, the
        # optimizer steps it has taken (the same on every rank)
        self.used = [False] * len(self.params)
        self.steps = [0] * len(self.params)

    @property
    def grad(self) -> torch.Tensor:
        """[Note: gradients live within a step] A unit's gradient buffer is needed from its first
        gradient in a step's backward to the end of that step's update. With release_grads the
        engine releases it after the update (as zero_grad(set_to_none=True) releases .grad) and
        its first use in the next step allocates it again, zeros: the buffer a fresh engine has,
        so no bit moves, and it no longer adds to the peak, which comes in backward (costs and
        defaults: docs/design.md §3.9)."""
        if self._grad is None:
            if self.renew_grad is None:
                raise AttributeError(f"unit {self.name or '<root>'} has no gradient buffer")
            self._grad = self.renew_grad()
        return self._grad

    @grad.setter
    def grad(self, value: torch.Tensor) -> None:
        self._grad = value
        self.grad_nbytes = value.numel() * value.element_size()

    @property
    def grad_released(self) -> bool:
        return self._grad is None and self.renew_grad is not None

    def release_grad(self) -> None:
        """After the update: drop the gradient buffer where it is releasable."""
        if self.renew_grad is not None:
            self._grad = None

    @property
    def numel(self) -> int:
        return self.part.layout.numel

    def grads(self) -> dict[str, torch.Tensor]:
        """This backward's gradients by parameter name (zeros for unused parameters). The zeros
        are built from metadata alone: at stage 3 an unused unit is sharded, and reading its
        parameters (zeros_like does) would raise."""
        zeros = lambda p: torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        return {n: zeros(p) if p.grad is None else p.grad for n, p in self.params}

    def real_in(self, lo: int, hi: int) -> int:
        """Non-padding elements of the padded flat buffer in [lo, hi)."""
        return sum(
            max(0, min(s.offset + s.numel, hi) - max(s.offset, lo)) for s in self.part.layout.slots
        )

    def fill_columns(self, buf: torch.Tensor, grads: dict[str, torch.Tensor], a: int, b: int):
        """buf (N, b-a) <- columns [a, b) of every rank's shard of the flat gradient, straight
        from the parameters' gradients (no full-size buffer); padding stays as buf has it."""
        L = self.part.shard_numel
        for r in range(buf.shape[0]):
            lo, hi = r * L + a, r * L + b
            for s in self.part.layout.slots:
                x, y = max(lo, s.offset), min(hi, s.offset + s.numel)
                if x < y:
                    src = grads[s.name].reshape(-1)[x - s.offset : y - s.offset]
                    buf[r, x - lo : y - lo].copy_(src)  # exact upcast into the reduction dtype

    def clear_grads(self) -> None:
        for _, p in self.params:
            p.grad = None
