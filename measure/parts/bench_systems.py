"""measure.bench's systems: their names (ours, the peers, the model-parallel ones), which ZeRO
stage's states each partitions (SHARDING_LEVEL) and those states' analytic bytes per rank, and the
key a record is found by (system, N, group). Re-exported by measure.bench_table.
"""

from __future__ import annotations

from zero.common.memory import model_state_breakdown

OURS = (
    "zero-s0",
    "zero-s1",
    "zero-s2",
    "zero-s3",
    "zero-s0-det",
    "zero-s1-det",
    "zero-s2-det",
    "zero-s3-det",
)
PEERS = (
    "ddp",
    "zero-redundancy",
    "fsdp2",
    "fsdp2-reshard",
    "deepspeed-s1",
    "deepspeed-s2",
    "deepspeed-s3",
)
MP_DEGREES = (1, 2, 4)
"""N_m of the model-parallel systems ([Note: model-parallel systems] in measure/bench_mp.py)."""
MP_SYSTEMS = (
    "megatron-lm",
    "megatron-lm-det",
    *(f"zero-s{s}-mp{m}{mode}" for mode in ("", "-det") for s in range(4) for m in MP_DEGREES),
)
"""Tensor parallelism (zero/mp/): "megatron-lm" is MP alone (N_m = N, no ZeRO partitioning),
zero-s<stage>-mp<N_m> ZeRO inside the DP groups of N_d = N/N_m ranks; -det deterministic."""
DEFAULT_SYSTEMS = OURS + PEERS
"""What measure.bench times when --systems is left out: the data-parallel systems."""
SYSTEMS = OURS + PEERS + MP_SYSTEMS


def mp_layout(name: str) -> tuple[int, int | None, bool]:
    """(stage, N_m, deterministic) of an MP system; N_m None for megatron-lm (it is N)."""
    if name not in MP_SYSTEMS:
        raise ValueError(f"system={name!r}: allowed are {MP_SYSTEMS}")
    det = name.endswith("-det")
    if name.startswith("megatron-lm"):
        return 0, None, det
    return int(name[6]), int(name.removesuffix("-det").split("-mp")[1]), det


PEER_LABELS = {
    "zero-redundancy": "ZeRO-R",
    "fsdp2": "FSDP2",
    "fsdp2-reshard": "FSDP2-r",
    "deepspeed-s1": "DS-1",
    "deepspeed-s2": "DS-2",
    "deepspeed-s3": "DS-3",
}
"""Short column headings of the ×<peer> ratios."""


SHARDING_LEVEL = {
    **{name: int(name[6]) for name in OURS},
    "ddp": 0,
    "zero-redundancy": 1,
    "deepspeed-s1": 1,
    "deepspeed-s2": 2,
    "fsdp2": 3,
    "fsdp2-reshard": 3,
    "deepspeed-s3": 3,
    **{name: mp_layout(name)[0] for name in MP_SYSTEMS},
}
"""Which ZeRO stage's states each system partitions: what its memory is compared at. FSDP2
shards parameters at rest either way; without resharding it keeps them gathered from forward
to the end of backward, which its measured peak shows."""


def analytic_states_bytes(name: str, n: int, num_params: int, mp: int = 1) -> float:
    """zero/common/memory.py's model states per rank of `name`'s sharding level at N = n, in the
    benchmark's configuration: fp32 working parameters and gradients, no separate master (the
    working copy is it), AdamW's two fp32 states, M = N (no partial sums), no padding. With
    model parallelism num_params is the rank's slice (zero.mp.tp_num_params) and the states
    are partitioned over the DP group of n / mp ranks."""
    return model_state_breakdown(
        num_params=num_params,
        world_size=n // mp,
        stage=SHARDING_LEVEL[name],
        param_bytes=4,
        grad_bytes=4,
        master_bytes=0,
        optimizer_states=2,
        state_bytes=4,
        accumulation=1,
    ).total


def system_key(r: dict) -> tuple[str, int, str]:
    c = r["config"]
    return c["system"], c["world_size"], c.get("group", "")
