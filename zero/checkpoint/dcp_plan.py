"""The DCP checkpoint's layout: which keys and chunks a rank writes and reads, and the planners
that hand them to torch.distributed.checkpoint (used by zero/checkpoint/dcp.py).

Legend: N ranks, u a unit, L its shard length; a unit's padded flat buffer has N·L elements and
rank r owns [r·L, (r+1)·L) of it (zero/partition.py); "extent" a range of that buffer; a *key* an
entry of the checkpoint; a *box* a rectangular chunk of a tensor (an offset and a size per
dimension).

[Note: DCP keys] The keys are those of torch.distributed.checkpoint.state_dict, flattened as
get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)) gives
them (the form torchtitan saves): the model's state_dict() keys (each name of a tied parameter,
persistent buffers), fp32 (the master; a frozen parameter's held value upcast, which is exact);
"state.<fqn>.<exp_avg|exp_avg_sq|momentum_buffer>" of the parameter's shape, and for Adam and
AdamW "state.<fqn>.step", the parameter's own step count t_p as a 0-dim float32 tensor, as
torch.optim keeps it (<fqn>: the parameter's first name in named_parameters()); for SGD a
momentum buffer of a parameter never stepped is zeros. "param_groups.<fqn>.<key>" holds each key
of torch.optim's param_group for the parameter's group as this torch version writes it, and
EXTRA_KEY the engine's counters as plain Python values (t, data_step, the loss scaler, each t_p,
N and stage at save). Buffers are saved as rank 0 holds them (the compute dtype for floating
ones). No RNG state: randomness is a function of (seed, data step, micro-batch).

[Note: DCP boxes] A rank's part of a parameter is a contiguous range [a, b) of its flattened
elements. boxes() cuts it into rectangular chunks of the parameter's own shape (a partial first
row, the whole rows between, a partial last row, recursively along the later dimensions: at most
2·d − 1 for d dimensions); each is a contiguous run of [a, b), so a reshaped view of a flat
extent, and each is one DCP chunk of the full-shape tensor (zero/checkpoint/hfread.py reads a
flat range of a safetensors tensor as the same boxes). Custom planners, DCP's extension
point (DefaultSavePlanner and DefaultLoadPlanner subclassed), hand DCP these chunks; DCP's own
resharding (create_read_items_for_chunk_list) maps the saved chunks onto any requested ones.
DTensor's placements cut a dimension into even pieces and cannot describe such a range;
ShardedTensor could (several local shards per rank) but torch is deprecating it for DTensor.

[Note: DCP writes in place] A chunk is a view of a unit's flat buffer. DCP's file writer clones
a tensor whose storage is larger than the tensor itself, and keeps every tensor it wrote to a
file until that file is closed (torch 2.13), so handing it the views would copy the rank's whole
shard. The save planner hands it alone(view) instead: the same memory under a storage of exactly
the chunk's bytes, which it neither clones nor holds beyond memory that exists anyway. A frozen
parameter's values are upcast to fp32 first (save_chunks): those copies, the rank's shard of the
frozen parameters in fp32, are held for the save.
"""

from __future__ import annotations

import dataclasses
import io
import math

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from reference.optim import state_names

from .commit import _buffers, _state_dict_keys
from .consolidate import _torch_param_groups

EXTRA_KEY = "zero.train_state"
"""The engine's counters in a DCP checkpoint ([Note: DCP keys])."""
DCP_FORMAT, DCP_VERSION = "zero-dcp", 1

# -- boxes ---------------------------------------------------------------------------------------


def boxes(shape, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [lo, hi) of a tensor of `shape` (row-major) as rectangular boxes, in order:
    (offsets, sizes, first flat index) each ([Note: DCP boxes])."""
    shape = tuple(int(d) for d in shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])

    def row(i: int, a: int, b: int):  # [a, b) inside row i
        return [((i, *o), (1, *s), i * inner + f) for o, s, f in boxes(shape[1:], a, b)]

    out, a = [], lo
    if lo % inner:
        a = min(hi, (lo // inner + 1) * inner)
        out += row(lo // inner, lo % inner, a - (lo // inner) * inner)
    b = hi - hi % inner
    if a < b:
        out.append(((a // inner, *[0] * (len(shape) - 1)), ((b - a) // inner, *shape[1:]), a))
    if a <= b < hi:
        out += row(b // inner, 0, hi - b)
    return out


# -- what a rank holds, by key -------------------------------------------------------------------


def param_keys(engine) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(parameter's first name -> every state_dict key naming it, buffer key -> its key)."""
    aliases: dict[str, list[str]] = {}
    canonical = {}
    first = {id(p): k for k, p in engine.module.named_parameters()}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        canonical[name] = first[id(p)]
    buffers = {}
    for key, src in _state_dict_keys(engine.module, canonical):
        if src.startswith("buffer:"):
            buffers[key] = key
        else:
            aliases.setdefault(src, []).append(key)
    return aliases, buffers


def kept_states(engine, name: str) -> tuple[str, ...]:
    """The per-element states the optimizer keeps for parameter `name`."""
    cfg = engine.config
    return state_names(cfg.optimizer, cfg.groups[engine.group_index[name]])


@dataclasses.dataclass
class Chunk:
    """One box of one key that this rank writes or reads: `flat` is its values (save) or the
    place they go (load), a 1-D view of an extent; `size` the key's full shape."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: tuple[int, ...]
    flat: torch.Tensor

    def view(self) -> torch.Tensor:
        return self.flat.view(self.sizes)


def chunks_of(u, rng: slice, tensors: dict[str, torch.Tensor], keys) -> list[Chunk]:
    """Chunks of the tensors (each a 1-D extent covering `rng` of u's padded buffer, by state)
    under the keys that keys(parameter name, state) gives, slot by slot ([Note: DCP boxes])."""
    out = []
    for s in u.part.layout.slots:
        lo, hi = max(rng.start, s.offset), min(rng.stop, s.offset + s.numel)
        if lo >= hi:
            continue
        for state, t in tensors.items():
            for key in keys(s.name, state):
                for offsets, sizes, first in boxes(s.shape, lo - s.offset, hi - s.offset):
                    at = s.offset + first - rng.start
                    flat = t[at : at + math.prod(sizes)]
                    out.append(Chunk(key, offsets, sizes, tuple(s.shape), flat))
    return out


def keys_of(engine, aliases):
    def keys(name: str, state: str) -> list[str]:
        if state in ("master", "frozen"):
            return aliases[name]
        return [f"state.{name}.{state}"] if state in kept_states(engine, name) else []

    return keys


def save_chunks(engine, aliases) -> list[Chunk]:
    """This rank's chunks: its own shard of every unit's master, states and frozen values;
    with hierarchical sharding only the first shard group's, so that each is written once
    ([Note: HSDP checkpoints] in commit.py)."""
    out, keys = [], keys_of(engine, aliases)
    if engine.rank >= engine.shard_size:
        return out
    for u in engine.units:
        ext, own = engine.master_extent(u), u.part.own
        held = {"master": u.master, **u.opt}
        mine = {k: t[own.start - ext.start : own.stop - ext.start] for k, t in held.items()}
        out += chunks_of(u, own, mine, keys)
    for u in engine.frozen_units:
        resident, held = engine.working_extent(u)
        own = resident[u.part.own.start - held.start : u.part.own.stop - held.start]
        out += chunks_of(u, u.part.own, {"frozen": own.float()}, keys)
    return out


def scalars(engine, aliases, buffers) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Rank 0's whole tensors (step counts, buffers) and plain values (param_groups, EXTRA_KEY)."""
    cfg, steps = engine.config, engine.param_steps()
    tensors, objects = {}, {}
    if cfg.optimizer != "sgd":
        for name in engine.group_index:
            tensors[f"state.{name}.step"] = torch.tensor(float(steps[name]), dtype=torch.float32)
    module_buffers = dict(_buffers(engine.module))
    for key in buffers:
        tensors[key] = module_buffers[key].detach().cpu()
    groups = _torch_param_groups(cfg.optimizer, list(cfg.groups), [[] for _ in cfg.groups])
    for name, g in engine.group_index.items():
        for k, v in groups[g].items():
            if k != "params":
                objects[f"param_groups.{name}.{k}"] = v
    objects[EXTRA_KEY] = {
        "format": DCP_FORMAT,
        "version": DCP_VERSION,
        "t": engine.t,
        "data_step": engine.data_step,
        "scaler": None if engine.scaler is None else dataclasses.asdict(engine.scaler),
        "steps": dict(steps),
        "world_size": engine.world_size,
        "stage": cfg.stage,
        "optimizer": cfg.optimizer,
        "precision": cfg.precision,
        "run_id": engine.checkpoint_run_id,
    }
    return tensors, objects


# -- the planners ----------------------------------------------------------------------------


def alone(t: torch.Tensor) -> torch.Tensor:
    """Contiguous `t` over the same memory, as a tensor whose storage is exactly its own bytes
    ([Note: DCP writes in place])."""
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[start : start + t.nbytes]  # shares t's memory, keeps it alive
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape)


class SavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner's global plan and metadata (deduplication, validation that the chunks
    tile every tensor) over this rank's own write items ([Note: DCP writes])."""

    def __init__(self, chunks: list[Chunk], tensors: dict, objects: dict):
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.chunks, self.tensors, self.objects = chunks, tensors, objects
        self.by_index = {(c.key, c.offsets): alone(c.view()) for c in chunks}
        self.by_index.update({(k, (0,) * t.dim()): t for k, t in tensors.items()})

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.is_coordinator, self.state_dict = is_coordinator, {}
        keys = {c.key for c in self.chunks} | set(self.tensors) | set(self.objects)
        self.mappings = {k: (k,) for k in keys}  # a flat state dict: each key is its own path

    def create_local_plan(self) -> SavePlan:
        items = []
        for c in self.chunks:
            data = TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                properties=TensorProperties.create_from_tensor(c.flat),
                size=torch.Size(c.size),
            )
            index = MetadataIndex(c.key, torch.Size(c.offsets))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        for k, t in self.tensors.items():
            origin = torch.Size((0,) * t.dim())
            data = TensorWriteData(
                chunk=ChunkStorageMetadata(origin, t.shape),
                properties=TensorProperties.create_from_tensor(t),
                size=t.shape,
            )
            index = MetadataIndex(k, origin)
            items.append(WriteItem(index=index, type=WriteItemType.TENSOR, tensor_data=data))
        for k in self.objects:
            items.append(WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.objects[index.fqn], buf)
            return buf
        return self.by_index[(index.fqn, tuple(index.offset))]


class LoadPlanner(DefaultLoadPlanner):
    """Reads into the chunks' own places ([Note: DCP reads]), in place: DCP's reader copies
    each saved chunk it loads into the view resolve_tensor gives; plain values into `objects`."""

    def __init__(self, chunks: list[Chunk], objects: list[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.wanted, self.objects = chunks, objects, {}
        self.places: dict[tuple[str, int], torch.Tensor] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        by_key: dict[str, list[Chunk]] = {}
        for c in self.chunks:
            by_key.setdefault(c.key, []).append(c)
        items = []
        for key, chunks in by_key.items():
            for i, c in enumerate(chunks):
                self.places[(key, i)] = c.view()
            local = [
                ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks
            ]
            md = self.metadata.state_dict_metadata[key]
            items += create_read_items_for_chunk_list(key, md, local)
        for key in self.wanted:
            zero, index = torch.Size((0,)), MetadataIndex(key)
            items.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=index,
                    dest_offsets=zero,
                    storage_index=index,
                    storage_offsets=zero,
                    lengths=zero,
                )
            )
        self.elements = sum(math.prod(r.lengths) for r in items if r.type == LoadItemType.TENSOR)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        out = self.places[(read_item.dest_index.fqn, read_item.dest_index.index)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, start, length)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read in place


@dataclasses.dataclass
class Targets:
    """Where load_dcp reads to ([Note: DCP reads] in zero/checkpoint/dcp.py)."""

    chunks: list = dataclasses.field(default_factory=list)  # views of the engine's own buffers
    small: list = dataclasses.field(default_factory=list)  # into the fresh steps and buffers
    synced: list = dataclasses.field(default_factory=list)  # (working copy, master): after
    steps: dict = dataclasses.field(default_factory=dict)  # name -> 1-element fp32 (Adam)
    buffers: dict = dataclasses.field(default_factory=dict)  # key -> a tensor like the buffer


def whole_chunk(key: str, t: torch.Tensor) -> Chunk:
    shape = tuple(t.shape)
    return Chunk(key, (0,) * len(shape), shape, shape, t.reshape(-1))


def load_targets(engine, aliases, buffers) -> Targets:
    """The chunks this rank reads ([Note: DCP reads]): the master, states and frozen values as
    views of the engine's own buffers (the master's extent into u.master, the rest of the
    working extent into the working copy), the step counts and buffers into fresh tensors."""
    kept = keys_of(engine, {name: keys[:1] for name, keys in aliases.items()})
    out = Targets()
    for u in engine.units:
        resident, held = engine.working_extent(u)
        ext = engine.master_extent(u)
        a, b = ext.start - held.start, ext.stop - held.start
        out.chunks += chunks_of(u, slice(held.start, ext.start), {"master": resident[:a]}, kept)
        out.chunks += chunks_of(u, ext, {"master": u.master, **u.opt}, kept)
        out.chunks += chunks_of(u, slice(ext.stop, held.stop), {"master": resident[b:]}, kept)
        if resident[a:b].data_ptr() != u.master.data_ptr():
            out.synced.append((resident[a:b], u.master))
    for u in engine.frozen_units:
        resident, held = engine.working_extent(u)
        out.chunks += chunks_of(u, held, {"frozen": resident}, kept)
    if engine.config.optimizer != "sgd":
        for name in engine.group_index:
            out.steps[name] = torch.zeros(1)
            out.small.append(Chunk(f"state.{name}.step", (), (), (), out.steps[name]))
    for key, b in _buffers(engine.module):
        if key in buffers and b.numel():
            out.buffers[key] = torch.empty(b.shape, dtype=b.dtype)
            out.small.append(whole_chunk(key, out.buffers[key]))
    return out
