"""Checkpoints in torch.distributed.checkpoint's format (zero/checkpoint/dcp.py): the resume rows
that save with save_dcp and load with load_dcp at another N and stage, and whose saved state is
read back the way plain PyTorch reads it (dcp.load into torch.distributed.checkpoint.state_dict's
flattened dicts, then set_state_dict on an unwrapped model and torch.optim), never through the
engine's own loader. A cell does not checkpoint: only resume rows take it."""

from __future__ import annotations

import warnings
from pathlib import Path

from .record import Bug, Feature, Pair


class DcpCheckpoints:
    """A resume row's checkpoint format (Feature.checkpoint): where it lives under the row's
    directory, how the engine writes and reads it, and the consolidated dict plain PyTorch
    makes of it (the shape zero.checkpoint.consolidate returns, so one check reads both)."""

    folder = "dcp"

    def save(self, engine, directory) -> None:
        from zero.checkpoint import save_dcp

        save_dcp(engine, Path(directory) / self.folder)

    def load(self, engine, directory) -> None:
        from zero.checkpoint import load_dcp

        load_dcp(engine, Path(directory) / self.folder)

    def consolidated(self, case, directory) -> dict:
        """{model, optimizer, param_names, meta} read in this process as plain PyTorch reads
        the folder: an unwrapped model of the case and torch.optim in the engine's two groups
        (matrices decayed, then biases and norms, each in named_parameters() order)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        from zero.checkpoint.dcp_plan import EXTRA_KEY
        from zero.optim.plain import torch_optimizer

        model = case.make_model()
        cfg = case.engine_config(case.s2, model.unit_names())
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        names = [[k for k, p in named if cfg.group_of(k, p) == g] for g in range(len(cfg.groups))]
        params = dict(named)
        opt = torch_optimizer(
            case.optimizer, [([params[k] for k in g], hp) for g, hp in zip(names, cfg.groups)],
            foreach=False,
        )  # fmt: skip
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd = get_state_dict(model, opt, options=flat)
        every = {**msd, **osd, EXTRA_KEY: {}}
        with warnings.catch_warnings():  # one process, no group: DCP says it assumes one
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(every, checkpoint_id=str(Path(directory) / self.folder))
        msd, osd = {k: every[k] for k in msd}, {k: every[k] for k in osd}
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=flat)
        extra = every[EXTRA_KEY]
        meta = {k: extra[k] for k in ("t", "data_step", "scaler")}
        return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "param_names": names, "meta": meta}  # fmt: skip


def plant_dcp_moments_swapped(p) -> None:
    """The engine writes each exp_avg under the key of exp_avg_sq and the other way round, and
    reads them back the same way: its own round trip is exact, so only a reader of the format
    as its conventions define it (plain PyTorch) can see it."""
    from zero.checkpoint import dcp_plan

    real = dcp_plan.keys_of
    other = {"exp_avg": "exp_avg_sq", "exp_avg_sq": "exp_avg"}

    def keys_of(engine, aliases):
        keys = real(engine, aliases)
        return lambda name, state: keys(name, other.get(state, state))

    p.setattr(dcp_plan, "keys_of", keys_of)


FEATURE = Feature(
    name="dcp",
    doc="checkpoints in torch.distributed.checkpoint's format (save_dcp, load_dcp)",
    config=lambda value: {},
    needs=lambda c: "a checkpoint format: only resume rows take it",
    checkpoint=DcpCheckpoints(),
    resume=(
        # resharded to more ranks and stage 3; to one rank and stage 0 with the loss scaler
        ({2, 4}, dict(n1=2, s1=1, n2=4, s2=3, precision="bf16", optimizer="adamw",
                      features=("dcp",))),
        ({1, 4}, dict(n1=4, s1=3, n2=1, s2=0, precision="fp16", optimizer="adam",
                      features=("dcp",))),
        # frozen units' chunks (sharded at stage 3, whole at stage 1)
        ({2, 4}, dict(n1=4, s1=3, n2=2, s2=1, precision="bf16", optimizer="adamw",
                      features=("frozen", "dcp"))),
    ),
    bugs=(
        Bug(name="dcp_moments_swapped", kind="resume", check="consolidation",
            breaks="DCP: exp_avg and exp_avg_sq written under each other's keys",
            where="DCP resume rows with Adam(W)", plant=plant_dcp_moments_swapped,
            observable=lambda case: "dcp" in case.features and case.optimizer != "sgd"),
    ),
    pairs=(
        Pair("DCP × frozen", "frozen units' chunks written and read beside the trainable ones",
             "resume", lambda r: "dcp" in r.features and "frozen" in r.features),
        Pair("DCP × resume", "saved as chunks of the parameters' shapes, read back by plain "
             "PyTorch and by the engine at another N and stage", "resume",
             lambda r: "dcp" in r.features),
    ),
)  # fmt: skip
