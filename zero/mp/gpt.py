"""The project's GPT (zero/workloads/models.py) split over N_m ranks, Megatron-style, and joined
back.

Legend (zero/workloads/models.py): V vocab, h n_embd, H n_head, N = N_m, m the MP index.

Which parameters are split (SPLITS; docs/design.md §6): the token embedding and its tied head
by vocabulary rows, QKV by heads (rows m of each of q, k and v), MLP-in by output rows, the two
output projections by input columns. Everything else (position embedding, LayerNorms, the
output projections' biases) is replicated: every MP rank holds the same values.

Names are GPT's, so state dicts line up: ``split_state(full, cfg, m=m, n=N)`` cuts rank m's slices
and ``join_states([s_0, ..., s_{N-1}], cfg)`` undoes it; both are exact copies, so a TPGPT starts
from the N_m = 1 model's bits (``TPGPT.from_gpt``) and a checkpoint of slices consolidates to the
plain model's bits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..workloads.models import GPT, GPTConfig, fail, init_value
from .layers import column_linear, row_linear, vocab_cross_entropy, vocab_embedding
from .tp_comm import MPContext

SPLITS = {
    "transformer.wte.weight": "rows",
    "lm_head.weight": "rows",  # the tied head: state_dict lists it under both names
    "attn.c_attn.weight": "qkv",
    "attn.c_attn.bias": "qkv",
    "attn.c_proj.weight": "cols",
    "mlp.c_fc.weight": "rows",
    "mlp.c_fc.bias": "rows",
    "mlp.c_proj.weight": "cols",
}
"""Name suffix -> how the parameter is split: "rows" (dim 0 in N equal blocks), "cols" (dim 1),
"qkv" (dim 0 as three blocks q, k, v, each cut in N). Any other parameter is replicated."""


def split_rule(name: str) -> str | None:
    """How parameter `name` of a GPT is split across the MP group; None when replicated."""
    return next((rule for suffix, rule in SPLITS.items() if name.endswith(suffix)), None)


def counts_in_norm(name: str, m: int) -> bool:
    """Whether MP rank m contributes parameter `name` to the global gradient norm: split
    parameters on every rank (each holds a distinct slice), replicated ones on m = 0 only, so
    the MP sum of the ranks' squares counts each element of the model once (docs/design.md §6)."""
    return split_rule(name) is not None or m == 0


def tp_num_params(cfg: GPTConfig, n: int) -> int:
    """Ψ_m, the parameter count of one MP rank's TPGPT slice (the tied head once): per block
    12h²/N + 7h/N (QKV and MLP-in biases) + 2h (the output projections' replicated biases) +
    (2 + 2)h (two LayerNorms), then V·h/N + S·h + 2h (biases as cfg.bias says). At N = 1 it is
    zero.workloads.models.gpt_num_params."""
    check_split(cfg, n)
    h, b = cfg.n_embd, 1 if cfg.bias else 0
    block = 12 * h * h // n + b * 7 * h // n + b * 2 * h + (2 + 2 * b) * h
    return cfg.n_layer * block + cfg.vocab_size * h // n + cfg.block_size * h + (1 + b) * h


def check_split(cfg: GPTConfig, n: int) -> None:
    """Refuse a GPT that N_m = n cannot split exactly (ValueError naming the field)."""
    if cfg.n_head % n:
        raise fail("n_head", cfg.n_head, f"a multiple of mp={n} (heads are split whole)")
    if cfg.vocab_size % n:
        raise fail("vocab_size", cfg.vocab_size, f"a multiple of mp={n} (pad the vocabulary)")
    if cfg.dropout != 0.0:
        # dropout inside a split layer would need per-slice RNG streams (Megatron's tracker)
        # to reproduce the N_m = 1 model's masks; refused rather than silently different
        raise fail("dropout", cfg.dropout, "0.0 with model parallelism")


def cut_part(t: torch.Tensor, rule: str | None, m: int, n: int) -> torch.Tensor:
    """Slice m of n of a whole tensor split by `rule` (a SPLITS value, None: replicated); a copy."""
    if rule is None:
        return t.clone()
    if rule == "qkv":
        return torch.cat([c.chunk(n, 0)[m] for c in t.chunk(3, 0)]).clone()
    return t.chunk(n, 0 if rule == "rows" else 1)[m].clone()


def glue_parts(parts: list[torch.Tensor], rule: str | None) -> torch.Tensor:
    """The whole tensor from its n slices in m order (cut_part's inverse); replicated: slice 0."""
    if rule is None:
        return parts[0].clone()
    if rule == "qkv":
        thirds = [p.chunk(3, 0) for p in parts]
        return torch.cat([torch.cat([t[j] for t in thirds]) for j in range(3)])
    return torch.cat(parts, 0 if rule == "rows" else 1)


def split_state(full: dict, cfg: GPTConfig, *, m: int, n: int) -> dict:
    """MP rank m's slices of a GPT state dict (exact copies); replicated entries copied whole."""
    check_split(cfg, n)
    return {k: cut_part(v, split_rule(k), m, n) for k, v in full.items()}


def join_states(states: list[dict], cfg: GPTConfig) -> dict:
    """The plain GPT state dict from the N ranks' slices, in m order (exact). Replicated
    entries are taken from rank 0 after checking every rank holds the same bits."""
    check_split(cfg, len(states))
    out = {}
    for k in states[0]:
        rule = split_rule(k)
        if rule is None and not all(torch.equal(s[k], states[0][k]) for s in states):
            raise ValueError(f"join_states: replicated {k} differs between MP ranks")
        out[k] = glue_parts([s[k] for s in states], rule)
    return out


# Each module keeps the MPContext (a plain attribute, not state) so that forward(x) has the
# signature of its counterpart in zero/workloads/models.py: the engine's unit hooks and activation
# checkpointing wrap a TP block exactly as a plain one.


class TPAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, mp: MPContext):
        super().__init__()
        h, n, self.mp = cfg.n_embd, mp.size, mp
        self.n_head = cfg.n_head // n  # this rank's heads
        self.c_attn = nn.Linear(h, 3 * h // n, bias=cfg.bias, device="meta")
        self.c_proj = nn.Linear(h // n, h, bias=cfg.bias, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        mp = self.mp
        q, k, v = column_linear(x, self.c_attn.weight, self.c_attn.bias, mp).chunk(3, -1)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return row_linear(y, self.c_proj.weight, self.c_proj.bias, mp)


class TPFeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig, mp: MPContext):
        super().__init__()
        h, n, self.mp = cfg.n_embd, mp.size, mp
        self.c_fc = nn.Linear(h, 4 * h // n, bias=cfg.bias, device="meta")
        self.c_proj = nn.Linear(4 * h // n, h, bias=cfg.bias, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.gelu(column_linear(x, self.c_fc.weight, self.c_fc.bias, self.mp))
        return row_linear(a, self.c_proj.weight, self.c_proj.bias, self.mp)


class TPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, mp: MPContext):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, device="meta")
        self.attn = TPAttention(cfg, mp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, device="meta")
        self.mlp = TPFeedForward(cfg, mp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TPGPT(nn.Module):
    """MP rank m's slice of GPT(cfg): same parameter names, split shapes, same forward.

    ``forward(idx, targets)`` returns this rank's logits columns (B, t, V/N) and the mean cross
    entropy (the same value on every MP rank), or None without targets.
    """

    def __init__(self, cfg: GPTConfig, mp: MPContext):
        super().__init__()
        check_split(cfg, mp.size)
        self.cfg, self.mp = cfg, mp
        v, h = cfg.vocab_size // mp.size, cfg.n_embd
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(v, h, device="meta"),
                wpe=nn.Embedding(cfg.block_size, h, device="meta"),
                h=nn.ModuleList(TPBlock(cfg, mp) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(h, bias=cfg.bias, device="meta"),
            )
        )
        self.lm_head = nn.Linear(h, v, bias=False, device="meta")
        # [Note: tied head] in zero/workloads/models.py
        self.lm_head.weight = self.transformer.wte.weight

    @classmethod
    def from_gpt(cls, full: GPT, mp: MPContext) -> TPGPT:
        """Rank mp.rank's slice of `full`, bit for bit (the N_m = 1 model's start values), in
        its dtype and on its device."""
        like = full.transformer.wpe.weight
        model = cls(full.cfg, mp).to(dtype=like.dtype).to_empty(device=like.device)
        model.lm_head.weight = model.transformer.wte.weight  # to_empty unties
        state = split_state(full.state_dict(), full.cfg, m=mp.rank, n=mp.size)
        model.load_state_dict(state)
        return model

    @classmethod
    def build(cls, cfg: GPTConfig, mp: MPContext, *, seed: int | None = 0, device="cpu") -> TPGPT:
        """Rank mp.rank's slice of GPT(cfg, seed=seed) without building the whole model: each
        parameter's full initial value (a pure function of seed and name, zero/materialize.py) is
        drawn alone and cut, so at most one full tensor exists at a time. seed=None leaves the
        values uninitialised (a simulated rank, whose values are meaningless)."""
        model = cls(cfg, mp).to_empty(device=device)
        model.lm_head.weight = model.transformer.wte.weight  # to_empty unties
        if seed is None:
            return model
        plain = GPT(cfg, device="meta")  # the rule and the full shapes, no storage
        with torch.no_grad():
            for name, p in model.named_parameters():
                rule = plain.param_init(name)
                full = init_value(
                    seed, name, plain.get_parameter(name).shape, rule.kind, std=rule.std
                )
                p.copy_(cut_part(full, split_rule(name), mp.rank, mp.size))
        return model

    def unit_names(self) -> list[str]:
        return [f"transformer.h.{i}" for i in range(self.cfg.n_layer)]

    def split_rule(self, name: str) -> str | None:
        """How parameter `name` is split over the MP group (SPLITS; None: replicated): what a
        checkpoint records to join the slices (zero/checkpoint/mpjoin.py)."""
        return split_rule(name)

    def counts_in_norm(self, name: str) -> bool:
        """Whether this rank's `name` enters the global gradient norm (the engine asks:
        zero/mp/step.py); replicated parameters count on m = 0 only."""
        return counts_in_norm(name, self.mp.rank)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise fail("sequence length", t, f"at most block_size={self.cfg.block_size}")
        tr, mp = self.transformer, self.mp
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = vocab_embedding(idx, tr.wte.weight, mp) + tr.wpe(pos)
        for block in tr.h:
            x = block(x)
        logits = column_linear(tr.ln_f(x), self.lm_head.weight, None, mp)
        if targets is None:
            return logits, None
        loss = vocab_cross_entropy(logits.view(b * t, -1), targets.reshape(b * t), mp)
        return logits, loss
