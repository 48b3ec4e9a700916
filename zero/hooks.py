"""What a ZeroEngine installs on its module, and how all of it is taken back; the phase hook.

[Note: gradient hooks hold the engine weakly] A hook registered on a parameter lives in the
tensor's C++ autograd metadata, which Python's collector does not traverse. A hook closing over
the engine made the cycle parameter → hook → engine → module → parameter invisible to it: a
dropped engine, with its module, kept every model state alive until the process ended (in one
process building systems one after another, as a benchmark or a notebook does, memory grew by
a whole engine each time). The hook holds the engine through a weak reference and finds its unit
by index. When the engine is collected a finalizer takes back everything it installed on the
module: the parameter hooks, the module hooks of CalledCheck and stage 3, the checkpointing
wrappers of ZeRO-R. A module that outlives its engine then holds none of the engine's state at
stages 0-2. At stage 3 its parameters are the engine's Stage3Parameter views, each naming its
unit, so the units stay as long as the module does (gather_state() first to keep the values).
tests/distributed/test_engine_lifetime.py checks that a dropped engine frees its tensors.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.utils._pytree as pytree

from .build import CalledCheck
from .materialize import seeded_rng, stable_seed
from .zero_r.activations import checkpoint_units
from .zero_r.contiguous import CheckpointArena

_NO_PHASE = contextlib.nullcontext()


def no_phase(name: str) -> contextlib.AbstractContextManager:
    """[Note: named phases] The engine runs each phase of a step under `engine.phase(name)`:
    forward; backward, backward.hooks (a unit's reduction launched), backward.finalize; update,
    update.reduce, update.control (the exchange), update.optimizer, update.refresh (the new
    working copy), update.finish. This default enters nothing; measure/bench.py sets a timer to
    see where a step's time goes, so timing needs no patching of the engine's internals."""
    return _NO_PHASE


def phased(name: str):
    """Run the decorated engine method under `self.phase(name)` ([Note: named phases])."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with self.phase(name):
                return method(self, *args, **kwargs)

        return run

    return wrap


def install(engine, mp) -> tuple[CalledCheck, CheckpointArena | None]:
    """Register the gradient hooks, CalledCheck, every stage's module hooks and (ZeRO-R)
    activation checkpointing; returns (the CalledCheck, the checkpoint arena or None). A
    finalizer on the engine removes all of it."""
    hooks = [
        p.register_post_accumulate_grad_hook(_post_accumulate(weakref.ref(engine), u.index, i))
        for u in engine.units
        for i, (_, p) in enumerate(u.params)
    ]
    mods, every_unit = dict(engine.module.named_modules()), [*engine.units, *engine.frozen_units]
    called = CalledCheck(list(dict.fromkeys(u.name for u in every_unit)), mods)
    undo = [functools.partial(_remove_hooks, hooks), called.stop]
    for stage in engine.stages.values():
        handles = stage.register_hooks({u.name: mods[u.name] for u in every_unit} | {"": mods[""]})
        undo.append(functools.partial(_remove_hooks, handles))
    arena = None
    if engine.config.activation_checkpointing:  # ZeRO-R (zero/zero_r/activations.py)
        arena, unwrap = checkpoint_units(
            engine.units,
            mods,
            config=engine.config,
            counter=engine.counter,
            device=engine.device,
            mp=mp,
        )
        undo.append(unwrap)
    weakref.finalize(engine, _run_all, undo)
    return called, arena


def _post_accumulate(engine_ref: weakref.ref, index: int, i: int):
    """The post-accumulate-grad hook of parameter i of unit `index`."""

    def post_accumulate(_param) -> None:
        engine = engine_ref()
        if engine is None:  # collected; its finalizer is removing this hook
            return
        u = engine.units[index]
        u.used[i] = True  # [Note: unused parameters]: it has a gradient this step
        u.ready += 1
        if u.ready == len(u.params):  # overlap only decides whether it runs asynchronously
            engine.launch_ready()

    return post_accumulate


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()


def _run_all(undo) -> None:
    for fn in undo:
        fn()


# -- Around the wrapped module's forward and backward: input casting, seeded randomness, scaling ---
# Legend: N world size, k the micro-step within a data step, j = k·N + rank the micro-batch index
# (docs/design.md §2: micro-batch j runs on rank j mod N at micro-step j div N).
#
# - Inputs: every floating tensor among the inputs, positional or keyword, nested in lists, tuples
#   and dicts, is cast to the compute dtype, as FSDP's mixed precision casts forward inputs;
#   integer and bool tensors (token ids, masks) are passed as given. Verification casts its
#   single-process micro-batches with the same function, so both sides see the same inputs.
# - Randomness: [Note: seeded forward] Each micro-batch's forward runs with torch's RNG (the CPU
#   generator and, on a GPU, the engine device's) seeded from (seed, data step, j), inside
#   `torch.random.fork_rng`, so dropout draws the same masks at every N, rank and stage, and the
#   caller's own random stream is left as it was. Non-reentrant activation checkpointing stores
#   and restores this state for its recomputation, so recomputed dropout masks are the same too.


def cast_inputs(args, kwargs, dtype: torch.dtype) -> tuple[tuple, dict]:
    """(args, kwargs) with every floating tensor in them (at any depth of lists, tuples and
    dicts) cast to `dtype`; every other value as given."""

    def cast(x):
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    return tuple(pytree.tree_map(cast, tuple(args))), pytree.tree_map(cast, dict(kwargs))


def backward_scaled(loss: torch.Tensor, scale: float | None) -> None:
    """Backward of S·loss (fp16) or of loss. Verification computes single-process micro-batch
    gradients through this same function, so that they are the engine's bits."""
    (loss if scale is None else loss.float() * scale).backward()


def microbatch_seed(seed: int, data_step: int, j: int) -> int:
    """The RNG seed of micro-batch j's forward in data step `data_step` ([Note: seeded forward])."""
    return stable_seed("forward", seed, data_step, j)


def forward_rng(seed: int | None, data_step: int, j: int, device):
    """seeded_rng for micro-batch j of `data_step`; nothing at all when seed is None."""
    if seed is None:
        return contextlib.nullcontext()
    return seeded_rng(microbatch_seed(seed, data_step, j), device)
