"""verify's model-parallel section: ZeRO inside the DP group of each tensor-parallel slice.

A cell (MPCell) trains the TP GPT (zero/mp/gpt.py) on N_d·N_m gloo ranks for S steps with
clipping active. The reference side is reference/mp.py's step on every slice, fed with the MP
model's micro-batch gradients computed without zero/mp ([Note: the cells' reference gradients]):
the slices' working copies joined into the plain GPT's, all M micro-batches through the plain GPT
with its split operators evaluated slice by slice, the gradients cut per MP index. First, the
slices' initial values joined must be GPT(seed)'s bits. Per step and rank:
  - the master and optimizer states bitwise = the reference's slice; the reported loss (within
    loss_bound), norm (bits), skip and step counts (verify.harness.check_reported);
  - the counted traffic: kind "model" = verify.expect.expected_traffic for the slice in the DP
    group, kind "mp" = expected_mp_traffic (recomputation and P_a included), one MP control
    all-gather of (N_m-1)·(2 + parameters) float64 values, and the host copies of P_a+cpu and
    of offload_optimizer (verify.expect.expected_offload_copies);
  - after the last step, memory_report() = verify.expect.expected_memory for the slice, and its
    parameter count (and tp_num_params's) = the plain GPT's parameters cut for m.
Across cells: at fixed (N_m, precision) one digest per MP index and step over N_d, stages and
P_a on/off (world-size invariance over DP; P_a changes no bit). docs/verification.md,
"Model-parallel cells". Legend: N_d, N_m, (d, m), M, k = M/N_d, L blocks, X = b·s·h.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from reference.tree import tree_sum

CFG = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
"""The GPT of the cells at N_m <= 2; at N_m = 4 the same with 4 heads (heads are split whole)."""
BATCH, M, CHUNK, CLIP = 2, 4, 128, 0.05
"""The model and step: CLIP is far below the first steps' norms (about 1.2), so every step
clips (each row records it)."""
EXTRAS = ("offload_optimizer", "contiguous_memory")
"""Options that compose with MP: ZeRO-Offload's host optimizer, ZeRO-R's M_D arenas."""
SEED = 3
"""The initial values: GPT(config, seed=SEED)'s, cut per MP index."""
PLANTS = ("double", "p_a_order", "tp_scale")
"""Engine bugs a cell must catch: the replicated parameters counted in the norm on every MP
rank; P_a's gather returning the MP ranks' parts in the wrong order; every row-parallel output
scaled by 1.0001 on every MP rank (a tensor-parallel layer wrong in a self-consistent way, which
a reference computed through zero/mp would share)."""
_GROUPS: dict = {}  # per worker process: the mesh's groups, created once per (dp, mp)
_SLICED: dict = {}  # per worker process: one SlicedGPT per (config, N_m)


@dataclass(frozen=True, kw_only=True)
class MPCell:
    dp: int
    mp: int
    stage: int
    precision: str = "fp32"
    p_a: str = "off"  # "off", "on" (P_a), "cpu" (P_a+cpu)
    steps: int = 2
    plant: str | None = None
    from_gpt: bool = False  # the slice cut from the whole GPT(seed) (TPGPT.from_gpt), not built
    extra: tuple[str, ...] = ()  # ZeroConfig flags set True: EXTRAS

    @property
    def world_size(self) -> int:
        return self.dp * self.mp

    @property
    def label(self) -> str:
        p_a = {"off": "", "on": " P_a", "cpu": " P_a+cpu"}[self.p_a]
        plant = f" plant={self.plant}" if self.plant else ""
        how = " from_gpt" if self.from_gpt else ""
        how += "".join(f" {x}" for x in self.extra)
        return f"N_d={self.dp} N_m={self.mp} stage {self.stage} {self.precision}{p_a}{how}{plant}"

    def options(self) -> dict:
        extra = dict.fromkeys(self.extra, True)
        if self.p_a == "off":
            return extra
        on = dict(activation_checkpointing=True, partition_activations=True, **extra)
        return {**on, "offload_activations": True} if self.p_a == "cpu" else on


def model_config(mp: int):
    """The cells' GPTConfig at N_m = mp: CFG, with as many heads as MP ranks where it has
    fewer."""
    from zero.workloads.models import GPTConfig

    return GPTConfig(**{**CFG, "n_head": max(CFG["n_head"], mp)})


def mesh_groups(dp, mp):
    """This rank's groups of a (dp, mp) mesh, created once per worker process."""
    from zero.mp import Mesh

    if (dp, mp) not in _GROUPS:
        _GROUPS[(dp, mp)] = Mesh(dp=dp, mp=mp).groups()
    return _GROUPS[(dp, mp)]


def float_bits(x) -> int | None:
    return None if x is None else struct.unpack("<q", struct.pack("<d", x))[0]


def _same_bits(ours, theirs) -> str:
    """check_reported's norm comparison: the same float64 bits (docs/design.md §6's norm)."""
    return (
        "" if float_bits(ours) == float_bits(theirs) else f"engine {ours!r}, reference {theirs!r}"
    )


def setup(dp, mp, stage, precision, *, from_gpt=False, **kw):
    """(groups, model, initial values, config, engine) of one rank of a (dp, mp) mesh; the
    slice built alone (TPGPT.build) or cut from the whole GPT (from_gpt: the same bits)."""
    from zero.collectives import CommCounter
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.mp import TPGPT, MPContext
    from zero.workloads.models import GPT

    g = mesh_groups(dp, mp)
    ctx = MPContext.of(g.mp_group, counter=CommCounter(keep_steps=None))
    if from_gpt:
        model = TPGPT.from_gpt(GPT(model_config(mp), seed=SEED), ctx)
    else:
        model = TPGPT.build(model_config(mp), ctx, seed=SEED)
    init = {k: v.detach().float().clone().numpy() for k, v in model.named_parameters()}
    units = tuple(model.unit_names())
    zcfg = ZeroConfig(
        stage=stage, precision=precision, micro_batches=M, chunk=CHUNK, clip_norm=CLIP,
        units=units, **kw,
    )  # fmt: skip
    return g, model, init, zcfg, ZeroEngine(model, zcfg, group=g.dp_group, mp=ctx)


# [Note: the cells' reference gradients] reference/mp.py's step takes the MP-sliced model's
# micro-batch gradients. The cells compute them without zero/mp, whose layers are under test:
# the MP group's working copies are joined into the whole GPT's by docs/design.md §6.1's split
# rule (split_of, stated again here from the layers' roles), the plain GPT of
# zero/workloads/models.py (the input definition) runs each micro-batch, and the whole gradients
# are cut back per MP index. The plain GPT's own products would sum the split dimension in
# another order (one dot product where the slices add N_m partials; F.cross_entropy), and two
# whole models summing in two orders have no derivable bound (design §6.6; measured: the plain
# GPT's gradient differs from the slices' in the last bits even at N_m = 1). So its split
# operators, and only those, are evaluated as design §6.2 states them: each slice's product alone,
# the partials added by reference/tree.py's T in m order (deterministic mode), the cross entropy
# from the logits' slices. LayerNorms, attention, GELU, residuals and the forward itself are the
# plain GPT's code. The gradients are then the slices' bits, and the engine is compared bitwise.

COLUMN = {"attn.c_attn": "qkv", "mlp.c_fc": "rows"}
"""Column-parallel layers (docs/design.md §6.1): output features split, the weight's rows and the
bias with them; QKV by heads, i.e. each of the q, k and v blocks in N_m parts."""
ROW = ("attn.c_proj", "mlp.c_proj")
"""Row-parallel layers: input features split (the weight's columns); the bias is added once,
after the sum, so it is replicated."""
VOCAB = ("transformer.wte", "lm_head")
"""The token embedding and its tied head: split by vocabulary rows."""


def split_of(name: str) -> str | None:
    """How design §6.1 splits the plain GPT's parameter `name` over N_m ranks: "rows" (dim 0 in
    N_m equal parts), "cols" (dim 1), "qkv" (dim 0 as q, k, v, each in N_m parts) or None
    (replicated). Restated from the layers' roles: zero.mp's own table is under test."""
    module, _, kind = name.rpartition(".")
    role = ".".join(module.split(".")[-2:])
    if role in COLUMN:
        return COLUMN[role]
    if role in ROW:
        return "cols" if kind == "weight" else None
    return "rows" if module in VOCAB else None


def cut(a: np.ndarray, rule: str | None, m: int, n: int) -> np.ndarray:
    """Slice m of n of a whole array split by `rule` (split_of); a contiguous copy."""
    if rule == "qkv":
        return np.concatenate([np.split(third, n)[m] for third in np.split(a, 3)])
    if rule is not None:
        a = np.split(a, n, axis=0 if rule == "rows" else 1)[m]
    return np.ascontiguousarray(a).copy()


def join(parts: list[np.ndarray], rule: str | None, name: str = "") -> np.ndarray:
    """The whole array from its slices in m order (cut's inverse). A replicated array must have
    the same bits in every slice (ValueError naming it otherwise)."""
    if rule is None:
        if any(not _bits_equal(x, parts[0]) for x in parts):
            raise ValueError(f"{name}: replicated, but the MP slices hold different bits")
        return parts[0]
    if rule == "qkv":
        thirds = [np.split(x, 3) for x in parts]
        return np.concatenate([np.concatenate([t[j] for t in thirds]) for j in range(3)])
    return np.concatenate(parts, axis=0 if rule == "rows" else 1)


def join_state(slices: list[dict]) -> dict:
    """name -> whole array, from every slice's name -> array, in m order."""
    return {k: join([s[k] for s in slices], split_of(k), k) for k in slices[0]}


def counts(name: str, m: int) -> bool:
    """reference/mp.py's `counts`: whether slice m's `name` enters the norm. Design §6.3: every
    element of the model once, so a split parameter on every m, a replicated one on m = 0."""
    return split_of(name) is not None or m == 0


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and np.array_equal(
            np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)
        )
    )


def _cut_t(t: torch.Tensor, rule: str, n: int, dim: int) -> list[torch.Tensor]:
    """cut for a tensor, every slice at once and differentiable (the backward glues the slices'
    gradients back by copies: chunk's backward is a concatenation)."""
    if rule == "qkv":
        thirds = t.chunk(3, dim)
        return [torch.cat([c.chunk(n, dim)[m] for c in thirds], dim) for m in range(n)]
    return [c.contiguous() for c in t.chunk(n, dim)]


def _glue_t(parts: list[torch.Tensor], rule: str, dim: int) -> torch.Tensor:
    """join for tensors (differentiable): the slices' outputs as the whole layer's."""
    if rule == "qkv":
        thirds = [x.chunk(3, dim) for x in parts]
        return torch.cat([torch.cat([t[j] for t in thirds], dim) for j in range(3)], dim)
    return torch.cat(parts, dim)


class _Fan(torch.autograd.Function):
    """Design §6.2's f: n uses of x, the identity in forward; in backward the n input gradients
    are added by T in m order."""

    @staticmethod
    def forward(ctx, x, n: int):
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        return tree_sum([g.contiguous() for g in grads]), None


def _column(mod, rule: str, n: int, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel layer of the plain GPT: f(x), each slice's output features alone,
    glued in m order."""
    ws = _cut_t(mod.weight, rule, n, 0)
    bs = [None] * n if mod.bias is None else _cut_t(mod.bias, rule, n, 0)
    xs = _Fan.apply(x, n)
    return _glue_t([F.linear(a, w, b) for a, w, b in zip(xs, ws, bs)], rule, -1)


def _row(mod, n: int, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer of the plain GPT: each slice's product of its input features, the n
    partials added by T in m order (design §6.2's g), then the bias once."""
    xs = [c.contiguous() for c in x.chunk(n, -1)]
    y = tree_sum([F.linear(a, w) for a, w in zip(xs, _cut_t(mod.weight, "cols", n, 1))])
    return y if mod.bias is None else y + mod.bias


def _embed(mod, n: int, idx: torch.Tensor) -> torch.Tensor:
    """The vocabulary-split lookup: the row from the slice holding the id, plus +0 from each
    other slice (design §6.2). That sum is the row's value read through one addition of +0
    (-0.0 becomes +0.0) when N_m > 1; its gradient is the plain lookup's."""
    e = F.embedding(idx, mod.weight)
    return e + 0.0 if n > 1 else e


class _VocabXent(torch.autograd.Function):
    """Per-token cross entropy from the logits' N_m slices (design §6.2): ℓ = log S - (z_t - max),
    max over every slice (exact), S = T over m of each slice's Σ exp(z - max), z_t - max from
    the slice holding t (the others add +0). Backward: (softmax - onehot)·dℓ on each slice."""

    @staticmethod
    def forward(ctx, targets, *zs):
        width = zs[0].shape[-1]
        top = torch.stack([z.max(dim=-1).values for z in zs]).amax(0).unsqueeze(-1)
        shifted = [z - top for z in zs]
        e = [torch.exp(s) for s in shifted]
        total = tree_sum([x.sum(dim=-1) for x in e])
        picked = []
        for m, s in enumerate(shifted):
            local = targets - m * width
            outside = (local < 0) | (local >= width)
            at = local.masked_fill(outside, 0).unsqueeze(-1)
            picked.append(s.gather(-1, at).squeeze(-1).masked_fill(outside, 0.0))
        onehot = F.one_hot(targets, width * len(zs)).to(zs[0].dtype).chunk(len(zs), -1)
        ctx.save_for_backward(*(x / total.unsqueeze(-1) for x in e), *onehot)
        return torch.log(total) - tree_sum(picked)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        n = len(saved) // 2
        return None, *((p - o) * grad.unsqueeze(-1) for p, o in zip(saved[:n], saved[n:]))


class SlicedGPT:
    """The plain GPT (zero/workloads/models.py), its split operators evaluated slice by slice
    for N_m = n ([Note: the cells' reference gradients]); what microbatch_loss_and_grads needs
    of a model: named_parameters() (the plain GPT's) and a call returning (logits, loss)."""

    def __init__(self, cfg, n: int):
        from zero.workloads.models import GPT

        self.gpt, self.n = GPT(cfg, seed=0), n  # its values are replaced per micro-batch
        for name, mod in self.gpt.named_modules():
            role = ".".join(name.split(".")[-2:])
            if role in COLUMN:
                mod.forward = functools.partial(_column, mod, COLUMN[role], n)
            elif role in ROW:
                mod.forward = functools.partial(_row, mod, n)
        head, wte = self.gpt.lm_head, self.gpt.transformer.wte
        head.forward = functools.partial(_column, head, "rows", n)
        wte.forward = functools.partial(_embed, wte, n)

    def named_parameters(self):
        return self.gpt.named_parameters()

    def __call__(self, idx, targets):
        logits, _ = self.gpt(idx)  # the plain GPT's forward, without its own loss
        zs = [z.contiguous().view(-1, z.shape[-1]) for z in logits.chunk(self.n, -1)]
        return logits, _VocabXent.apply(targets.reshape(-1), *zs).mean()


def sliced_gpt(cfg, n: int) -> SlicedGPT:
    """One SlicedGPT per worker process and (config, N_m)."""
    if (cfg, n) not in _SLICED:
        _SLICED[(cfg, n)] = SlicedGPT(cfg, n)
    return _SLICED[(cfg, n)]


def reference_grads(g, cfg, working, batches, dtype, scale):
    """Every slice's (losses, micro-batch gradients) on the reference's working copies, computed
    without zero/mp ([Note: the cells' reference gradients]): the MP group's working copies
    joined into the whole GPT's, each micro-batch through SlicedGPT with
    microbatch_loss_and_grads (the engine's dtype and loss scale), the gradients cut per m."""
    import torch.distributed as dist

    from verify.harness import microbatch_loss_and_grads

    n = g.mesh.mp
    slices = [None] * n
    dist.all_gather_object(slices, working, group=g.mp_group)
    model, whole = sliced_gpt(cfg, n), join_state(slices)
    pairs = [microbatch_loss_and_grads(model, whole, b, dtype, scale) for b in batches]
    every = [
        [{k: cut(v, split_of(k), m, n) for k, v in gr.items()} for _, gr in pairs] for m in range(n)
    ]
    return [x for x, _ in pairs], every


def _plant_tp_scale(_n: int):
    """Every row-parallel output (attention-out, MLP-out) times 1.0001, on every MP rank, as the
    TP blocks call it; returns the undo (the pools are long-lived)."""
    import zero.mp.gpt as gm

    real = gm.row_linear
    gm.row_linear = lambda x, weight, bias, mp: real(x, weight, bias, mp) * 1.0001
    return lambda: setattr(gm, "row_linear", real)


def _plant_p_a_order(n: int):
    """P_a's gather with the N parts rotated (rank m's part read as rank m+1's); returns the
    undo (the pools are long-lived: the next cell must run the real code)."""
    import zero.mp.partitioned as pm

    real = pm.all_gather

    def rotated(out, part, **kw):
        done = real(out, part, **kw)
        done.wait()
        out.copy_(out.view(n, -1).roll(1, 0).reshape(-1))
        return done

    pm.all_gather = rotated
    return lambda: setattr(pm, "all_gather", real)


def _whole_init(cfg) -> dict:
    """The plain GPT's initial values (the input definition): name -> float32 array."""
    from zero.workloads.models import GPT

    return {k: v.detach().numpy() for k, v in GPT(cfg, seed=SEED).named_parameters()}


def _start_check(every_init: list[dict], cfg) -> str:
    """'' if the slices' initial values, joined by split_of's rule, are the plain GPT's, bit
    for bit (design §6.1: the slices are exact copies); else the first difference."""
    try:
        whole = join_state(every_init)
    except ValueError as e:
        return f"initial slices: {e}"
    want = _whole_init(cfg)
    if whole.keys() != want.keys():
        return f"initial slices: names {sorted(whole)}, the plain GPT's {sorted(want)}"
    bad = next((k for k in want if not _bits_equal(whole[k], want[k])), None)
    return "" if bad is None else f"initial slices joined: {bad!r} is not GPT(seed={SEED})'s"


def _count_check(numel: int, closed_form: int, cfg, m: int, n: int) -> str:
    """'' if the slice's parameter count and tp_num_params's closed form are both the count of
    the plain GPT's parameters cut for m (tied head once); else the three counts."""
    want = sum(cut(v, split_of(k), m, n).size for k, v in _whole_init(cfg).items())
    if numel == closed_form == want:
        return ""
    return f"the slice has {numel} parameters, tp_num_params {closed_form}, the cut GPT {want}"


class _Without:
    """The engine's counter without the records of the checks' own gathers (gather_state and
    state_digest after a step are collectives at stage 3, counted in the next step): what
    traffic_of_step reads of it."""

    def __init__(self, counter, reads: set[int]):
        self.counter, self.reads = counter, reads

    def of_step(self, step: int, kind: str = "model"):
        return [r for r in self.counter.of_step(step, kind) if id(r) not in self.reads]


def run_cell(rank: int, world: int, cell: MPCell) -> dict:
    """One rank's part of a cell: per step its digest, norm and first mismatch ('' if none)."""
    plant = {"p_a_order": _plant_p_a_order, "tp_scale": _plant_tp_scale}.get(cell.plant)
    undo = plant(cell.mp) if plant else None
    try:
        return _run(cell)
    finally:
        if undo:
            undo()


def _run(cell: MPCell) -> dict:
    import torch.distributed as dist

    from reference.mp import mp_train_step
    from reference.step import init_state, working_copy
    from zero.config import TORCH_DTYPES
    from zero.mp import tp_num_params  # under test: checked in _count_check
    from zero.workloads.models import gpt_microbatches

    from . import expect as E
    from .harness import check_reported, state_digest

    dp, mp = cell.dp, cell.mp
    g, model, init, zcfg, eng = setup(
        dp, mp, cell.stage, cell.precision, from_gpt=cell.from_gpt, **cell.options()
    )
    if cell.plant == "double":  # the replicated parameters counted on every MP rank
        eng.mp.rule = lambda name: True
    spec, rcfg = E.reference_spec(model, zcfg), E.reference_step_config(zcfg, dp)
    every_init, specs = [None] * mp, [None] * mp
    dist.all_gather_object(every_init, init, group=g.mp_group)
    dist.all_gather_object(specs, spec, group=g.mp_group)
    states = [init_state(x, s, rcfg) for x, s in zip(every_init, specs)]
    first = _start_check(every_init, model.cfg)
    k, blocks = M // dp, model.cfg.n_layer
    ckpt = blocks if zcfg.activation_checkpointing else 0
    want_mp = E.expected_mp_traffic(
        model.cfg, BATCH, mp, k, checkpointed=ckpt, p_a=cell.p_a != "off"
    )
    x_part = math.ceil(BATCH * model.cfg.block_size * model.cfg.n_embd / mp)
    steps, reads = [], set()
    for step in range(cell.steps):
        batches = gpt_microbatches(model.cfg, seed=1, data_step=step, count=M, batch_size=BATCH)
        scale = None if states[0].scaler is None else states[0].scaler.scale
        working = working_copy(states[g.m], rcfg)
        losses, grads = reference_grads(
            g, model.cfg, working, batches, TORCH_DTYPES[cell.precision], scale
        )
        states, info = mp_train_step(states, grads, specs, rcfg, counts)
        for i in range(k):
            _, loss = eng(*batches[i * dp + g.d])  # micro-batch j = i·N_d + d
            eng.backward(loss)
        res = eng.step()
        before = len(eng.counter.records)
        want = states[g.m]
        why = check_reported(step, eng, res, want, info, losses, _same_bits)
        master, opt = eng.gather_state()
        for n in spec.names:
            ours = [("master", master[n])] + [(key, opt[n][key]) for key in sorted(want.opt[n])]
            for key, got in ours:
                ref = want.master[n] if key == "master" else want.opt[n][key]
                if not why and not np.array_equal(got.numpy().view(np.uint32), ref.view(np.uint32)):
                    why = f"step {step}: {key} of {n!r} differs from reference/mp.py"
        c = _Without(eng.counter, reads)
        got_mp = sorted((r.op, r.phase, r.elements) for r in c.of_step(step, "mp"))
        control = [(r.op, r.elements) for r in c.of_step(step, "control") if r.phase == "mp_step"]
        moved = sorted((r.phase, r.elements) for r in c.of_step(step, "offload"))
        want_moved = sorted(
            ([("p_a_down", x_part), ("p_a_up", x_part)] * blocks * k if cell.p_a == "cpu" else [])
            + E.expected_offload_copies(zcfg, spec, dp, skipped=info.skipped)
        )
        checks = (
            E.first_difference(
                "traffic", E.traffic_of_step(c, step),
                E.expected_traffic(zcfg, spec, dp, g.d, forward=True, skipped=info.skipped),
            ),
            "" if got_mp == want_mp else f"mp traffic: engine {got_mp}, expected {want_mp}",
            "" if control == [("all_gather", (mp - 1) * (2 + len(spec.names)))]
            else f"mp control {control}",
            "" if moved == want_moved else f"host copies: {moved}, expected {want_moved}",
        )  # fmt: skip
        why = why or next((f"step {step}: {w}" for w in checks if w), "")
        first = first or why
        clipped = info.norm is not None and float(info.norm) > CLIP
        steps.append({"digest": state_digest(eng, res), "norm": res.norm, "clipped": clipped})
        reads = {id(r) for r in eng.counter.records[before:]}  # this check's gathers
    first = first or _count_check(spec.numel, tp_num_params(model.cfg, mp), model.cfg, g.m, mp)
    arena = eng.activation_arena  # M_D: one slot per block of ⌈X/N_m⌉ (P_a) or X elements
    if not first and arena is not None:
        x = BATCH * model.cfg.block_size * model.cfg.n_embd
        size = E.arena_span(x_part if cell.p_a != "off" else x, cell.precision)
        if (arena.nbytes, arena.misses) != (blocks * size, 0):
            first = (
                f"checkpoint arena {arena.nbytes} B ({arena.misses} misses), want {blocks * size}"
            )
    got = {k: v for k, v in eng.memory_report().items() if k != "comm_buffers"}
    want_mem = E.expected_memory(zcfg, spec, dp)
    if not first and {k: got.get(k) for k in want_mem} != want_mem:
        first = f"memory_report {got}, expected {want_mem}"
    return {"d": g.d, "m": g.m, "steps": steps, "first": first}


def run_cells(rank: int, world: int, cells: list[MPCell]) -> list[dict]:
    from .harness import each_cell  # here: the module stays light to import

    return each_cell(run_cell, rank, world, cells)


def row(cell: MPCell, per_rank: list[dict]) -> dict:
    """One cell's report row; passed only if every rank passed and the ranks of one MP index
    hold one digest per step (the DP group's ranks gather one full state)."""
    config = asdict(cell)
    err = next((r["error"] for r in per_rank if "error" in r), "")
    if err:
        return {"config": config, "label": cell.label, "passed": False, "first_failure": err}
    first = next((f"rank {i}: {r['first']}" for i, r in enumerate(per_rank) if r["first"]), "")
    digests: dict[int, list] = {}
    for r in per_rank:
        mine = [s["digest"] for s in r["steps"]]
        if digests.setdefault(r["m"], mine) != mine:
            first = first or f"the DP ranks of m={r['m']} end in different digests"
    lead = per_rank[0]["steps"]
    return {"config": config, "label": cell.label, "passed": not first, "first_failure": first,
            "digests": [digests[m] for m in sorted(digests)],
            "clipped": [s["clipped"] for s in lead],
            "norms": [s["norm"] for s in lead]}  # fmt: skip


def quick_cells() -> list[MPCell]:
    """Stages 0 and 3 on each mesh (1 and 2 once each), fp32 (the stage-1 cell cuts its slice
    from the whole GPT: the same digests as the built ones); two bf16 cells and two fp16 cells
    (loss scaling: the first step overflows and is skipped on every rank); P_a and P_a+cpu at
    stage 3 on (2, 2), each bitwise equal to the same cell without P_a; optimizer offload (fp16,
    stage 1) and P_a in the M_D arena (bf16, stage 3) on (2, 2)."""
    plan = [(1, 2, 0), (1, 2, 1), (1, 2, 3), (2, 2, 0), (2, 2, 3), (2, 1, 0), (2, 1, 2), (2, 1, 3)]
    cells = [MPCell(dp=d, mp=m, stage=s, from_gpt=(d, m, s) == (1, 2, 1)) for d, m, s in plan]
    cells += [
        MPCell(dp=2, mp=2, stage=2, precision="bf16"),
        MPCell(dp=1, mp=2, stage=3, precision="bf16"),
        MPCell(dp=1, mp=2, stage=0, precision="fp16"),
        MPCell(dp=2, mp=2, stage=3, precision="fp16"),
    ]
    cells += [MPCell(dp=2, mp=2, stage=3, p_a=p) for p in ("on", "cpu")]
    return cells + [
        MPCell(dp=2, mp=2, stage=1, precision="fp16", extra=("offload_optimizer",)),
        MPCell(dp=2, mp=2, stage=3, precision="bf16", p_a="on", extra=("contiguous_memory",)),
    ]


def complete_cells() -> list[MPCell]:
    """Every stage × fp32/bf16/fp16 × (N_d, N_m) ∈ {(1,2), (2,2), (2,1), (1,4)} × P_a off/on
    (at N_m = 1, P_a keeps the whole checkpoint: the plain activation checkpointing); then each
    of EXTRAS with P_a, bf16, every stage on (2, 2) and (1, 4)."""
    plain = [
        MPCell(dp=d, mp=m, stage=s, precision=p, p_a=a)
        for d, m in ((1, 2), (2, 2), (2, 1), (1, 4))
        for s in range(4)
        for p in ("fp32", "bf16", "fp16")
        for a in ("off", "on")
    ]
    return plain + [
        MPCell(dp=d, mp=m, stage=s, precision="bf16", p_a="on", extra=(x,))
        for d, m in ((2, 2), (1, 4))
        for s in range(4)
        for x in EXTRAS
    ]


def invariance(rows: list[dict]) -> list[dict]:
    """Cells of one (N_m, precision, steps) without a plant must hold one digest per MP index
    and step over N_d, stages and P_a on/off."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        c = r["config"]
        if c["plant"] is None and "digests" in r:
            groups.setdefault((c["mp"], c["precision"], c["steps"]), []).append(r)
    out = []
    for (mp, precision, _), rs in groups.items():
        passed = len({str(r["digests"]) for r in rs}) == 1
        out.append({"mp": mp, "precision": precision, "cells": len(rs), "passed": passed,
                    "dp": sorted({r["config"]["dp"] for r in rs}),
                    "stages": sorted({r["config"]["stage"] for r in rs})})  # fmt: skip
    return out


def run_section(cells: list[MPCell], *, timeout_s: float = 900, say=print):
    """(rows, invariance rows) of the MP section; cells batched per world size."""
    from .run import section_rows

    def show(r):
        clip = "".join("c" if x else "." for x in r.get("clipped", []))
        verdict = "PASS" if r["passed"] else "FAIL " + r["first_failure"]
        say(f"  {r['label']:<48} clip {clip:<4} {verdict}")

    say("model parallelism (engine = reference/mp.py bitwise; traffic, memory; clip c/.):")
    rows = section_rows(cells, run_cells, row, name="mp", timeout_s=timeout_s, say=say, show=show)
    ordered = [rows[i] for i in sorted(rows)]
    inv = invariance(ordered)
    for r in inv:
        mark = "PASS" if r["passed"] else "FAIL digests differ"
        say(f"  N_m={r['mp']} {r['precision']}: one digest per m over N_d {r['dp']}, stages "
            f"{r['stages']} and P_a ({r['cells']} cells)  {mark}")  # fmt: skip
    return ordered, inv


def markdown(rows: list[dict], inv: list[dict]) -> str:
    lines = ["", "## Model-parallel cells", "", "| cell | clipped | passed | first failure |"]
    lines.append("|---|---|---|---|")
    for r in rows:
        clip = "".join("c" if x else "." for x in r.get("clipped", []))
        lines.append(f"| {r['label']} | {clip} | {r['passed']} | {r['first_failure']} |")
    lines += [
        "",
        "| N_m | precision | N_d | stages | cells | one digest per m |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['mp']} | {r['precision']} | {r['dp']} | {r['stages']} | {r['cells']} | "
              f"{r['passed']} |" for r in inv]  # fmt: skip
    return "\n".join(lines) + "\n"
