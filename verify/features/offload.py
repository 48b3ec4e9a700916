"""ZeRO-Offload's optimizer offload (ZeroConfig.offload_optimizer): master weights, optimizer
states and the gradient shard in host memory, the update on the CPU (zero/zero_r/offload.py)."""

from __future__ import annotations

from .record import Bug, Feature, Pair


def plant_offload_grad_one_late(p) -> None:
    """The host gradient lags one copy: the optimizer updates with the previous step's."""
    from zero.zero_r.offload import HostOffload

    original = HostOffload.down
    last: dict = {}

    def down(self, u, dst, src):
        key = (id(self), dst.data_ptr())
        prev = last.get(key)
        last[key] = src.detach().clone()
        return original(self, u, dst, src if prev is None else prev)

    p.setattr(HostOffload, "down", down)


FEATURE = Feature(
    name="offload",
    doc="ZeRO-Offload: master, optimizer states and the gradient shard in host memory",
    config=lambda value: {"offload_optimizer": True},
    branches={
        "fast mode + optimizer offload": lambda c: c.mode == "fast" and c.offload,
        "fast mode + offload, stage >= 2 (host running sum)": lambda c: (
            c.mode == "fast" and c.offload and c.stage >= 2 and c.accumulation > 1
        ),
    },
    resume=(
        # saved from host memory, loaded into it
        ({1, 2}, dict(n1=2, s1=2, n2=1, s2=1, precision="bf16", optimizer="adam",
                      features=("offload",))),
    ),
    pairs=(
        Pair("offload × fast mode, stage 2-3", "the running sum of reduced shards on the host",
             "cells", lambda c: c.offload and c.mode == "fast" and c.stage >= 2),
        Pair("offload × resume", "master and states saved from host memory and loaded into it",
             "resume", lambda r: "offload" in r.features),
    ),
    bugs=(
        # the optimizer's host gradient lags one copy: from the second step on; the step's
        # reported norm is computed from the device's R, the update from the stale host copy,
        # so the loss of the next step is the first to differ
        Bug(name="offload_grad_one_late", breaks="offload: the host gradient is one copy behind",
            where="optimizer offload, two optimizer steps", plant=plant_offload_grad_one_late,
            observable=lambda c: c.offload and c.optimizer_steps >= 2, check="reported"),
    ),
)  # fmt: skip
