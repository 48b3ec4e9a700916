"""Stage 3's one addition for frozen parameters: when a frozen buffer may be freed in backward.

A trainable unit is freed by its post_backward, which the parameters' post-accumulate-grad
hooks start once every gradient of the unit has arrived; by then every backward node that read
those parameters has run. Frozen parameters have no such hook (torch refuses one on a tensor
that does not require grad), and a trainable hook firing says nothing about the frozen weights
still needed for the inputs' gradient (x·Wᵀ of a frozen W runs after the adapter's gradients).
So the unit's inputs that need a gradient pass an identity Function whose backward runs once
the whole unit's backward has produced their gradients: then the frozen buffer is freed. A unit
whose inputs need no gradient (the first block of a frozen trunk) keeps it until the end of the
micro-step, where every unit still gathered is freed (Stage3.end_microstep).
"""

from __future__ import annotations

import torch

from .base import OnBackward


def mark_inputs(stage, u):
    """A forward pre-hook (with_kwargs=True) for frozen unit u's module: the inputs that need a
    gradient pass OnBackward (zero/stages/base.py), so stage.release(u) runs after u's backward."""

    def hook(_m, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        return OnBackward.mark(stage.release, u, (args, kwargs))

    return hook
