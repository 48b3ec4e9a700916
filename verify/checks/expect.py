"""What a cell must see, computed in verify from the model and the config alone, never from the
engine under test: the reference's units and parameter groups, each step's collectives, and the
resident bytes.

Legend: N ranks, M micro-batches per step, k = M/N micro-steps, L_u unit u's shard length and
N·L_u its padded length (reference/layout.py), real_r the real (non-padding) elements of shard r,
cb/gb the bytes of the compute and reduction dtypes.

  reference_units   config.units applied to model.named_parameters(): a parameter belongs to the
                    one named unit whose submodule holds it, to the root if none or several do
                    (tied parameters, once each), root first (docs/design.md §3)
  reference_groups  every trainable parameter's group by GROUPINGS, the split stated here from
                    the layers' roles (0 everywhere without config.group_of), never by calling
                    the library's predicate (zero.config.decay_matrices_only)
  expected_traffic  per step and rank, {"op:phase": (calls, elements, padding)} by the design's
                    volume table (docs/design.md §2) unit by unit, see the function
  expected_memory   engine.memory_report()'s categories (verify/checks/expect_memory.py, with the
  offload
                    copies and the released gradient buffers; re-exported here)
A test plants an engine whose grouping or prefetch is wrong; only expectations built here can
tell (tests/distributed/test_verify_planted.py).
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

from reference import ModelSpec
from reference.step import StepConfig

from .expect_hsdp import as_group, groups_of, replica_traffic
from .expect_memory import (
    DTYPE_BYTES,
    arena_span,
    expected_memory,
    expected_offload_copies,
    expected_released,
    optimizer_states,
    persistent,
)

__all__ = [
    "DTYPE_BYTES", "arena_span", "expected_memory", "expected_offload_copies",
    "expected_released", "optimizer_states", "persistent",
]  # fmt: skip


def reference_units(
    model, config, *, frozen: bool = False
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """[(unit name, [(parameter name, shape)])], root ('') first, empty units left out: the
    trainable parameters, or with frozen=True those with requires_grad=False, which have their
    own buffer per unit and no place in the reference's spec (docs/design.md §2)."""
    mods = dict(model.named_modules())
    holders: dict[int, set[str]] = {}
    for uname in config.units:
        for p in mods[uname].parameters():
            holders.setdefault(id(p), set()).add(uname)
    out: dict[str, list] = {u: [] for u in ("", *config.units)}
    for name, p in model.named_parameters():  # a tied parameter is yielded once
        if p.requires_grad == frozen:
            continue
        owner = holders.get(id(p), set())
        out[next(iter(owner)) if len(owner) == 1 else ""].append((name, tuple(p.shape)))
    return [(u, ps) for u, ps in out.items() if ps]


# -- parameter groups ---------------------------------------------------------------------------
# The split every verify config asks for (group_of=zero.config.decay_matrices_only, the input
# under test), stated here on its own terms (docs/design.md §2.7; docs/verification.md, "Where
# expected values come from"): group 0, weight decay, holds the matrices a layer multiplies by
# (linear and attention projections, convolution kernels, embedding tables, LoRA's adapters);
# group 1, none, holds every additive bias and every normalisation layer's scale and shift.
# The rows name parameters by pattern (fnmatch: * spans dots), per model kind; a parameter
# must match exactly one group's patterns, so a name the table does not know is refused
# rather than guessed. Shapes are not read: where the library's rule (two or more dimensions)
# and the roles disagree, cells fail.

MLP_SPLIT = (("layers.*.weight",), ("layers.*.bias",))
"""verify.cells.cell's MLPs (mlp, mlp-uneven, mlp-frozen, mlp-bn: its BatchNorms have no affine
parameters): the linear layers' weights decay, their biases do not."""

GPT_SPLIT = (
    (
        "transformer.wte.weight",  # token embedding, tied to the head (GPT-2's recipe decays it)
        "transformer.wpe.weight",  # position embedding
        "transformer.h.*.attn.c_attn.weight",
        "transformer.h.*.attn.c_proj.weight",
        "transformer.h.*.mlp.c_fc.weight",
        "transformer.h.*.mlp.c_proj.weight",
        "transformer.h.*.lora_a",  # zero/workloads/lora.py's adapters (the base is frozen)
        "transformer.h.*.lora_b",
    ),
    (
        "transformer.h.*.attn.c_*.bias",
        "transformer.h.*.mlp.c_*.bias",
        "transformer.h.*.ln_?.weight",
        "transformer.h.*.ln_?.bias",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ),
)
"""The project's GPT (and its tensor-parallel slice, and Hugging Face's GPT-2, which names its
parameters the same way)."""

RESNET_SPLIT = (
    ("stem.0.weight", "blocks.*.conv?.weight", "blocks.*.shortcut.0.weight", "head.weight"),
    (
        "stem.1.weight",  # stem.1 and shortcut.1 are BatchNorms
        "stem.1.bias",
        "blocks.*.bn?.weight",
        "blocks.*.bn?.bias",
        "blocks.*.shortcut.1.weight",
        "blocks.*.shortcut.1.bias",
        "head.bias",
    ),
)
"""zero/workloads/resnet.py: convolution kernels and the head's matrix decay; BatchNorms'
scales and shifts and the head's bias do not."""

LLAMA_SPLIT = (
    (
        "model.embed_tokens.weight",
        "model.layers.*.self_attn.?_proj.weight",
        "model.layers.*.mlp.*_proj.weight",
        "lm_head.weight",
    ),
    ("model.layers.*.input_layernorm.weight", "model.layers.*.post_attention_layernorm.weight",
     "model.norm.weight"),
)  # fmt: skip
"""Hugging Face's Llama: no biases; the RMSNorms' scales do not decay."""

GROUPINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "MLP": MLP_SPLIT,
    "NormMLP": MLP_SPLIT,
    "BranchMLP": (("mlp.layers.*.weight", "side.weight"), ("mlp.layers.*.bias", "side.bias")),
    "GPT": GPT_SPLIT,
    "TPGPT": GPT_SPLIT,
    "GPT2LMHeadModel": GPT_SPLIT,
    "ResNet": RESNET_SPLIT,
    "LlamaForCausalLM": LLAMA_SPLIT,
    # verify/cells/inject.py's parameter-only models: names without layer roles, so each is listed;
    # the vectors stand for biases and norms, the rest for matrices and kernels
    "ParamModel:even": (("p1", "a.p0", "b.p0", "b.p2"), ("p0", "a.p1", "b.p1")),
    "ParamModel:uneven": (("p1", "a.p0", "b.p0", "c.p0"), ("p0", "a.p1", "b.p1", "b.p2")),
}
"""Model kind (the class name; ParamModel with its plan) -> (patterns of the parameters that
decay, patterns of those that do not)."""


def model_kind(model) -> str:
    """The key of GROUPINGS for a model."""
    kind = type(model).__name__
    return f"{kind}:{model.plan}" if kind == "ParamModel" else kind


def decay_groups(model) -> dict[str, int]:
    """Trainable parameter name -> 0 (weight decay) or 1 (none), by GROUPINGS alone."""
    kind = model_kind(model)
    if kind not in GROUPINGS:
        raise ValueError(f"no grouping stated for model kind {kind!r}: add it to GROUPINGS")
    # frozen parameters are in no group (docs/design.md §2.8)
    return {n: _group(kind, n) for n, p in model.named_parameters() if p.requires_grad}


def _group(kind: str, name: str) -> int:
    hits = [g for g, pats in enumerate(GROUPINGS[kind]) if any(fnmatchcase(name, x) for x in pats)]
    if len(hits) != 1:
        raise ValueError(f"{kind}: parameter {name!r} matches groups {hits}, not exactly one")
    return hits[0]


def reference_groups(model, config) -> dict[str, int]:
    """Parameter name -> optimizer group: decay_groups where the config groups at all, 0 for
    every parameter where it does not (group_of=None: ZeroConfig's documented meaning)."""
    if config.group_of is None:
        return {n: 0 for n, p in model.named_parameters() if p.requires_grad}
    return decay_groups(model)


def group_mismatch(engine: dict, want: dict) -> str:
    """'' when the engine's groups (engine.group_index, a read of its state) are `want`, else
    the first parameter whose group differs."""
    bad = sorted(k for k in set(engine) | set(want) if engine.get(k) != want.get(k))
    if not bad:
        return ""
    k = bad[0]
    return f"parameter groups: engine puts {k!r} in group {engine.get(k)}, expected {want.get(k)}"


def reference_spec(model, config) -> ModelSpec:
    """The reference's ModelSpec from the model and the config alone."""
    units = [ps for _, ps in reference_units(model, config)]
    return ModelSpec.build(units, reference_groups(model, config), chunk=config.chunk)


def frozen_layouts(model, config) -> list[tuple[str, object]]:
    """[(unit name, UnitLayout)] of each unit's frozen parameters, root first (zero/build.py:
    the trainable parameters' layout rules, a buffer of their own)."""
    units = reference_units(model, config, frozen=True)
    spec = ModelSpec.build([ps for _, ps in units], chunk=config.chunk)
    return [(name, lay) for (name, _), lay in zip(units, spec.layouts, strict=True)]


def reference_step_config(config, n: int) -> StepConfig:
    """The reference's configuration of one step, read field by field from the config
    (deliberately not ZeroConfig.step_config: the expected side does not reuse the library's
    own translation, so a field that translation drops or alters shows as a mismatch)."""
    return StepConfig(
        optimizer=config.optimizer,
        groups=tuple(config.groups),
        precision=config.precision,
        reduce_dtype=config.reduce_dtype,
        world_size=n,
        micro_batches=config.micro_batches,
        clip_norm=config.clip_norm,
        scaler=config.scaler,
        nonfinite=config.nonfinite,
    )


def reference_zeropp(config, spec):
    """ZeRO++'s quantized collectives as the reference applies them (reference/zeropp.py), read
    field by field from the config; None without qwZ and qgZ. Only the units stage 3 shards
    are gathered and reduced by them (not its persistent ones)."""
    if not (config.qwz_bits or config.qgz_bits):
        return None
    from reference.zeropp import ZeroPP

    return ZeroPP(
        block=config.quant_block,
        qwz_bits=config.qwz_bits,
        qgz_bits=config.qgz_bits,
        ranks_per_node=config.ranks_per_node,
        units=tuple(not persistent(config, lay) for lay in spec.layouts),
    )


def expected_extents(stage: int, persist_below: int, lay, rank: int, n: int):
    """(master/optimizer extent, working extent) that rank must hold, from the stage alone:
    stage 0 (and stage 3's persistent units) everything; stages 1-2 the master shard r and
    the whole working copy; stage 3 shard r of both. Shard r is [r·L, (r+1)·L)."""
    whole = slice(0, lay.padded_numel(n))
    shard = lay.shard_numel(n)
    own = slice(rank * shard, (rank + 1) * shard)
    if stage == 0 or (stage == 3 and lay.numel <= persist_below):
        return whole, whole
    return (own, whole) if stage in (1, 2) else (own, own)


def real_per_shard(lay, n: int) -> list[int]:
    mask = lay.real_mask(n).reshape(n, lay.shard_numel(n))
    return [int(x) for x in mask.sum(axis=1)]


def ran_units(spec, grads, n: int, rank: int) -> list[list[bool]]:
    """Per unit, per micro-step of this step on `rank`: whether the unit ran (forward and
    backward), read off the reference's micro-batch gradients: a unit ran where some
    parameter of it has a gradient ([Note: unused parameters], reference/step.py)."""
    k = len(grads) // n
    return [
        [any(s.name in grads[i * n + rank] for s in lay.slots) for i in range(k)]
        for lay in spec.layouts
    ]


def stage3_forward_gathers(ran, before, overlap: bool) -> list[int]:
    """param_fwd all-gathers of each non-root unit over one step's micro-steps (unit 0, the
    root, is gathered by every forward and is counted apart). A unit that runs is gathered
    once; with overlap, pre_forward(u) also prefetches the unit that followed u in the
    previous micro-step's order (zero/stages/stage3.py), if it is sharded and no other
    non-root unit is held: where that unit does not run now, the gather is spent for nothing.
    `before`: which units ran in the micro-step before this step's first (None: none)."""
    units, k = len(ran), len(ran[0]) if ran else 0
    out = [0] * units
    last = [u for u in range(1, units) if before and before[u]]
    for i in range(k):
        order = [u for u in range(1, units) if ran[u][i]]
        held: set[int] = set()  # prefetched units that do not run: held to the micro-step's end
        for u in order:
            out[u] += 1
            if overlap and u in last and last.index(u) + 1 < len(last):
                nxt = last[last.index(u) + 1]
                if nxt not in order and nxt not in held and not held:
                    out[nxt] += 1
                    held.add(nxt)
        last = order
    return out


def expected_traffic(
    config,
    spec,
    n: int,
    rank: int,
    *,
    forward: bool,
    skipped: bool = False,
    frozen=(),
    names=None,
    ran=None,
    before=None,
) -> dict[str, tuple]:
    """Model-state collectives of one step on `rank`: {"op:phase": (calls, elements, padding)}.

    Per unit, k = M/N, L its shard, rs_pad = Σ_{r≠rank}(L - real_r) (what a reduce-scatter
    sends of padding), ag_pad = (N-1)(L - real_rank) (an all-gather of this rank's shard):
      stage 0 (and stage 3's persistent units)  deterministic: k reduce-scatters and one
          all-gather of the reduced gradient (grad_gather); fast: one all-reduce (2(N-1)L)
      stage 1   deterministic: k reduce-scatters; fast: one; then one all-gather of the
          updated parameters (param_update)
      stage 2   k reduce-scatters in both modes, one param_update all-gather
      stage 3   k reduce-scatters; with a forward, k all-gathers for forward (param_fwd) and,
          but for the root (gathered from its forward to the end of backward), k for backward
          (param_bwd); injected gradients gather nothing. With hpz (R ranks per node, the
          config's ranks_per_node, None: N) a backward all-gather gathers the R secondary parts
          of P = N·L/R elements inside the node: (R-1)·P elements, of which (R-1)·(P - real in
          part j) padding, j = rank mod R (hpz_gather)
    Each reduce-scatter is cut into ceil(L / (C_B // N)) pieces with bucket_elements C_B; the
    pieces send what the whole would. Every call sends (N-1)·(its shard part) elements. A
    skipped step (overflow) updates nothing, so it gathers no updated parameters.
    frozen: frozen_layouts(...); at stage 3 (not persistent) each is gathered as a trainable
    unit is (k param_fwd, and k param_bwd but for the root), and never reduced: stage 3's
    volume grows by 2Ψ_f·M/N (× (N-1)/N), stages 0-2 by nothing. A unit whose outputs need no
    gradient is not gathered in backward; this assumes every non-root unit's outputs do.
    names: the trainable units' names (None: unit 0 is the root, as in a model with a
    trainable root). With shard_group_size, a world of G and the replicas' sums
    (verify/checks/expect_hsdp.py).
    ran: ran_units(...) for a model whose units do not all run in every micro-step (then
    stage 3 gathers a unit for its forward and backward only where it runs, plus the forward
    prefetches of stage3_forward_gathers; `before` is ran's last micro-step of the step
    before); None: every unit runs every micro-step. Both at once (a branch of frozen units,
    or a root with nothing to train in a model with branches) are not modelled.
    """
    g = groups_of(config, n)
    if g is not None:  # HSDP: a world of G, and the sums over the replicas (expect_hsdp.py)
        kw = dict(forward=forward, skipped=skipped, frozen=frozen, names=names, ran=ran)
        inner = expected_traffic(as_group(config, n), spec, g, rank % g, before=before, **kw)
        return {**inner, **replica_traffic(config, spec, n, rank)}
    k = config.micro_batches // n
    out: dict[str, list[int]] = {}
    if ran is None:  # every unit runs, in one order: no prefetch is spent for nothing
        ran, fwd = [[True] * k for _ in spec.layouts], [k] * len(spec.layouts)
    else:
        fwd = stage3_forward_gathers(ran, before, config.overlap)

    def add(key, calls, elements, padding):
        row = out.setdefault(key, [0, 0, 0])
        row[0], row[1], row[2] = row[0] + calls, row[1] + elements, row[2] + padding

    for i, lay in enumerate(spec.layouts):
        root = not i if names is None else not names[i]
        gathers = (fwd[i], sum(ran[i])) if forward else None
        _unit_traffic(add, config, lay, n, rank, root=root, gathers=gathers, skipped=skipped)
    for name, lay in frozen:
        if config.stage != 3 or persistent(config, lay) or not forward:
            continue
        L, real = lay.shard_numel(n), real_per_shard(lay, n)
        one = quantized_traffic(config, L, L - real[rank], n).get(
            "gather", ((n - 1) * L, (n - 1) * (L - real[rank]))
        )
        ag = (k * one[0], k * one[1])
        add("all_gather:param_fwd", k, *ag)
        if name:
            add("all_gather:param_bwd", k, *ag)
    return {key: tuple(v) for key, v in out.items()}


def hpz_gather(config, lay, n: int, rank: int) -> tuple[int, int] | None:
    """(elements, padding) one hpZ backward all-gather of a unit sends from `rank`, or None
    without hpz: the padded unit [0, N·L) cut in R parts of P = N·L/R, node rank j = rank mod R
    sends its part j to the R-1 others; its padding is part j's elements that hold no
    parameter (the layout's real mask)."""
    if not getattr(config, "hpz", False):
        return None
    per_node = config.ranks_per_node or n
    part = lay.padded_numel(n) // per_node
    j = rank % per_node
    real = int(lay.real_mask(n)[j * part : (j + 1) * part].sum())
    return (per_node - 1) * part, (per_node - 1) * (part - real)


def wire(elements: int, bits: int, block: int) -> int:
    """Bytes of `elements` values quantized to `bits` bits, one float32 scale per `block`: what a
    qwZ/qgZ collective sends for them, counted in bytes (docs/design.md §3.13)."""
    return elements * bits // 8 + 4 * (elements // block)


def quantized_traffic(config, L: int, pad: int, n: int) -> dict:
    """The elements (bytes) a stage-3 unit's quantized collectives send per call from one rank
    (pad: this rank's padding elements in its shard): qwZ's all-gather of the N shards,
    (N-1)·wire(L), of which (N-1)·pad·b/8 padding; qgZ's hops over R ranks per node and K nodes,
    inside the node (R-1)·wire(K·L) ("grad_node"), across nodes (K-1)·wire(L) ("grad_across"),
    a hop over one rank not run."""
    out, B = {}, config.quant_block
    if config.qwz_bits:
        b = config.qwz_bits
        out["gather"] = ((n - 1) * wire(L, b, B), (n - 1) * pad * b // 8)
    if config.qgz_bits:
        R = config.ranks_per_node or n
        K, b = n // R, config.qgz_bits
        hops = {"all_to_all:grad_node": (R - 1) * wire(K * L, b, B)} if R > 1 else {}
        hops.update({"all_to_all:grad_across": (K - 1) * wire(L, b, B)} if K > 1 else {})
        out["reduce"] = hops or {"reduce_scatter:grad": 0}
    return out


def _unit_traffic(add, config, lay, n: int, rank: int, *, root: bool, gathers, skipped: bool):
    """One unit's collectives of a step into add(key, calls, elements, padding), by
    expected_traffic's table; gathers: (forward, backward) all-gathers at stage 3 with a
    forward (the root's: every micro-step's forward, held through backward), None without."""
    k, det = config.micro_batches // n, config.deterministic
    L, real = lay.shard_numel(n), real_per_shard(lay, n)
    rs_pad = sum(L - real[r] for r in range(n) if r != rank)
    ag = ((n - 1) * L, (n - 1) * (L - real[rank]))
    pieces = 1
    if config.bucket_elements is not None:
        pieces = math.ceil(L / (config.bucket_elements // n))
    stage = 0 if persistent(config, lay) else config.stage
    rs = ("reduce_scatter:grad", pieces, (n - 1) * L, rs_pad)  # one micro-step's
    if stage == 0 and not det:
        add("all_reduce:grad", 1, 2 * (n - 1) * L, rs_pad + ag[1])
    elif stage == 0:
        add(rs[0], *(k * x for x in rs[1:]))
        add("all_gather:grad_gather", 1, *ag)
    elif stage in (1, 2):
        times = 1 if stage == 1 and not det else k
        add(rs[0], *(times * x for x in rs[1:]))
        if not skipped:
            add("all_gather:param_update", 1, *ag)
    else:
        q = quantized_traffic(config, L, L - real[rank], n)
        for key, sent in q.get("reduce", {rs[0]: None}).items():
            add(key, *((k * rs[1], k * rs[2], k * rs[3]) if sent is None else (k, k * sent, 0)))
        ag = q.get("gather", ag)
        if gathers is not None and root:
            add("all_gather:param_fwd", k, k * ag[0], k * ag[1])
        elif gathers is not None:
            f, b = gathers
            bwd = hpz_gather(config, lay, n, rank) or ag
            add("all_gather:param_fwd", f, f * ag[0], f * ag[1])
            add("all_gather:param_bwd", b, b * bwd[0], b * bwd[1])


def traffic_of_step(counter, step: int) -> dict[str, tuple]:
    """What the engine's counter holds of one step: {"op:phase": (calls, elements, padding)}."""
    out: dict[str, list[int]] = {}
    for rec in counter.of_step(step):
        row = out.setdefault(f"{rec.op}:{rec.phase}", [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + rec.elements, row[2] + rec.padding
    return {key: tuple(v) for key, v in out.items()}


def first_difference(what: str, ours: dict, want: dict) -> str:
    """'' when equal, else the first key that differs with both values."""
    for key in sorted(set(ours) | set(want)):
        if ours.get(key) != want.get(key):
            return f"{what} {key}: engine {ours.get(key)}, expected {want.get(key)}"
    return ""


def expected_mp_traffic(
    cfg, batch: int, n: int, k: int, *, checkpointed: int = 0, p_a: bool = False
) -> list[tuple[str, str, int]]:
    """The MP collectives (kind "mp") of one step of k micro-batches of a TP GPT (zero/mp/gpt.py)
    at N_m = n, deterministic mode, as sorted (op, phase, elements): docs/design.md §6's table.

    Legend: L blocks, X = b·s·h a block's activation, T = b·s tokens. Per micro-batch: forward
    2L g-sums of X (a block's attention-out and MLP-out) and one embedding sum of X, the cross
    entropy's max over T (a ring all-reduce, 2(n-1)·⌈T/n⌉) and its two sums of T; backward
    2L + 1 f-sums of X (a block's QKV and MLP-in, the tied head). A deterministic sum is an
    all-gather of (n-1)·X. With `checkpointed` blocks recomputed in backward, each adds 1 g-sum
    ("mp_fwd"), not 2: torch's non-reentrant checkpoint stops recomputing once every tensor
    backward needs is back, before the MLP's sum (zero/mp/partitioned.py). P_a adds one
    all-gather "p_a" of (n-1)·⌈X/n⌉ per checkpointed block (its input's parts)."""
    h, t, layers = cfg.n_embd, batch * cfg.block_size, cfg.n_layer
    x = t * h
    one = (
        [("all_gather", "mp_fwd", (n - 1) * x)] * (2 * layers + checkpointed)
        + [("all_gather", "mp_embed", (n - 1) * x)]
        + [("all_gather", "mp_xent", (n - 1) * t)] * 2
        + [("all_reduce", "mp_xent", 2 * (n - 1) * math.ceil(t / n))]
        + [("all_gather", "mp_bwd", (n - 1) * x)] * (2 * layers + 1)
        + [("all_gather", "p_a", (n - 1) * math.ceil(x / n))] * (checkpointed if p_a else 0)
    )
    return sorted(one * k)
