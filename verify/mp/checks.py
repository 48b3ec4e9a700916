"""The checks of one rank of a model-parallel cell, against verify/checks/expect.py (the module
docstring of verify/mp/cells.py lists them): after each step, the engine's state bit for bit
(state_check) and the counted traffic (traffic_check: kinds "model", "mp", the MP control
all-gather, the host copies; read through Without, which leaves out the checks' own gathers);
after the last step, the M_D arena (arena_check) and memory_report() (memory_check). Each
returns '' or the first difference.
"""

from __future__ import annotations

import math

import numpy as np

from ..checks import expect as E
from .plan import BATCH, M, MPCell


def state_check(step: int, eng, spec, want) -> str:
    """'' if the engine's master and optimizer states (gather_state: a collective, so every
    rank calls it) are the reference's slice `want`, bit for bit; else the first difference."""
    master, opt = eng.gather_state()
    for n in spec.names:
        ours = [("master", master[n])] + [(key, opt[n][key]) for key in sorted(want.opt[n])]
        for key, got in ours:
            ref = want.master[n] if key == "master" else want.opt[n][key]
            if not np.array_equal(got.numpy().view(np.uint32), ref.view(np.uint32)):
                return f"step {step}: {key} of {n!r} differs from reference/mp.py"
    return ""


def activation(cfg, mp: int, p_a: bool) -> int:
    """Elements of a block's activation X = b·s·h, or of its part ⌈X/N_m⌉ under P_a."""
    x = BATCH * cfg.block_size * cfg.n_embd
    return math.ceil(x / mp) if p_a else x


def traffic_check(cell: MPCell, cfg, zcfg, spec, d: int, counter, step: int, skipped) -> str:
    """'' if the step's counted traffic is the expected (the module docstring: kind "model" of
    the slice in the DP group, kind "mp", the MP control all-gather, the host copies); else the
    first difference."""
    k, blocks, mp, p_a = M // cell.dp, cfg.n_layer, cell.mp, cell.p_a != "off"
    ckpt = blocks if zcfg.activation_checkpointing else 0
    want_mp = E.expected_mp_traffic(cfg, BATCH, mp, k, checkpointed=ckpt, p_a=p_a)
    got_mp = sorted((r.op, r.phase, r.elements) for r in counter.of_step(step, "mp"))
    control = [(r.op, r.elements) for r in counter.of_step(step, "control") if r.phase == "mp_step"]
    moved = sorted((r.phase, r.elements) for r in counter.of_step(step, "offload"))
    x_part = activation(cfg, mp, p_a=True)
    want_moved = sorted(
        ([("p_a_down", x_part), ("p_a_up", x_part)] * blocks * k if cell.p_a == "cpu" else [])
        + E.expected_offload_copies(zcfg, spec, cell.dp, skipped=skipped)
    )
    checks = (
        E.first_difference(
            "traffic", E.traffic_of_step(counter, step),
            E.expected_traffic(zcfg, spec, cell.dp, d, forward=True, skipped=skipped),
        ),
        "" if got_mp == want_mp else f"mp traffic: engine {got_mp}, expected {want_mp}",
        "" if control == [("all_gather", (mp - 1) * (2 + len(spec.names)))]
        else f"mp control {control}",
        "" if moved == want_moved else f"host copies: {moved}, expected {want_moved}",
    )  # fmt: skip
    return next((f"step {step}: {w}" for w in checks if w), "")


def arena_check(cell: MPCell, eng, cfg) -> str:
    """'' if the M_D arena (if any) holds one slot per block of ⌈X/N_m⌉ (P_a) or X elements and
    was never missed; else what it holds."""
    arena, blocks = eng.activation_arena, cfg.n_layer
    if arena is None:
        return ""
    size = E.arena_span(activation(cfg, cell.mp, cell.p_a != "off"), cell.precision)
    if (arena.nbytes, arena.misses) == (blocks * size, 0):
        return ""
    return f"checkpoint arena {arena.nbytes} B ({arena.misses} misses), want {blocks * size}"


def memory_check(eng, zcfg, spec, dp: int) -> str:
    """'' if memory_report() is verify.checks.expect.expected_memory for the slice (buffers for the
    collectives aside); else both."""
    got = {k: v for k, v in eng.memory_report().items() if k != "comm_buffers"}
    want = E.expected_memory(zcfg, spec, dp)
    return "" if {k: got.get(k) for k in want} == want else f"memory_report {got}, expected {want}"


class Without:
    """The engine's counter without the records of the checks' own gathers (gather_state and
    state_digest after a step are collectives at stage 3, counted in the next step): what
    traffic_of_step reads of it."""

    def __init__(self, counter, reads: set[int]):
        self.counter, self.reads = counter, reads

    def of_step(self, step: int, kind: str = "model"):
        return [r for r in self.counter.of_step(step, kind) if id(r) not in self.reads]
