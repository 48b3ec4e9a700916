"""ZeRO-R's activation memory: checkpointing per unit, and checkpoints kept in host memory.

Legend (paper §6.1, docs/paper.md §1.5): b batch, s sequence length, h hidden size, l units
(transformer blocks). Without checkpointing a transformer keeps about 12·b·s·h elements per
block for backward (the paper's footnote); with one checkpoint per block it keeps the block's
input, b·s·h elements, and recomputes the rest in backward, one block at a time.

`checkpoint_units` makes each unit's forward (not the root's) run under
`torch.utils.checkpoint(..., use_reentrant=False)`. The wrapper replaces the module's *bound*
forward (an instance attribute), so that module hooks, parameter names and state_dict keys stay
as they were; recomputation calls the original forward directly, so no module hook runs twice.

[Note: recomputation at stage 3] At stage 3 a unit is sharded between its forward and its backward.
Its outputs carry the OnBackward marker of Stage3.pre_backward (zero/stages/), which sits *after*
the checkpointed region in the graph, so its backward (the unit's all-gather) runs before any node
of the region, and the first saved tensor the region unpacks triggers the recomputation on gathered
parameters.
So recomputation needs no gather of its own: 2 all-gathers per unit per
micro-step, as without checkpointing. Prefetch is unaffected: backward prefetches the unit
before this one in forward order, which the recomputation does not touch. The parameters'
version counters are preserved across gathers ([Note: re-gathering under saved views]); the
recomputed forward saves fresh views of the gathered buffer, consumed within the same backward.

[Note: what the offload hook sees] Hooks nest: the innermost saved_tensors_hooks wins. The
offload hook is entered around the checkpoint call, and non-reentrant checkpointing saves its
inputs before entering its own hook for the region's insides, so exactly the unit inputs (the
checkpoints) pass through the offload hook; everything else is recomputed. With
contiguous_memory (ZeRO-R's M_D) a hook in the same place copies each checkpoint into
the engine's activation_arena, a host one under offload_activations ([Note: checkpoint generations]
in zero/zero_r/contiguous.py).

[Note: pack hooks keep a detached tensor] A pack hook of `saved_tensors_hooks` receives the saved
tensor with its grad_fn. When the saved tensor is the output of the node that saves it (exp,
tanh, softmax save their results), keeping that tensor makes a cycle through C++: node → saved
variable → tensor → node, which Python's collector cannot see. A backward breaks it; a graph
built and dropped without one (a forward under grad that is never differentiated, a measurement
of saved bytes) then leaks everything it saved, every time. Every hook here that keeps the
tensor itself keeps `t.detach()`: the same storage and values (autograd puts the grad_fn back
when it unpacks), without the edge back to the node. tests/unit/test_saved_hooks.py builds such
graphs and checks that each hook lets them go.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from ..common.traffic import count_transfer
from .contiguous import CheckpointArena


def check_not_nested(names) -> None:
    """Checkpointed units must not contain each other: recomputing the outer one would run the
    inner one's module hooks (at stage 3: a gather and a free) a second time."""
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(
                    f"units: {a!r} contains {b!r}; activation_checkpointing needs units that "
                    "do not nest"
                )


def checkpoint_units(
    units, modules: dict[str, torch.nn.Module], *, config, counter, device, mp=None
) -> tuple[CheckpointArena | None, list]:
    """Run every non-root unit's forward under non-reentrant checkpointing (and, with
    config.offload_activations, keep its checkpointed inputs in host memory, counted in
    `counter`; with config.contiguous_memory, copy them into the CheckpointArena returned;
    with config.partition_activations, keep 1/N_m of each over the MP group `mp`: P_a).
    Returns (the arena or None, a function that puts every wrapped forward back)."""
    check_not_nested(list(config.units))
    offload, arena, wrapped = config.offload_activations, None, []
    if config.contiguous_memory:  # M_D: checkpoints in one buffer (zero/zero_r/contiguous.py)
        arena = CheckpointArena(
            units=sum(1 for u in units if u.name),
            device="cpu" if offload else device,
            pin=offload and device.type == "cuda",
        )
    for u in units:
        if not u.name:
            continue
        m = modules[u.name]
        hooks = None  # a fresh hook context per call: each one records its unit's transfers
        if config.partition_activations:  # P_a (+cpu): zero/mp/partitioned.py
            from ..mp.partitioned import PartitionedCheckpoints

            hooks = functools.partial(
                PartitionedCheckpoints, mp, u.index, offload=offload, arena=arena
            )
        elif offload:
            hooks = functools.partial(ActivationOffload, counter, u.index, arena)
        elif arena is not None:
            hooks = functools.partial(saved_tensors_hooks, arena.store, arena.load)
        wrapped.append((m, m.__dict__.get("forward")))  # an instance forward of its own, or None
        m.forward = _checkpointed(m.forward, hooks)
    return arena, functools.partial(_unwrap, wrapped)


def _unwrap(wrapped) -> None:
    for m, own in wrapped:
        if own is None:
            del m.forward
        else:
            m.forward = own


def _checkpointed(forward, hooks):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved: nothing to checkpoint
            return forward(*args, **kwargs)
        ctx = hooks() if hooks is not None else contextlib.nullcontext()
        with ctx:  # [Note: what the offload hook sees]
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


class ActivationOffload(saved_tensors_hooks):
    """Keep the tensors saved inside the block in host memory; bring them back when unpacked.

    On CUDA the host copy is pinned and both copies are non-blocking: the download is ordered
    before any later kernel on the stream that could reuse the device memory, and the upload
    before the recomputation that reads it. A CPU tensor is kept as it is (no copy): on a
    CPU-only machine this is a change of accounting only. Every transfer is counted in the
    engine's CommCounter (kind='offload', phases activation_down / activation_up).

    With contiguous_memory, `arena` (the engine's activation_arena, a host CheckpointArena,
    pinned on CUDA) replaces the per-checkpoint host tensors: each checkpoint is copied into the
    next host slot (on CPU as well: the arena is the point), counted exactly as before."""

    def __init__(self, counter, unit: int, arena=None):
        def record(t: torch.Tensor, phase: str, op: str) -> None:
            count_transfer(counter, t, phase=phase, op=op, unit=unit)

        def pack(t: torch.Tensor):
            record(t, "activation_down", "d2h")
            if arena is not None:
                return t.device, arena.store(t)  # the handle keeps the slot's generation alive
            if t.device.type != "cuda":
                return t.device, t.detach()  # [Note: pack hooks keep a detached tensor]
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return t.device, host

        def unpack(packed):
            device, host = packed
            if arena is not None:
                host = arena.load(host)
            record(host, "activation_up", "h2d")
            return host.to(device, non_blocking=host.is_pinned())

        super().__init__(pack, unpack)


@dataclass
class SavedBytes:
    """Bytes autograd keeps for backward, each storage once (a view adds nothing)."""

    storages: dict[int, int] = field(default_factory=dict)  # storage data_ptr -> bytes

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def saved_activation_bytes(engine):
    """Count what autograd saves for backward in the block, the engine's parameters excluded:

        with saved_activation_bytes(engine) as saved:
            _, loss = engine(x, y)
        saved.nbytes

    The parameters' storage is the unit's working buffer (at stage 3 gathered while the unit
    runs, so it is looked up at each save). Under checkpointing the region's own saved tensors
    go to the checkpoint's inner hook and are not seen here: exactly the checkpoints are. Under
    offload_activations the checkpoints go to the offload hook instead ([Note: what the offload
    hook sees]): they are host bytes, counted in engine.counter (kind='offload'). Under
    contiguous_memory they go to the arena's hook: they are engine.activation_arena's bytes."""
    saved = SavedBytes()

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        params = {u.working.untyped_storage().data_ptr() for u in engine.units}
        if s.nbytes() and s.data_ptr() not in params:
            saved.storages[s.data_ptr()] = s.nbytes()
        return t.detach()  # [Note: pack hooks keep a detached tensor]

    with saved_tensors_hooks(pack, lambda t: t):
        yield saved
