"""A stage-3 unit's parameters between uses: where the unit is (PartitionState), and
Stage3Parameter, whose values may be read only while its unit is gathered ([Note: freeing by
storage resize] in zero/stages/stage3.py).
"""

from __future__ import annotations

import enum
import itertools

import torch
from torch import nn


class PartitionState(enum.Enum):
    """Where a unit's working parameters are. Memory per rank, for a unit of Ψ_u elements:"""

    SHARDED = "sharded"
    """Only this rank's shard: Ψ_u/N elements of the compute dtype."""
    GATHERING = "gathering"
    """An all-gather is in flight into the full buffer: Ψ_u elements already allocated."""
    GATHERED = "gathered"
    """The full unit is present: Ψ_u elements (the shard is kept as well: Ψ_u/N more)."""


_METADATA = frozenset(
    "size numel dim stride element_size nelement __len__ __hash__ requires_grad_ "
    "is_contiguous is_floating_point is_complex is_signed get_device ndimension".split()
)


def _reads_values(func) -> bool:
    """Whether a torch function needs the tensor's values (tensor properties do not, but
    `.data` hands out a plain tensor over the same storage, so it counts)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    return name not in _METADATA and not name.startswith("register_")  # hooks touch no values


class Stage3Parameter(nn.Parameter):
    """A stage-3 unit's parameter: its values exist only while the unit is gathered."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_values(func):
            for a in itertools.chain(args, kwargs.values()):
                for t in a if isinstance(a, list | tuple) else (a,):
                    if isinstance(t, Stage3Parameter) and t._zero_unit.state is not (
                        PartitionState.GATHERED
                    ):
                        raise RuntimeError(
                            f"parameter {t._zero_name!r} of unit {t._zero_unit.name or '<root>'} "
                            "is sharded (ZeRO stage 3): its values exist only while its unit runs. "
                            "Read it inside the model's forward, or within "
                            "`with engine.gathered_params():`. If the forward of unit "
                            f"{t._zero_unit.name!r} is never called itself (its submodules or "
                            "parameters are used directly), it is never gathered: name the "
                            "modules that are called as units (docs/models.md)"
                        )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
