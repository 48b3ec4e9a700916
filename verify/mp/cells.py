"""verify's model-parallel section: ZeRO inside the DP group of each tensor-parallel slice.

A cell (MPCell) trains the TP GPT (zero/mp/gpt.py) on N_d·N_m gloo ranks for S steps with
clipping active. The reference side is reference/mp.py's step on every slice, fed with the MP
model's micro-batch gradients computed without zero/mp ([Note: the cells' reference gradients]):
the slices' working copies joined into the plain GPT's, all M micro-batches through the plain GPT
with its split operators evaluated slice by slice, the gradients cut per MP index. First, the
slices' initial values joined must be GPT(seed)'s bits. Per step and rank:
  - the master and optimizer states bitwise = the reference's slice; the reported loss (within
    loss_bound), norm (bits), skip and step counts (verify.checks.harness.check_reported);
  - the counted traffic: kind "model" = verify.checks.expect.expected_traffic for the slice in the
  DP
    group, kind "mp" = expected_mp_traffic (recomputation and P_a included), one MP control
    all-gather of (N_m-1)·(2 + parameters) float64 values, and the host copies of P_a+cpu and
    of offload_optimizer (verify.checks.expect.expected_offload_copies);
  - after the last step, memory_report() = verify.checks.expect.expected_memory for the slice, and
  its
    parameter count (and tp_num_params's) = the plain GPT's parameters cut for m.
Across cells: at fixed (N_m, precision) one digest per MP index and step over N_d, stages and
P_a on/off (world-size invariance over DP; P_a changes no bit). docs/verification.md,
"Model-parallel cells". Legend: N_d, N_m, (d, m), M, k = M/N_d, L blocks, X = b·s·h.

Here: the reference side (SlicedGPT, reference_grads), the planted engine bugs, and the runner
(run_cell, run_section). In parts beside it: the model, step and cells (verify/mp/plan.py), the
split rule (verify/mp/split.py), the per-rank checks (verify/mp/checks.py), the rows and tables
(verify/mp/report.py); their public names are importable from here too.
"""

from __future__ import annotations

import functools
import struct

import torch
import torch.nn.functional as F

from reference.tree import tree_sum

from .checks import Without, arena_check, memory_check, state_check, traffic_check
from .plan import (  # noqa: F401  (the plan, the rows and the split rule: importable from here)
    BATCH,
    CFG,
    CHUNK,
    CLIP,
    EXTRAS,
    PLANTS,
    SEED,
    M,
    MPCell,
    complete_cells,
    quick_cells,
)
from .report import invariance, markdown, row  # noqa: F401
from .split import COLUMN, ROW, bits_equal, counts, cut, join, join_state, split_of  # noqa: F401

_GROUPS: dict = {}  # per worker process: the mesh's groups, created once per (dp, mp)
_SLICED: dict = {}  # per worker process: one SlicedGPT per (config, N_m)


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
# rule (split_of, stated again from the layers' roles in verify/mp/split.py), the plain GPT of
# zero/workloads/models.py (the input definition) runs each micro-batch, and the whole gradients
# are cut back per MP index. The plain GPT's own products would sum the split dimension in
# another order (one dot product where the slices add N_m partials; F.cross_entropy), and two
# whole models summing in two orders have no derivable bound (design §6.6; measured: the plain
# GPT's gradient differs from the slices' in the last bits even at N_m = 1). So its split
# operators, and only those, are evaluated as design §6.2 states them: each slice's product alone,
# the partials added by reference/tree.py's T in m order (deterministic mode), the cross entropy
# from the logits' slices. LayerNorms, attention, GELU, residuals and the forward itself are the
# plain GPT's code. The gradients are then the slices' bits, and the engine is compared bitwise.


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

    from verify.checks.harness import microbatch_loss_and_grads

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
    bad = next((k for k in want if not bits_equal(whole[k], want[k])), None)
    return "" if bad is None else f"initial slices joined: {bad!r} is not GPT(seed={SEED})'s"


def _count_check(numel: int, cfg, m: int, n: int) -> str:
    """'' if the slice's parameter count and tp_num_params's closed form are both the count of
    the plain GPT's parameters cut for m (tied head once); else the three counts."""
    from zero.mp import tp_num_params  # under test

    closed_form = tp_num_params(cfg, n)
    want = sum(cut(v, split_of(k), m, n).size for k, v in _whole_init(cfg).items())
    if numel == closed_form == want:
        return ""
    return f"the slice has {numel} parameters, tp_num_params {closed_form}, the cut GPT {want}"


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
    from zero.workloads.models import gpt_microbatches

    from ..checks import expect as E
    from ..checks.harness import check_reported, state_digest

    dp, mp = cell.dp, cell.mp
    g, model, init, zcfg, eng = setup(
        dp, mp, cell.stage, cell.precision, from_gpt=cell.from_gpt, **cell.options()
    )
    if cell.plant == "double":  # the replicated parameters counted on every MP rank
        eng.mp.rule = lambda name: True
    cfg, spec, rcfg = model.cfg, E.reference_spec(model, zcfg), E.reference_step_config(zcfg, dp)
    every_init, specs = [None] * mp, [None] * mp
    dist.all_gather_object(every_init, init, group=g.mp_group)
    dist.all_gather_object(specs, spec, group=g.mp_group)
    states = [init_state(x, s, rcfg) for x, s in zip(every_init, specs)]
    first = _start_check(every_init, cfg)
    steps, reads = [], set()
    for step in range(cell.steps):
        batches = gpt_microbatches(cfg, seed=1, data_step=step, count=M, batch_size=BATCH)
        scale = None if states[0].scaler is None else states[0].scaler.scale
        working = working_copy(states[g.m], rcfg)
        dtype = TORCH_DTYPES[cell.precision]
        losses, grads = reference_grads(g, cfg, working, batches, dtype, scale)
        states, info = mp_train_step(states, grads, specs, rcfg, counts)
        for i in range(M // dp):
            _, loss = eng(*batches[i * dp + g.d])  # micro-batch j = i·N_d + d
            eng.backward(loss)
        res = eng.step()
        before = len(eng.counter.records)
        why = check_reported(step, eng, res, states[g.m], info, losses, _same_bits)
        bits = state_check(step, eng, spec, states[g.m])  # gather_state on every rank
        counter = Without(eng.counter, reads)
        why = why or bits or traffic_check(cell, cfg, zcfg, spec, g.d, counter, step, info.skipped)
        first = first or why
        clipped = info.norm is not None and float(info.norm) > CLIP
        steps.append({"digest": state_digest(eng, res), "norm": res.norm, "clipped": clipped})
        reads = {id(r) for r in eng.counter.records[before:]}  # this check's gathers
    first = first or _count_check(spec.numel, cfg, g.m, mp) or arena_check(cell, eng, cfg)
    memory = memory_check(eng, zcfg, spec, dp)  # memory_report on every rank
    return {"d": g.d, "m": g.m, "steps": steps, "first": first or memory}


def run_cells(rank: int, world: int, cells: list[MPCell]) -> list[dict]:
    from ..checks.harness import each_cell

    return each_cell(run_cell, rank, world, cells)


def run_section(cells: list[MPCell], *, timeout_s: float = 900, say=print):
    """(rows, invariance rows) of the MP section; cells batched per world size."""
    from ..cells.run import section_rows

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
