"""Frozen parameters (requires_grad=False, docs/design.md §2): a buffer of their own per unit,
gathered at stage 3 in forward and, as the layer before it trains, in backward; no gradient,
master or optimizer state; saved and resharded with the checkpoint."""

from __future__ import annotations

import torch

from .record import Bug, Feature, Pair


def frozen_mlp(device=None):
    """verify.cells.cell's MLP with its middle layer frozen."""
    from zero.workloads.models import MLP, MLPConfig

    model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3), device=device)
    model.layers[1].requires_grad_(False)
    return model


def plant_frozen_drift(p) -> None:
    """A stray update: one ULP on the first frozen element this rank holds, every step."""
    from zero.engine import ZeroEngine

    original = ZeroEngine.step

    def step(self):
        res = original(self)
        for u in self.frozen_units:
            resident, _ = self.working_extent(u)
            resident.view(torch.int16 if resident.element_size() == 2 else torch.int32)[0] += 1
        return res

    p.setattr(ZeroEngine, "step", step)


def plant_frozen_saved_from_start(p) -> None:
    """A frozen buffer held whole (stages 0-2) saved from its first L elements on every rank,
    not from the rank's own part. At stage 3 the resident part is the own one, and at N = 1 the
    two agree, so only frozen × a save at stages 0-2 with N >= 2 shows it."""
    from zero.checkpoint import commit

    real = commit._write_rank_files

    def write(engine, step_dir, pre):
        files = real(engine, step_dir, pre)
        for j, u in enumerate(engine.frozen_units):
            resident, _ = engine.working_extent(u)
            name = f"{pre}f{j:04d}-r{engine.rank:04d}.bin"
            own = resident[: u.part.own.stop - u.part.own.start]
            files[name] = commit._tensor_file(step_dir / name, [("frozen", own)])
        return files

    p.setattr(commit, "_write_rank_files", write)


FEATURE = Feature(
    name="frozen",
    doc="frozen parameters: the MLP's middle layer with requires_grad=False",
    config=lambda value: {},  # the model carries requires_grad=False
    models={"mlp": frozen_mlp},
    # at stage 3 (its own sharded buffer, gathered in forward and backward; built on the meta
    # device) and at stage 1 in fast mode
    quick=tuple(
        dict(stage=s, precision=p, optimizer="adamw", mode=mode, seed=6200 + s,
             features=("frozen",), meta=meta)
        for s, p, mode, meta in ((3, "bf16", "deterministic", True), (1, "fp32", "fast", False))
    ),
    resume=(
        # saved as held (bf16), resharded, consolidated upcast to fp32
        ({1, 2}, dict(n1=2, s1=3, n2=1, s2=0, precision="bf16", optimizer="adamw",
                      features=("frozen",))),
        # saved whole at stage 1 by rank 0, beside sharded masters
        ({2, 4}, dict(n1=2, s1=1, n2=4, s2=3, precision="fp32", optimizer="adam",
                      features=("frozen",))),
    ),
    branches={"frozen parameters (requires_grad=False)": lambda c: c.frozen},
    pairs=(
        Pair("frozen × stage 3", "frozen buffers sharded, gathered in forward and backward",
             "cells", lambda c: c.frozen and c.stage == 3),
        Pair("frozen × meta device", "frozen units materialised unit by unit",
             "cells", lambda c: c.frozen and c.meta),
        Pair("frozen × save at stage 1-2, N >= 2", "frozen buffers saved whole by rank 0, beside "
             "sharded masters", "resume",
             lambda r: "frozen" in r.features and r.s1 in (1, 2) and r.n1 >= 2),
        Pair("frozen × save at stage 3", "frozen shards saved by every rank, resharded on load",
             "resume", lambda r: "frozen" in r.features and r.s1 == 3),
    ),
    bugs=(
        # the frozen parameters are compared with the cast start values after the last step
        # (verify.checks.verdict.check_memory, a state check); in fast mode that is the only check
        # fine enough: the reported loss moves within its bound
        Bug(name="frozen_drift", breaks="a frozen parameter moves by one ULP per step",
            where="a model with frozen parameters", plant=plant_frozen_drift,
            observable=lambda c: c.frozen, check="state"),
        # the loaded values are compared with the saving run's
        Bug(name="frozen_saved_from_start", kind="resume",
            breaks="a whole frozen buffer saved from its start on every rank",
            where="frozen × a save at stage 0-2, N ≥ 2 (interactions)",
            plant=plant_frozen_saved_from_start, check="state",
            observable=lambda case: (
                "frozen" in case.features and case.s1 <= 2 and case.n1 >= 2
            )),
    ),
)  # fmt: skip
