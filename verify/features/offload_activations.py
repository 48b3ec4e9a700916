"""P_a+cpu's host half on one rank (ZeroConfig.offload_activations): the activation checkpoints
kept in host memory, copied back for the recomputation (zero/zero_r/activations.py)."""

from __future__ import annotations

import torch

from .record import Bug, Feature, Pair


def plant_offloaded_checkpoints_rounded(p) -> None:
    """ "Saves host memory": the offloaded checkpoints kept in bf16."""
    from zero.zero_r import activations

    original = activations.ActivationOffload.__init__

    def init(self, counter, unit, arena=None):
        original(self, counter, unit, arena)
        pack = self.pack_hook

        def rounded(t):
            if t.is_floating_point() and t.dtype != torch.bfloat16:
                t = t.to(torch.bfloat16).to(t.dtype)
            return pack(t)

        self.pack_hook = rounded

    p.setattr(activations.ActivationOffload, "__init__", init)


FEATURE = Feature(
    name="offload_activations",
    doc="P_a+cpu on one rank: activation checkpoints kept in host memory",
    config=lambda value: {"offload_activations": True},
    needs=lambda c: (
        "" if c.checkpointing and c.offload
        else "checkpoints go to the host beside offloaded states; add 'checkpointing' and "
        "'offload'"
    ),
    pairs=(
        Pair("checkpointing × offload", "checkpoints kept in host memory (P_a+cpu's path on one "
             "rank)", "cells", lambda c: c.checkpointing and c.offload),
    ),
    bugs=(
        # fp32 and fp16 checkpoints change when rounded to bf16: the recomputed loss differs
        Bug(name="offloaded_checkpoints_rounded",
            breaks="offloaded activation checkpoints kept in bf16",
            where="deterministic, checkpointing + offload, fp32/fp16",
            plant=plant_offloaded_checkpoints_rounded, check="reported",
            observable=lambda c: (
                c.mode == "deterministic" and c.offload_activations and c.precision != "bf16"
            )),
    ),
)  # fmt: skip
