"""What a cell must hold and copy, from the model and the config alone (verify/checks/expect.py's
memory half): engine.memory_report()'s categories per unit by
zero.common.memory.model_state_breakdown plus the offload buffers (zero/zero_r/offload.py's
documented ones), the host copies of offload_optimizer, and which gradient buffers
release_grads lets go between steps.
"""

from __future__ import annotations

import dataclasses

from reference.optim import state_names
from zero.common.memory import model_state_breakdown

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def persistent(config, lay) -> bool:
    """Stage 3 keeps units of at most persist_below parameters whole (docs/design.md §3)."""
    return config.stage == 3 and lay.numel <= config.persist_below


def optimizer_states(config) -> int:
    """State arrays per parameter: the most any group needs (a unit's states cover it whole)."""
    return max(len(state_names(config.optimizer, hp)) for hp in config.groups)


def expected_offload_copies(config, spec, n: int, *, skipped: bool) -> list[tuple[str, int]]:
    """offload_optimizer's counted host copies of one deterministic step, sorted (phase,
    elements): per unit, its master's extent (the padded unit at stage 0 and for stage 3's
    persistent units, shard L_u otherwise) down once ("grad_down", the reduced gradient the
    host optimizer reads) and, unless the step is skipped, up once ("param_up", the updated
    master rounded to the compute dtype). Fast mode's running sum adds a download per
    micro-step, not modelled here."""
    if not config.offload_optimizer:
        return []
    out = []
    for lay in spec.layouts:
        stage = 0 if persistent(config, lay) else config.stage
        extent = lay.padded_numel(n) if stage == 0 else lay.shard_numel(n)
        out += [("grad_down", extent)] + ([] if skipped else [("param_up", extent)])
    return sorted(out)


def arena_span(numel: int, precision: str, align: int = 256) -> int:
    """Bytes one checkpoint of numel elements takes in a CheckpointArena: its bytes rounded up
    to the arenas' 256-byte alignment (docs/design.md §2's layout alignment)."""
    return -(-numel * DTYPE_BYTES[precision] // align) * align


def expected_memory(config, spec, n: int, frozen=()) -> dict[str, int]:
    """engine.memory_report()'s model-state categories (comm_buffers, which depend on what is
    in flight, are not modelled): per unit, zero.common.memory.model_state_breakdown at the unit's
    stage (stage 0 for stage 3's persistent units) over its padded numel; pure fp32 has no
    separate master (it is a view of the working copy). offload_optimizer adds a host buffer
    for the gradient extent the update reads (stages 0-1: the master's extent, beside the
    device buffer; stages 2-3: the reduced shard itself moves to the host, and fast mode keeps
    its running sum on the device too) and, in mixed precision, two upload staging buffers of
    the largest extent in the compute dtype (the ring zero/zero_r/offload.py reuses). frozen
    (frozen_layouts(...)) adds the category "frozen": each padded buffer in the compute dtype,
    /N at stage 3 (not persistent). hpz (stage 3) adds the category "hpz": every sharded unit
    but the root (unit 0, never gathered for backward) keeps a secondary part of its padded
    numel / R in the compute dtype, R the config's ranks_per_node (None: N)."""
    g = getattr(config, "shard_group_size", None)
    if g is not None and g != n:  # HSDP: the states of a world of G, k = M/N micro-steps each
        group = dataclasses.replace(
            config, shard_group_size=None, micro_batches=config.micro_batches // n * g
        )
        return expected_memory(group, spec, g, frozen)  # (verify/checks/expect_hsdp.py)
    cb = DTYPE_BYTES[config.precision]
    gb = DTYPE_BYTES[config.reduce_dtype or "fp32"]
    fp32 = config.precision == "fp32"
    k, det, offload = config.micro_batches // n, config.deterministic, config.offload_optimizer
    total = {"params": 0, "grads": 0, "master": 0, "optimizer": 0}
    staging = 0
    for lay in spec.layouts:
        stage = 0 if persistent(config, lay) else config.stage
        padded = lay.padded_numel(n)
        b = model_state_breakdown(
            num_params=lay.numel,
            padding=padded - lay.numel,
            world_size=n,
            stage=stage,
            param_bytes=cb,
            grad_bytes=gb,
            master_bytes=4 if offload or not fp32 else 0,
            optimizer_states=optimizer_states(config),
            state_bytes=4,
            accumulation=k,
            deterministic=det,
        )
        for key in total:
            total[key] += int(getattr(b, key))
        extent = padded if stage == 0 else lay.shard_numel(n)
        if offload:
            if stage <= 1:
                total["grads"] += extent * gb
            elif det is False:
                total["grads"] += extent * gb
            staging = max(staging, 0 if fp32 else extent * cb)
    if offload and not fp32:  # two slots of the largest extent (bounded upload staging)
        total["staging"] = 2 * staging
    if getattr(config, "hpz", False):
        per_node = config.ranks_per_node or n
        total["hpz"] = sum(
            lay.padded_numel(n) // per_node * cb
            for i, lay in enumerate(spec.layouts)
            if i > 0 and not persistent(config, lay)
        )
    if frozen:
        total["frozen"] = sum(
            int(
                model_state_breakdown(
                    num_params=0,
                    world_size=n,
                    stage=0 if persistent(config, lay) else config.stage,
                    param_bytes=cb,
                    frozen_params=lay.numel,
                    frozen_padding=lay.padded_numel(n) - lay.numel,
                ).frozen
            )
            for _, lay in frozen
        )
    return total


def expected_released(config, spec, device_type: str) -> list[bool]:
    """Per unit (spec's order), whether its gradient buffer is released between steps, from
    the config alone (ZeroConfig.release_grads' contract): where release_grads is True (None: on
    CUDA only), except the arena views of contiguous_memory and the host shards that
    offload_optimizer reduces into (stages 2-3; stage 3's persistent units are stage 0's)."""
    release = config.release_grads
    if release is None:
        release = device_type == "cuda"
    out = []
    for lay in spec.layouts:
        stage = 0 if persistent(config, lay) else config.stage
        host_shard = config.offload_optimizer and stage >= 2
        out.append(bool(release) and not config.contiguous_memory and not host_shard)
    return out
