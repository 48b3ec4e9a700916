"""Where a stage's buffers live: device memory, views of an arena (M_D), or host memory (offload).

Legend: u a FlatUnit (zero/unit.py); "extent" the elements of the padded flat buffer whose
update this rank owns; R the reduced gradient.

A stage decides *what* it keeps (full buffer or shard) and asks its Placement *where*: the
gradient buffer (an allocation of its own, a view of the gradient arena with contiguous_memory,
[Note: contiguous memory] in zero/zero_r/contiguous.py, or the host with offload_optimizer), and the
copies that cross between the optimizer's side and the device (zero/zero_r/offload.py counts
them). Without offload every copy is a plain device copy, so the stages have no offload branch.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..unit import FlatUnit
from .contiguous import Arena, grad_arenas
from .disk import DiskOffload, disk_bytes
from .offload import HostOffload


class Placement:
    """The placement policy of one engine: arenas (optional) and host offload (optional)."""

    def __init__(
        self,
        *,
        grad_dtype: torch.dtype,
        grad_arena: Arena | None = None,
        host_grad_arena: Arena | None = None,
        offload: HostOffload | None = None,
    ):
        self.grad_dtype = grad_dtype
        self.grad_arena = grad_arena  # device gradient buffers, with contiguous_memory
        self.host_grad_arena = host_grad_arena  # host gradient buffers, with both options
        self.offload = offload

    @classmethod
    def build(cls, config, parts, stages, *, device, counter) -> Placement:
        """The policy config asks for: host offload (offload_optimizer) and gradient arenas
        (contiguous_memory), sized from the partitions and each unit's stage class."""
        offload = None
        if config.offload_optimizer:  # ZeRO-Offload (zero/zero_r/offload.py), to disk (disk.py)
            host = dict(device=device, counter=counter, grad_dtype=config.grad_dtype,
                        compute_dtype=config.compute_dtype)  # fmt: skip
            if config.offload_dir is None:
                offload = HostOffload(**host)
            else:
                need = disk_bytes(config, parts, stages)  # refused before any file if short
                offload = DiskOffload(directory=config.offload_dir, needed=need, **host)
        arenas = None, None
        if config.contiguous_memory:  # M_D (zero/zero_r/contiguous.py)
            arenas = grad_arenas(
                parts, stages, dtype=config.grad_dtype, device=device, offload=offload
            )
        return cls(
            grad_dtype=config.grad_dtype,
            grad_arena=arenas[0],
            host_grad_arena=arenas[1],
            offload=offload,
        )

    def arenas(self) -> tuple[Arena | None, Arena | None]:
        """(device, host) gradient arenas, None where not used."""
        return self.grad_arena, self.host_grad_arena

    def new_grad(self, u: FlatUnit, numel: int, on_host: bool) -> torch.Tensor:
        """u.grad, zeros: a view of the gradient arena with contiguous_memory, else an
        allocation of its own. A buffer that offload_optimizer places on the host (on_host) is
        only a placeholder here: the host buffer replaces it (place), so no device memory is
        spent on it."""
        dtype, device = self.grad_dtype, u.working.device
        if self.offload is not None and on_host:
            return torch.empty(0, dtype=dtype, device=device)
        if self.grad_arena is None:
            return torch.zeros(numel, dtype=dtype, device=device)
        view = self.grad_arena.take(numel, dtype)
        assert view is not None, "the gradient arena was sized from these same partitions"
        return view

    def new_states(self, master: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
        """The optimizer states, zeros like the master; with offload_optimizer empty
        placeholders, which place() replaces by the host's (or the disk tier's) own."""
        if self.offload is not None:
            return {x: master.new_empty(0) for x in names}
        return {x: torch.zeros_like(master) for x in names}

    def releasable(self, on_host: bool) -> bool:
        """Whether u.grad may be released between steps ([Note: gradients live within a step]):
        not as a view of the gradient arena, whose long life is its point, nor as
        offload_optimizer's host buffer."""
        return self.grad_arena is None and not (self.offload is not None and on_host)

    def place(self, u: FlatUnit, *, grad_on_host: bool, extent: slice) -> None:
        """After the stage allocated u: its optimizer side to the host (offload_optimizer)."""
        if self.offload is not None:
            self.offload.place(u, grad_on_host, extent, self.host_grad_arena)

    def is_host(self, t: torch.Tensor) -> bool:
        return self.offload is not None and self.offload.is_host(t)

    def write_working(self, u: FlatUnit, dst: torch.Tensor) -> None:
        """dst (the resident working extent) <- the master rounded to nearest even into the
        compute dtype; with offload_optimizer, rounded on the host and uploaded (counted)."""
        if self.offload is None:
            dst.copy_(u.master)
        else:
            self.offload.up(u, dst)

    def store_grad(self, u: FlatUnit, shard: torch.Tensor) -> None:
        """u.grad <- shard; with offload_optimizer u.grad is on the host: a counted download."""
        if self.offload is None:
            u.grad.copy_(shard)
        else:
            self.offload.down(u, u.grad, shard)

    def add_grad(self, u: FlatUnit, shard: torch.Tensor) -> None:
        """u.grad += shard (fast mode's running sum of reduced shards, on the host if there)."""
        if self.offload is None:
            u.grad += shard
        else:
            u.grad += self.offload.down_now(u, shard)

    def to_optimizer(self, units: list[FlatUnit], held: list[torch.Tensor]) -> list:
        """R's extent of each unit where the optimizer runs (host with offload_optimizer)."""
        if self.offload is None:
            return held
        held = [
            h if self.offload.is_host(h) else self.offload.down(u, u.host_grad, h)
            for u, h in zip(units, held, strict=True)
        ]
        self.offload.synchronize()
        return held

    def streamed(self, units: list[FlatUnit]):
        """Context around the update of `units`: the disk tier reads and writes their states
        (zero/zero_r/disk.py); nothing for the other placements."""
        return nullcontext() if self.offload is None else self.offload.streamed(units)

    def is_disk(self, t: torch.Tensor) -> bool:
        return self.offload is not None and self.offload.is_disk(t)

    def synchronize(self) -> None:
        """Before the CPU writes what a queued copy may still read (offload only)."""
        if self.offload is not None:
            self.offload.synchronize()
