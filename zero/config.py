"""The engine's configuration: one keyword-only dataclass, validated on construction.

Legend: N data-parallel world size, M micro-batches per step (over all ranks, so each rank runs M/N
per step), S loss scale, Ψ parameters. The numerical meaning of every field is the reference's
(reference/step.py); `step_config(N)` gives the reference configuration this engine must reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from reference.layout import ALIGN
from reference.optim import Hyper
from reference.precision import ScalerConfig
from reference.step import StepConfig

from .ranks.nodes import check_ranks_per_node

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STAGES = (0, 1, 2, 3)
WATCHDOG_MODES = ("calls", "collectives", "off")
MAX_CHUNK = 2**24
"""The largest clipping chunk: 16 Mi elements, 64 MiB of fp32 per chunk. A unit is padded to
whole chunks on every rank, so a chunk far above any unit only wastes memory (2**40 would ask
for 4 TiB)."""


def decay_matrices_only(name: str, param: torch.Tensor) -> int:
    """A common grouping: group 0 (weight decay) for matrices, group 1 for biases and norms."""
    del name
    return 0 if param.ndim >= 2 else 1


def check_nodes(config: ZeroConfig) -> None:
    """The node fields: ranks_per_node (zero/ranks/nodes.py), and hpz, a bool, at stage 3."""
    check_ranks_per_node(config.ranks_per_node)
    if not isinstance(config.hpz, bool):
        raise ValueError(f"hpz={config.hpz!r}: must be True or False")
    if config.hpz and config.stage != 3:
        raise ValueError(
            "hpz=True: hpZ partitions stage 3's gathered parameters inside each node; "
            f"allowed with stage=3 (stage={config.stage} given)"
        )
    g = config.shard_group_size
    if g is not None:
        if type(g) is not int or g < 1:
            raise ValueError(f"shard_group_size={g!r}: must be None or an integer >= 1")
        if config.stage == 0:
            raise ValueError(
                f"shard_group_size={g}: hierarchical sharding shards inside groups of G ranks; "
                "stage 0 shards nothing; allowed with stage=1, 2 or 3"
            )
        if config.deterministic and g & (g - 1):
            raise ValueError(
                f"shard_group_size={g}: deterministic mode keeps the reference's sum over the "
                "N ranks, which splits into sums over groups only for a power-of-two G "
                "([Note: the tree T], reference/tree.py); allowed: 1, 2, 4, 8, ..., or "
                "deterministic=False"
            )
        if config.hpz:
            raise ValueError(
                f"shard_group_size={g} with hpz=True: hpZ's node parts over a sharded group "
                "are not built; allowed is one of the two"
            )
    check_quantized(config)


def check_quantized(config: ZeroConfig) -> None:
    """ZeRO++'s quantized collectives (reference/quantize.py): qwz_bits, qgz_bits, quant_block."""
    from reference.quantize import QMAX

    for name in ("qwz_bits", "qgz_bits"):
        bits = getattr(config, name)
        if bits is None:
            continue
        if type(bits) is not int or bits not in QMAX:
            raise ValueError(f"{name}={bits!r}: allowed are None (off) and {tuple(QMAX)}")
        if config.stage != 3:
            raise ValueError(
                f"{name}={bits}: ZeRO++ quantizes stage 3's collectives; allowed with stage=3 "
                f"(stage={config.stage} given)"
            )
        if config.shard_group_size is not None:
            raise ValueError(
                f"{name}={bits} with shard_group_size={config.shard_group_size}: quantized "
                "collectives over a sharded group are not built; allowed is one of the two"
            )
    if config.qgz_bits is not None and config.bucket_elements is not None:
        raise ValueError(
            f"qgz_bits={config.qgz_bits} with bucket_elements={config.bucket_elements}: qgZ "
            "quantizes each unit's whole gradient buffer; its reduction in C_B pieces is not "
            "built; allowed is bucket_elements=None"
        )
    b = config.quant_block
    if type(b) is not int or b < 1:
        raise ValueError(f"quant_block={b!r}: must be an integer >= 1")
    if (config.qwz_bits, config.qgz_bits) != (None, None) and config.chunk % b:
        raise ValueError(
            f"quant_block={b!r}: a block must divide every unit's shard, whose length is a "
            f"multiple of chunk={config.chunk}; allowed are the divisors of {config.chunk} "
            "(powers of two)"
        )
    if config.qgz_bits is not None and (config.reduce_dtype or "fp32") != "fp32":
        raise ValueError(
            f"qgz_bits={config.qgz_bits} with reduce_dtype={config.reduce_dtype!r}: qgZ carries "
            "a float32 scale per block and sums the dequantized values in float32, which the "
            f"{config.reduce_dtype} gradients cannot hold; allowed is reduce_dtype None or 'fp32'"
        )


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How to train: the ZeRO stage, the numerics of a step, and the engine's structure."""

    stage: int = 0
    """0 baseline DP; 1 P_os (optimizer states partitioned); 2 P_os+g (+ gradients);
    3 P_os+g+p (+ working parameters, gathered per unit around its forward and backward)."""
    precision: str = "fp32"
    """Compute dtype of the working copy and of the gradients: 'fp32', 'bf16' or 'fp16'."""
    reduce_dtype: str | None = None
    """Dtype gradients are summed in: 'fp32' (None means fp32) or the compute dtype (the paper's
    configuration, which halves gradient memory and traffic in mixed precision)."""
    deterministic: bool = True
    """True: the reference's reduction tree, every micro-step (bitwise equal to reference/).
    False: the backend's reduce-scatter/all-reduce, local accumulation where the stage allows it,
    torch's optimizer kernels (within derived bounds, verify/checks/bounds.py)."""
    optimizer: str = "adamw"
    """'sgd', 'adam' or 'adamw'."""
    groups: tuple[Hyper, ...] = (Hyper(),)
    """Hyper-parameters of each parameter group."""
    group_of: Callable[[str, torch.Tensor], int] | None = None
    """Maps (parameter name, parameter) to a group index; None puts everything in group 0."""
    micro_batches: int = 1
    """M: micro-batches per step over all ranks; a positive multiple of the world size."""
    clip_norm: float | None = None
    """Clip the global gradient L2 norm to this value; None disables clipping."""
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    """Dynamic loss scaling, used with precision='fp16'."""
    nonfinite: str = "raise"
    """fp32/bf16: 'raise' FloatingPointError on a non-finite gradient, or 'skip' the step."""
    units: tuple[str, ...] | str = ()
    """Qualified names of the submodules that are units (e.g. each transformer block); all
    other parameters, and any parameter shared between units, form the root unit. A unit must
    be a module that is called in forward and may not contain another unit (docs/models.md).
    "auto": the repeated blocks zero.build.auto(model) finds."""
    overlap: bool = True
    """Run collectives asynchronously: each unit's reduction overlaps the rest of backward, and
    stage 3 prefetches the next unit's parameters. Off: the same collectives, in the same order,
    each completed before compute goes on (the bits are the same either way)."""
    persist_below: int = 0
    """Stage 3: units of at most this many parameters stay whole on every rank, as at stage 0
    (no all-gathers; their gradients cost 2Ψ_unit per step, their master and states are
    replicated). Worth it for units so small that a gather costs more in latency than in bytes."""
    chunk: int = 4096
    """Clipping-chunk size C in elements (a power of two in [128, 2**24]); shards are multiples
    of it."""
    activation_checkpointing: bool = False
    """ZeRO-R (paper §6.1): run every unit's forward (the root's excepted) under
    torch.utils.checkpoint (non-reentrant), so that backward keeps only each unit's inputs and
    recomputes the rest. Bits unchanged; at stage 3 the recomputation finds its unit gathered by
    the backward gather it already has ([Note: recomputation at stage 3] in
    zero/zero_r/activations.py)."""
    offload_activations: bool = False
    """ZeRO-R's P_a+cpu applied to data parallelism: the checkpointed unit inputs are kept in
    host memory (pinned on CUDA) and brought back for recomputation. Needs
    activation_checkpointing; on a CPU-only machine only the accounting changes."""
    partition_activations: bool = False
    """ZeRO-R's P_a (paper §6.1), with model parallelism (ZeroEngine(mp=...)): each checkpointed
    unit input, replicated over the MP group, is kept as this MP rank's 1/N_m and all-gathered
    before the recomputation (zero/mp/partitioned.py); with offload_activations the part is kept
    in host memory (P_a+cpu). Bits unchanged. Needs activation_checkpointing."""
    offload_optimizer: bool = False
    """ZeRO-Offload: the fp32 master, the optimizer states and (stages 2-3) the reduced gradient
    shard live in host memory (pinned on CUDA) and the optimizer runs on the CPU; gradients go
    down and the updated working parameters come back up in the compute dtype
    (zero/zero_r/offload.py). Bits unchanged; host<->device bytes are counted as kind='offload'."""
    offload_dir: str | None = None
    """ZeRO-Infinity's disk tier, with offload_optimizer: an existing directory in which the fp32
    master and the optimizer states live in files (one per unit and state, memory-mapped), read
    and written back unit by unit around its update, so that host memory holds a few units'
    states, not all (zero/zero_r/disk.py). Bits unchanged; disk bytes are counted as kind='disk'.
    None: the states live in host memory."""
    bucket_elements: int | None = None
    """ZeRO-R's constant-size buffers C_B: the most elements any fused reduction buffer holds. A
    unit's gradient reduce-scatter is then done in pieces of at most this many elements (the
    tree sum is elementwise, so the pieces give the same bits). None: one piece per unit.
    Must be at least the world size (every rank gets at least one element per piece)."""
    contiguous_memory: bool = False
    """ZeRO-R's M_D (paper §6.3): every unit's resident gradient buffer is a view into one
    gradient arena allocated at construction (with offload_optimizer, the host gradient
    buffers come from one host arena), and with activation_checkpointing the checkpointed unit
    inputs are copied into one checkpoint arena reused across micro-steps (the host one with
    offload_activations). Long-lived buffers then stop cutting the allocator's free memory into
    pieces between short-lived activations ([Note: contiguous memory] in zero/zero_r/contiguous.py).
    Bits unchanged (the copies are exact); `python -m measure.fragmentation` measures it on a
    GPU."""
    release_grads: bool | None = None
    """Whether each unit's gradient buffer lives only within a step ([Note: gradients live
    within a step] in zero/unit.py): allocated at its first use in a step's backward and
    released after the update, as zero_grad(set_to_none=True) releases .grad. The steady-state
    peak per rank falls by the buffer (Ψ·reduction bytes at stages 0-1, Ψ/N at 2-3). None: on
    CUDA, whose caching allocator hands the same blocks back at no cost; not on a CPU, where
    glibc gives large freed blocks back to the kernel and they return through page faults every
    step, unless the process keeps them (measure.resident.keep_freed_blocks; docs/design.md §3,
    "Gradients live within a step, where asked", has the measured costs). Never for
    contiguous_memory's arena views or offload_optimizer's host shards, whose long life is their
    point. Bits unchanged."""

    broadcast_buffers: bool = True
    """Before every forward, rank 0's buffers (BatchNorm's running statistics, ...) are
    broadcast to every rank, as DDP(broadcast_buffers=True) does, so that ranks keep one model
    and checkpoints hold what every rank uses. Counted as control traffic (phase "buffers").
    False: each rank keeps its own buffers (they drift apart; checkpoints keep rank 0's)."""
    dropout_seed: int | None = 0
    """Each micro-batch's forward runs with torch's RNG seeded from (dropout_seed, data step,
    micro-batch index j) and restored afterwards (zero/hooks.py), so dropout (any draw inside
    forward) is the same at every world size, rank and stage, as docs/design.md §2 asks. None:
    forward draws from the process's own RNG stream, which differs per rank."""
    watchdog: str = "calls"
    """How closely ranks check that they issue the same collectives ([Note: collective
    fingerprints], zero/ranks/watchdog.py). 'calls': once per micro-step (at its forward) and before
    each step, save and load, the ranks all-gather five integers (the call, the data step and
    micro-step, the count and a hash of every collective so far), so a rank making another
    call, or having issued other collectives, is named at once instead of hanging or aborting a
    peer. 'collectives': the same before every collective as well (for finding a divergence
    inside a call, such as a unit run on one rank only). 'off': no checks; heartbeats still
    name a stopped or dead rank when a collective fails."""
    ranks_per_node: int | None = None
    """R: ranks on each node, the world being node-major (rank r on node r // R); traffic is
    split by link with it ([Note: traffic per link], zero/common/traffic.py). None: under
    torchrun the launcher's LOCAL_WORLD_SIZE, else every rank on one node. A value simulates
    nodes on one machine (2 x 2: ranks_per_node=2 at N = 4); it must divide the world size, and
    under torchrun equal LOCAL_WORLD_SIZE (zero/ranks/nodes.py)."""
    hpz: bool = False
    """ZeRO++'s hpZ, stage 3 only: each rank also keeps a secondary partition of the
    compute-dtype parameters inside its node (1/R of every sharded unit, copied from the
    forward's all-gather), and the backward all-gather gathers those R parts over the node's
    group instead of the N shards over the world: no backward parameter traffic crosses nodes.
    Bits unchanged (zero/stages/hpz.py). With one node (ranks_per_node None or N) the node's
    group is the world: the same traffic, only the parts' memory added. Needs the engine's group
    to be the whole world (refused with model parallelism)."""
    shard_group_size: int | None = None
    """G: hierarchical sharding (FSDP2's HSDP, DeepSpeed's MiCS), stages 1-3. The model states
    are sharded inside groups of G consecutive ranks and replicated across the N/G groups;
    gradients are reduce-scattered inside the group and all-reduced across groups. It must
    divide N; in deterministic mode it must be a power of two, so that the sum over groups of
    the sums inside them is the reference's tree over the N ranks, bit for bit. None: one group
    of N (plain ZeRO)."""
    qwz_bits: int | None = None
    """ZeRO++'s qwZ, stage 3 only: every parameter all-gather for forward and backward sends
    each rank's shard block-quantized (quant_block elements per float32 scale, 8 or 4 bits
    per value; reference/quantize.py), and the unit computes with the dequantized values, cast
    to the compute dtype. Both passes see the same values (a backward from hpZ's parts copies
    the forward's). Not bitwise plain ZeRO: bitwise the reference with those weights. Like hpZ
    and qgZ, refused where the engine's group is not the whole world. None: off."""
    qgz_bits: int | None = None
    """ZeRO++'s qgZ, stage 3 only: each micro-step's gradient reduce-scatter becomes two
    all-to-alls of block-quantized gradients, inside the node and then across nodes, each
    followed by a float32 tree sum of the dequantized values (reference/quantize.py,
    qgz_sum); the same in both modes. 8 or 4 bits per value (ZeRO++ uses 4). None: off."""
    quant_block: int = 256
    """Elements per float32 scale for qwZ and qgZ: a divisor of `chunk`, so of every shard."""

    def __post_init__(self):
        if type(self.stage) is not int or self.stage not in STAGES:  # 2.0 == 2 and True == 1
            raise ValueError(f"stage={self.stage!r}: allowed are the integers {STAGES}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic={self.deterministic!r}: must be True or False")
        if self.watchdog not in WATCHDOG_MODES:
            raise ValueError(f"watchdog={self.watchdog!r}: allowed are {WATCHDOG_MODES}")
        for name, low in (("persist_below", 0), ("micro_batches", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}={v!r}: must be an integer >= {low}")
        c = self.chunk
        if (
            isinstance(c, bool)
            or not isinstance(c, int)
            or not ALIGN <= c <= MAX_CHUNK
            or c & (c - 1)
        ):
            raise ValueError(
                f"chunk={c!r}: must be a power of two in [{ALIGN}, 2**{MAX_CHUNK.bit_length() - 1}]"
            )
        for name in ("stage", "precision", "optimizer", "nonfinite"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: not a boolean")
        if self.group_of is not None and not callable(self.group_of):
            raise ValueError(f"group_of={self.group_of!r}: must be None or a callable")
        for name in (
            "overlap",
            "activation_checkpointing",
            "offload_activations",
            "partition_activations",
            "offload_optimizer",
            "contiguous_memory",
            "broadcast_buffers",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.release_grads is not None and not isinstance(self.release_grads, bool):
            raise ValueError(
                f"release_grads={self.release_grads!r}: must be None (by device), True or False"
            )
        check_nodes(self)
        seed = self.dropout_seed
        if seed is not None and (type(seed) is not int or seed < 0):  # not a bool, not 1.0
            raise ValueError(f"dropout_seed={seed!r}: must be None or an integer >= 0")
        if self.offload_dir is not None:  # the disk tier's own checks (zero/zero_r/disk.py)
            from .zero_r.disk import check_offload_dir

            check_offload_dir(self.offload_dir, self.offload_optimizer)
        if self.partition_activations and not self.activation_checkpointing:
            raise ValueError(
                "partition_activations=True: P_a partitions the checkpointed unit inputs; "
                "allowed with activation_checkpointing=True"
            )
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                "offload_activations=True: only checkpointed unit inputs are offloaded; "
                "allowed with activation_checkpointing=True"
            )
        if self.bucket_elements is not None and (
            isinstance(self.bucket_elements, bool)
            or not isinstance(self.bucket_elements, int)
            or self.bucket_elements < 1
        ):
            raise ValueError(
                f"bucket_elements={self.bucket_elements!r}: must be None or an integer >= 1"
            )
        if isinstance(self.units, str):
            if self.units != "auto":
                raise ValueError(
                    f"units={self.units!r}: a tuple of submodule names, or 'auto' "
                    "(zero.build.auto(model))"
                )
        elif not isinstance(self.units, tuple) or not all(isinstance(u, str) for u in self.units):
            raise ValueError(f"units={self.units!r}: allowed are a tuple of names (str), or 'auto'")
        elif len(set(self.units)) != len(self.units) or "" in self.units:
            raise ValueError(f"units={self.units!r}: names must be distinct and non-empty")
        if not isinstance(self.groups, tuple):  # a frozen config holds tuples (StepConfig: lists)
            raise ValueError(f"groups={self.groups!r}: allowed is a tuple of reference.optim.Hyper")
        self.step_config(1)  # the reference validates the numerical fields

    def step_config(self, world_size: int) -> StepConfig:
        """The reference configuration of one step of this engine at world size N."""
        same = "optimizer groups precision reduce_dtype micro_batches clip_norm scaler nonfinite"
        return StepConfig(world_size=world_size, **{k: getattr(self, k) for k in same.split()})

    def releases_grads(self, device: torch.device) -> bool:
        """release_grads as it applies on `device` (None: on CUDA only)."""
        return device.type == "cuda" if self.release_grads is None else self.release_grads

    @property
    def compute_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.precision]

    @property
    def grad_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.reduce_dtype or "fp32"]
