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


_VIEWS = frozenset("data T mT H mH real imag".split())
"""The tensor properties that hand out a tensor over the same storage."""


def _reads_values(func) -> bool:
    """Whether a torch function needs the tensor's values (tensor properties do not, but those
    of _VIEWS hand out a tensor over the same storage, so they count)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", "") in _VIEWS
    return name not in _METADATA and not name.startswith("register_")  # hooks touch no values


class Stage3Parameter(nn.Parameter):
    """A stage-3 unit's parameter: its values exist only while the unit is gathered."""

    def __deepcopy__(self, memo):
        """A plain Parameter with the values: read, so refused by name while sharded."""
        memo[id(self)] = out = nn.Parameter(self.detach().clone(), self.requires_grad)
        return out

    def __repr__(self, **_):
        """nn.Parameter's text (the values read: refused by name while sharded)."""
        return "Parameter containing:\n" + repr(self.detach().requires_grad_(self.requires_grad))

    def __reduce_ex__(self, protocol):
        """Pickled (torch.save too) as a plain Parameter with the values, as __deepcopy__."""
        return nn.Parameter, (self.detach().clone(), self.requires_grad)

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
