"""N_m > 1 against N_m = 1: every tensor-parallel operator within its derived bound.

Whole models at two N_m have no derivable bound (docs/design.md §6: a difference of one rounding
changes every later rounding), so the comparison is made in lock-step over operators. The
N_m = 1 GPT runs forward and backward once, keeping each split operator's real input and real
output gradient; every MP rank runs its slice of that operator on the same input and gradient:
  - outputs and input gradients within verify/mp/bounds.py's bound (split_dot_bound where the
    inner dimension is split, so a sum over N_m partials enters: the row-parallel forward, the
    column-parallel input gradient; any_order_bound elsewhere; xent_bounds for the cross
    entropy), as the worst ratio error / bound, which must be <= 1;
  - weight gradients within any_order_bound of the N_m = 1 ones' slices (the same b·s products
    per element, but a matrix product of another width may order them otherwise: at N_m = 2
    they are bitwise the slices here, at N_m = 4 some are not; the row reports how many), the
    embedding's values equal.
The N_m = 1 GPT does not keep its own start values (zero biases, unit LayerNorm scales): every
parameter is redrawn first (redraw), so that a bias or a scale applied the wrong number of times
changes the results.
A cell (LockCell) is one N_m in one mode (deterministic: fixed-order sums; fast: the backend's
all-reduce). Plants: PLANTS. Legend: N = N_m, b·s tokens of width h, V vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH = 2
CHECKS = ("col_fwd", "col_dx", "row_fwd", "row_dx", "dw", "db", "xent_loss", "xent_grad")
PLANTS = ("no_sum", "mean", "bias_every_rank")
"""Engine bugs the section must catch: the g / f all-reduce left out (each rank keeps its
partial); the sum scaled by 1/N_m; the row-parallel bias added before g's sum, on each of the
N_m ranks (N_m·b: invisible while biases are zero, see redraw)."""
INIT_SEED = 17
INIT_SCALE = 0.2
"""redraw's values: N(0, INIT_SCALE²) from INIT_SEED for every parameter. 0.2 makes a bias as
large as the sums it is added to (a linear over 32 inputs of size about 1 gives about 0.2·√32),
so N_m·b is far outside any rounding bound, while the logits stay far from saturation."""


@dataclass(frozen=True, kw_only=True)
class LockCell:
    mp: int
    deterministic: bool = True
    plant: str | None = None

    @property
    def world_size(self) -> int:
        return self.mp

    @property
    def label(self) -> str:
        mode = "deterministic" if self.deterministic else "fast"
        plant = f" plant={self.plant}" if self.plant else ""
        return f"N_m={self.mp} vs N_m=1, operators, {mode}{plant}"


def _plant(which: str | None):
    """Replace zero.mp.tp_comm.reduce_sum or zero.mp.layers.row_linear for a plant; returns
    the undo (pool workers outlive a cell: the next one must run the real code)."""
    import torch.nn.functional as F

    import zero.mp.layers as layers
    import zero.mp.tp_comm as mpc

    real, real_row = mpc.reduce_sum, layers.row_linear
    if which == "no_sum":
        mpc.reduce_sum = lambda x, *, ctx, phase: x.clone()
    elif which == "mean":
        mpc.reduce_sum = lambda x, *, ctx, phase: real(x, ctx=ctx, phase=phase) / ctx.size
    elif which == "bias_every_rank":
        layers.row_linear = lambda x, w, b, mp: mpc.reduce_from_mp(F.linear(x, w, b), mp)

    def undo():
        mpc.reduce_sum, layers.row_linear = real, real_row

    return undo


def redraw(model) -> None:
    """Every parameter of `model` (the tied head once; biases and LayerNorms' scales and shifts
    included) redrawn N(0, INIT_SCALE²) from INIT_SEED, the same values on every rank."""
    import torch

    g = torch.Generator().manual_seed(INIT_SEED)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(INIT_SCALE * torch.randn(p.shape, generator=g))


def _capture(full, idx, tgt):
    """Each split operator's input, output and output gradient in the N_m = 1 model, by the
    name of its weight ("transformer.h.0.attn.c_attn.weight", ..., "transformer.wte.weight")."""
    import torch.nn as nn

    from zero.mp import split_rule

    rec = {}

    def keep(name):
        def hook(_mod, args, out):  # returns None: a forward hook's value would replace out
            rec[name] = dict(x=args[0].detach().clone(), y=out.detach().clone())
            out.register_hook(lambda g: rec[name].__setitem__("gout", g.detach().clone()))

        return hook

    mods = {f"{k}.weight": mod for k, mod in full.named_modules() if isinstance(mod, nn.Linear)}
    mods = {k: mod for k, mod in mods.items() if split_rule(k) is not None}
    mods["transformer.wte.weight"] = full.transformer.wte
    hooks = [mod.register_forward_hook(keep(name)) for name, mod in mods.items()]
    full(idx, tgt)[1].backward()
    for h in hooks:
        h.remove()
    return rec, mods


def _cut_last(t, rule, mp):
    """Rank m's part of a tensor's last dimension under a weight's split rule."""
    import torch

    if rule == "qkv":
        return torch.cat([c.chunk(mp.size, -1)[mp.rank] for c in t.chunk(3, -1)], -1)
    return t.chunk(mp.size, -1)[mp.rank]


def _cut(p, name, cfg, mp):
    from zero.mp import split_state

    return split_state({name: p}, cfg, m=mp.rank, n=mp.size)[name]


def _worst(out, key, diff, bound):
    from .bounds import ratio

    out[key] = max(out.get(key, 0.0), ratio(diff, bound))


def _linear(name, mod, cap, cfg, mp, out):
    """One split linear in lock-step: forward, input gradient, weight and bias gradients."""
    import torch
    import torch.nn.functional as F

    from zero.mp import layers, split_rule, split_state

    from .bounds import any_order_bound, as_bits, split_dot_bound

    n, rule, x, gy = mp.size, split_rule(name), cap["x"], cap["gout"]
    w, b = mod.weight.detach(), None if mod.bias is None else mod.bias.detach()
    bias_name = name[:-6] + "bias"
    cut = split_state({name: w} | ({} if b is None else {bias_name: b}), cfg, m=mp.rank, n=n)
    wm, bm = cut[name], cut.get(bias_name)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    b1 = None if b is None else b.clone().requires_grad_()
    F.linear(x1, w1, b1).backward(gy)
    wt = wm.clone().requires_grad_()
    bt = None if bm is None else bm.clone().requires_grad_()
    tokens = x.reshape(-1, x.shape[-1]).shape[0]
    if rule == "cols":  # row-parallel: input features split, one g sum, bias added once
        xt = x.chunk(n, -1)[mp.rank].clone().requires_grad_()
        yt = layers.row_linear(xt, wt, bt, mp)
        yt.backward(gy)
        _worst(out, "row_fwd", yt - cap["y"], split_dot_bound(x, w, n=n, bias=b))
        _worst(out, "row_dx", xt.grad - x1.grad.chunk(n, -1)[mp.rank], any_order_bound(gy, wm.T))
        gy_m, x_m = gy, xt.detach()
    else:  # column-parallel: output features split, f's sum in backward
        xt = x.clone().requires_grad_()
        yt = layers.column_linear(xt, wt, bt, mp)
        gy_m = _cut_last(gy, rule, mp).contiguous()
        yt.backward(gy_m)
        _worst(out, "col_fwd", yt - _cut_last(cap["y"], rule, mp), any_order_bound(x, wm, bias=bm))
        _worst(out, "col_dx", xt.grad - x1.grad, split_dot_bound(gy, w.T, n=n))
        x_m = x
    same = torch.equal(as_bits(wt.grad), as_bits(_cut(w1.grad, name, cfg, mp)))
    out["bitwise"] = out.get("bitwise", 0) + int(same)
    out["weights"] = out.get("weights", 0) + 1
    # weight gradient: gy_mᵀ·x over the b·s tokens, the same terms in either model
    g2 = gy_m.reshape(tokens, -1).T
    dw = wt.grad - _cut(w1.grad, name, cfg, mp)
    _worst(out, "dw", dw, any_order_bound(g2, x_m.reshape(tokens, -1).T))
    if bt is not None:  # Σ over the b·s tokens of gy
        db = bt.grad - _cut(b1.grad, bias_name, cfg, mp)
        _worst(out, "db", db, any_order_bound(g2, torch.ones(1, tokens)).squeeze(-1))


def run_cell(rank: int, world: int, cell: LockCell) -> dict:
    """One MP rank's worst ratio per check over every split operator of the model (each
    block's four linears, the tied head, the embedding, the cross entropy)."""
    undo = _plant(cell.plant)
    try:
        return _run(cell)
    finally:
        undo()


def _run(cell: LockCell) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from zero.collectives import CommCounter
    from zero.mp import MPContext, layers
    from zero.workloads.models import GPT, GPTConfig, gpt_microbatches

    from .bounds import xent_bounds
    from .cells import mesh_groups

    cfg = GPTConfig(**CFG)
    full = GPT(cfg, seed=3)
    redraw(full)
    mp = MPContext.of(
        mesh_groups(1, cell.mp).mp_group, counter=CommCounter(), deterministic=cell.deterministic
    )
    batches = gpt_microbatches(cfg, seed=0, data_step=0, count=2, batch_size=BATCH)
    n, m, out = mp.size, mp.rank, {"embed_equal": True}
    for idx, tgt in batches:
        cap, mods = _capture(full, idx, tgt)
        for name, mod in mods.items():
            if isinstance(mod, nn.Linear):
                _linear(name, mod, cap[name], cfg, mp, out)
        # cross entropy on the N_m = 1 logits
        z = cap["lm_head.weight"]["y"].view(-1, cfg.vocab_size)
        z1, zt = z.clone().requires_grad_(), z.chunk(n, -1)[m].clone().requires_grad_()
        F.cross_entropy(z1, tgt.reshape(-1)).backward()
        lt = layers.vocab_cross_entropy(zt, tgt.reshape(-1), mp)
        lt.backward()
        lb, gb = xent_bounds(z, tgt.reshape(-1), n=n)
        _worst(out, "xent_loss", lt - F.cross_entropy(z, tgt.reshape(-1)), lb)
        _worst(out, "xent_grad", zt.grad - z1.grad.chunk(n, -1)[m], gb.chunk(n, -1)[m])
        # embedding: one rank holds each row, the others add +0 (values equal; docs §6)
        emb, w = cap["transformer.wte.weight"], full.transformer.wte.weight.detach()
        we, w1 = w.chunk(n)[m].clone().requires_grad_(), w.clone().requires_grad_()
        e_t = layers.vocab_embedding(idx, we, mp)
        e_t.backward(emb["gout"])
        F.embedding(idx, w1).backward(emb["gout"])
        same = bool(torch.equal(e_t, emb["y"]) and torch.equal(we.grad, w1.grad.chunk(n)[m]))
        out["embed_equal"] = out["embed_equal"] and same
    return out


def run_cells(rank: int, world: int, cells: list[LockCell]) -> list[dict]:
    from ..checks.harness import each_cell

    return each_cell(run_cell, rank, world, cells)


def row(cell: LockCell, per_rank: list[dict]) -> dict:
    """One cell's report row: the worst ratio per check over the MP ranks and how many weight
    gradients are bitwise the slices; passed when every ratio is <= 1 (the derived bound) and
    the embedding's values are equal."""
    err = next((r["error"] for r in per_rank if "error" in r), "")
    out = {"config": asdict(cell), "label": cell.label}
    if err:
        return out | {"passed": False, "first_failure": err}
    ratios = {k: max(r.get(k, 0.0) for r in per_rank) for k in CHECKS}
    exact = [sum(r[k] for r in per_rank) for k in ("bitwise", "weights")]
    over = [f"{k} {v:.3g}" for k, v in ratios.items() if not v <= 1.0]
    first = f"error/bound over 1: {', '.join(over)}" if over else ""
    if not first and not all(r["embed_equal"] for r in per_rank):
        first = "the embedding's values differ"
    return out | {"passed": not first, "first_failure": first, "ratios": ratios,
                  "bitwise_weight_grads": exact}  # fmt: skip


def quick_cells() -> list[LockCell]:
    return [LockCell(mp=2, deterministic=d) for d in (True, False)]


def complete_cells() -> list[LockCell]:
    return [LockCell(mp=n, deterministic=d) for n in (2, 4) for d in (True, False)]


def run_section(cells: list[LockCell], *, timeout_s: float = 900, say=print) -> list[dict]:
    from ..cells.run import section_rows

    def show(r):
        worst = max(r.get("ratios", {}).values(), default=float("nan"))
        verdict = "PASS" if r["passed"] else "FAIL " + r["first_failure"]
        say(f"  {r['label']:<48} worst error/bound {worst:.3f}  {verdict}")

    say("model parallelism against N_m = 1 (every operator within its derived bound):")
    rows = section_rows(
        cells, run_cells, row, name="operators", timeout_s=timeout_s, say=say, show=show
    )
    return [rows[i] for i in sorted(rows)]


def markdown(rows: list[dict]) -> str:
    lines = ["", "## Model parallelism against N_m = 1", ""]
    lines += ["| cell | " + " | ".join(CHECKS) + " | passed |", "|---" * (len(CHECKS) + 2) + "|"]
    for r in rows:
        ratios = r.get("ratios", {})
        cols = " | ".join(f"{ratios[k]:.3f}" if k in ratios else "" for k in CHECKS)
        lines.append(f"| {r['label']} | {cols} | {r['passed']} |")
    return "\n".join(lines) + "\n"
