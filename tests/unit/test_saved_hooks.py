"""Every saved-tensor hook of the project lets go of a graph that is dropped without backward
([Note: pack hooks keep a detached tensor] in zero/zero_r/activations.py).

The graph under test saves its own output (exp saves its result), the case in which a pack hook
that keeps the tensor itself closes a cycle through C++ that gc.collect() cannot break. A hook
that returns the tensor unchanged is checked to leak, so that the check is known to see the leak.
"""

from __future__ import annotations

import contextlib
import gc
import types
import weakref

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from measure.resident import saved_activations
from zero.collectives import CommCounter
from zero.zero_r.activations import ActivationOffload, saved_activation_bytes
from zero.zero_r.contiguous import CheckpointArena


def _arena_miss():
    """The checkpoint arena's miss path: the first checkpoint sizes the buffer for one unit of
    4 elements, so the 64-element output saved after it does not fit and is kept as it is."""
    arena = CheckpointArena(units=1, device="cpu")

    @contextlib.contextmanager
    def hooks():
        with saved_tensors_hooks(arena.store, arena.load):
            torch.ones(4, requires_grad=True).exp()  # sizes the buffer; its graph dies here
            yield
        assert arena.misses >= 1  # the tensors under test took the path that keeps them

    return hooks()


HOOKS = {
    "measure.resident.saved_activations": lambda: saved_activations(),
    "zero_r.saved_activation_bytes": lambda: saved_activation_bytes(
        types.SimpleNamespace(units=[])
    ),
    "zero_r.ActivationOffload (CPU)": lambda: ActivationOffload(CommCounter(), unit=0),
    "zero_r.CheckpointArena (a miss)": _arena_miss,
}


def _dropped_output_lives(hooks) -> bool:
    """Record exp's graph inside `hooks`, drop it without backward, and say whether the output
    tensor is still alive after a full collection."""
    x = torch.randn(64, requires_grad=True)
    with hooks:
        y = x.exp()
    alive = weakref.ref(y)
    del y
    gc.collect()
    return alive() is not None


@pytest.mark.parametrize("name", HOOKS)
def test_hook_lets_an_undifferentiated_graph_go(name):
    assert not _dropped_output_lives(HOOKS[name]())


def test_a_hook_keeping_the_tensor_itself_leaks():
    # the planted form of the defect: torch's own saved_tensors_hooks with the identity
    assert _dropped_output_lives(saved_tensors_hooks(lambda t: t, lambda t: t))


@pytest.mark.parametrize("name", HOOKS)
def test_hook_keeps_backward_exact(name):
    """Detaching in the pack hook changes nothing in backward: the gradient through a saved
    output is the same bits as without any hook."""
    x = torch.randn(64, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    plain = x.clone().requires_grad_(True)
    plain.exp().tanh().sum().backward()
    hooked = x.clone().requires_grad_(True)
    with HOOKS[name]():
        loss = hooked.exp().tanh().sum()
    loss.backward()
    assert torch.equal(plain.grad.view(torch.int32), hooked.grad.view(torch.int32))
