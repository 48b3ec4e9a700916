"""Dropout in the model: each micro-batch's forward draws its masks from (dropout_seed, data step,
j) ([Note: seeded forward] in zero/hooks.py), so that N ranks draw what one process running the
M micro-batches in order would."""

from __future__ import annotations

from .record import Bug, Feature, Pair


def gpt_with_dropout(device=None):
    """verify.cells.cell's GPT with dropout 0.1 in attention, residuals and embeddings."""
    from zero.workloads.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    return GPT(cfg, device=device)


def plant_dropout_mask_per_micro_step(p) -> None:
    """Dropout seeded by the micro-step alone, not the micro-batch index j = k·N + r: every rank
    draws the same masks. At N = 1 the two are one number, so only dropout × N >= 2 shows it."""
    import torch.distributed as dist

    from zero import engine as engine_module

    real = engine_module.forward_rng

    def forward_rng(seed, data_step, j, device):
        return real(seed, data_step, j // dist.get_world_size(), device)

    p.setattr(engine_module, "forward_rng", forward_rng)


FEATURE = Feature(
    name="dropout",
    doc="dropout 0.1 in the GPT, masks seeded per micro-batch",
    config=lambda value: {},  # the engine's default dropout_seed; the model carries the rate
    models={"gpt": gpt_with_dropout},
    # at N = 2 and N = 4 (M > N: micro-steps draw different masks), stages 1 and 3
    quick=(
        dict(stage=1, precision="fp32", optimizer="adamw", model="gpt", features=("dropout",),
             seed=6300),
        dict(stage=3, precision="bf16", optimizer="adam", model="gpt", features=("dropout",),
             world_size=4, accumulation=1, steps=2, seed=6301),
    ),
    pairs=(
        Pair("dropout × N >= 2", "masks drawn per micro-batch from (seed, data step, j), not "
             "rank", "cells", lambda c: c.dropout and c.world_size >= 2),
        Pair("dropout × stage 3", "masks drawn while units are gathered and freed",
             "cells", lambda c: c.dropout and c.stage == 3),
    ),
    bugs=(
        # every rank draws the same masks: the losses of the first step differ
        Bug(name="dropout_mask_per_micro_step",
            breaks="dropout seeded by micro-step, not j = k·N + r",
            where="dropout × N ≥ 2 (interactions)", plant=plant_dropout_mask_per_micro_step,
            observable=lambda c: c.dropout and c.world_size >= 2, check="reported"),
    ),
)  # fmt: skip
