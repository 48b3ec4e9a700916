"""Small real workloads: a nanoGPT-style GPT and a tanh MLP, with counter-based initialisation.

Legend (nanoGPT's names, which the paper's GPT-2-like models share):
    V      vocab_size, the number of token ids
    T      block_size, the longest sequence (context) the model accepts
    L      n_layer, the number of transformer blocks (or of Linear layers in the MLP)
    H      n_head, the attention heads per block
    d      n_embd, the residual width; every head has d / H channels
    B      batch_size, sequences (or samples) per micro-batch
    unit   a module whose parameters form one flat buffer (docs/design.md §3); ``unit_names()``
    lists
           them, and the root unit holds every parameter outside them

Initialisation is zero/materialize.py's ([Note: counter-based init] there).

[Note: tied head] ``GPT.lm_head.weight`` *is* ``transformer.wte.weight`` (one Parameter). It
appears once in ``named_parameters()``, as "transformer.wte.weight", is counted once, and lives
in the root unit. ``Module.to_empty`` replaces each module's parameters separately and so unties
them; ``materialize`` re-ties after it.

Data (docs/design.md §2): micro-batch j of data step s is a pure function of (seed, s, j), never of
the rank, so any rank can produce any micro-batch and a run at any world size sees the same data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..materialize import (  # noqa: F401  (the init API is also reachable beside the models)
    INIT_KINDS,
    INIT_STD,
    ParamInit,
    build_on,
    default_param_init,
    fail,
    generator,
    init_parameters,
    init_value,
    materialize,
    param_init,
    positive_int,
    stable_seed,
)

# ---------------------------------------------------------------------------------------------
# GPT


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A GPT-2-style decoder. The defaults make a ~0.12M-parameter model that steps in ms on CPU."""

    vocab_size: int = 256
    """V: the number of token ids; tokens are integers in [0, V)."""
    block_size: int = 64
    """T: the longest sequence the model accepts (size of the position embedding)."""
    n_layer: int = 2
    """L: transformer blocks; each is one unit."""
    n_head: int = 2
    """H: attention heads per block; must divide n_embd."""
    n_embd: int = 64
    """d: the residual width."""
    dropout: float = 0.0
    """Dropout probability in [0, 1), applied in training mode only (embeddings, attention,
    residual branches). It draws from torch's global RNG, which ZeroEngine's forward seeds from
    (dropout_seed, data step, micro-batch index), never from the rank (docs/design.md §2)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have biases (GPT-2: True)."""

    def __post_init__(self):
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            positive_int(field, getattr(self, field))
        if self.n_embd % self.n_head:
            raise fail("n_embd", self.n_embd, f"a multiple of n_head={self.n_head}")
        if not (
            isinstance(self.dropout, (int, float))
            and not isinstance(self.dropout, bool)
            and 0.0 <= self.dropout < 1.0
        ):
            raise fail("dropout", self.dropout, "a float in [0, 1)")
        if not isinstance(self.bias, bool):
            raise fail("bias", self.bias, "True or False")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, *, device=None):
        super().__init__()
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(d, 3 * d, bias=cfg.bias, device=device)  # q, k, v side by side
        self.c_proj = nn.Linear(d, d, bias=cfg.bias, device=device)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        # (B, T, d) -> (B, H, T, d/H): heads become a batch dimension.
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        # SDPA on CPU gave the same bits on repeated calls, at 1 and 2 threads, and for operands
        # at aligned and unaligned offsets (tests/unit/test_models.py checks the model end to end).
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_drop(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig, *, device=None):
        super().__init__()
        d = cfg.n_embd
        self.c_fc = nn.Linear(d, 4 * d, bias=cfg.bias, device=device)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d, bias=cfg.bias, device=device)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig, *, device=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, device=device)
        self.attn = CausalSelfAttention(cfg, device=device)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, device=device)
        self.mlp = FeedForward(cfg, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style language model with the token embedding tied to the output head.

    ``GPT(cfg, device=d, seed=s)``: on any device but meta, the constructor ends with
    ``init_parameters(self, s)`` (default seed 0), so two models built with the same seed are the
    same bits. With ``device="meta"`` nothing is allocated or drawn; call
    ``materialize(model, device=..., seed=...)`` later. See [Note: counter-based init].
    """

    def __init__(self, cfg: GPTConfig | None = None, *, device=None, seed: int = 0):
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else GPTConfig()
        meta = torch.device("meta")  # see _build: submodules never draw from the global RNG
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd, device=meta),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd, device=meta),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg, device=meta) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias, device=meta),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, device=meta)
        self.tie_weights()
        build_on(self, device, seed)

    def tie_weights(self) -> None:
        """Make the output head share the token embedding's Parameter ([Note: tied head])."""
        self.lm_head.weight = self.transformer.wte.weight

    def param_init(self, name: str) -> ParamInit:
        """nanoGPT's rule, with the residual projections scaled by 1/sqrt(2L) (GPT-2 §2.3)."""
        if name.endswith("c_proj.weight"):
            # Each block adds two residual branches; scaling keeps the residual stream's
            # variance at init independent of depth.
            return ParamInit(kind="normal", std=INIT_STD / math.sqrt(2 * self.cfg.n_layer))
        return default_param_init(self, name)

    def unit_names(self) -> list[str]:
        """The blocks, one unit each; the root unit holds embeddings, ln_f and the tied head."""
        return [f"transformer.h.{i}" for i in range(self.cfg.n_layer)]

    def num_params(self) -> int:
        """Ψ: parameters counted once each (``parameters()`` already yields a tied one once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, t) int64 with t <= T. Returns logits (B, t, V) and the loss.

        The loss is the cross-entropy *mean* over all B·t tokens of the micro-batch (the g_j of
        docs/design.md §2 is the gradient of this mean), or None without targets.
        """
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise fail("sequence length", t, f"at most block_size={self.cfg.block_size}")
        tr = self.transformer
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = tr.drop(tr.wte(idx) + tr.wpe(pos))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(b * t, -1), targets.reshape(b * t))
        return logits, loss


# ---------------------------------------------------------------------------------------------
# MLP


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """A tanh multi-layer perceptron: n_layer Linear layers, d_in -> d_hidden ... -> d_out."""

    d_in: int = 16
    """Input features."""
    d_hidden: int = 32
    """Width of every hidden layer."""
    d_out: int = 4
    """Output features (regression targets)."""
    n_layer: int = 3
    """Linear layers, >= 1; tanh between consecutive ones. n_layer = 1 is linear regression."""
    bias: bool = True
    """Whether the Linear layers have biases."""

    def __post_init__(self):
        for field in ("d_in", "d_hidden", "d_out", "n_layer"):
            positive_int(field, getattr(self, field))
        if not isinstance(self.bias, bool):
            raise fail("bias", self.bias, "True or False")


class MLP(nn.Module):
    """``layers[0..L-1]``: Linear layers with tanh between; the loss is the MSE mean.

    Construction and ``seed`` behave as for ``GPT``.
    """

    def __init__(self, cfg: MLPConfig | None = None, *, device=None, seed: int = 0):
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else MLPConfig()
        widths = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layer - 1) + [cfg.d_out]
        meta = torch.device("meta")
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=cfg.bias, device=meta) for a, b in zip(widths[:-1], widths[1:])
        )
        build_on(self, device, seed)

    def param_init(self, name: str) -> ParamInit:
        """Weights N(0, 1/fan_in), biases 0.

        Not nanoGPT's 0.02: through tanh layers of width 16-32, std 0.02 shrinks the signal
        ~10x per layer, leaving the first layers' gradients near zero, a weak workload.
        """
        if name.endswith(".bias"):
            return ParamInit(kind="zeros")
        fan_in = self.get_parameter(name).shape[1]
        return ParamInit(kind="normal", std=1.0 / math.sqrt(fan_in))

    def unit_names(self) -> list[str]:
        """Each hidden layer is a unit ("layers.0" ... "layers.{L-2}"); the root unit holds the
        output layer, so the root is never empty unless there are no parameters at all."""
        return [f"layers.{i}" for i in range(self.cfg.n_layer - 1)]

    def num_params(self) -> int:
        """Ψ."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (B, d_in) float; targets: (B, d_out). Returns the output and the MSE mean or None."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        loss = None if targets is None else F.mse_loss(x, targets)
        return x, loss


# ---------------------------------------------------------------------------------------------
# Data


def _check_batches(seed, data_step, count, batch_size) -> None:
    for name, value, minimum in (
        ("seed", seed, 0),
        ("data_step", data_step, 0),
        ("count", count, 0),
        ("batch_size", batch_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise fail(name, value, f"an integer >= {minimum}")


def gpt_microbatches(
    cfg: GPTConfig, *, seed: int, data_step: int, count: int, batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches (idx, targets) of data step ``data_step``, on CPU, int64 (B, T).

    Micro-batch j is drawn from a generator seeded with stable_seed("gpt-data", seed,
    data_step, j): a function of those alone, never of the rank. Each sequence is an arithmetic
    progression mod V with a random start and a random stride in [1, 8], so a model can learn
    to continue it (the loss falls below ln V) while every token stays in [0, V). Targets are
    the inputs shifted by one.
    """
    _check_batches(seed, data_step, count, batch_size)
    out = []
    steps = torch.arange(cfg.block_size + 1, dtype=torch.long)
    for j in range(count):
        g = generator(stable_seed("gpt-data", seed, data_step, j))
        start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=g)
        stride = torch.randint(1, 9, (batch_size, 1), generator=g)
        tokens = (start + stride * steps) % cfg.vocab_size
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def mlp_microbatches(
    cfg: MLPConfig, *, seed: int, data_step: int, count: int, batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches (x, y) of data step ``data_step``, on CPU, float32.

    x ~ N(0, 1) of shape (B, d_in) from a generator seeded with stable_seed("mlp-data", seed,
    data_step, j); y = x·W, (B, d_out), for a fixed teacher W ~ N(0, 1/d_in) seeded by ``seed``
    alone. y is accumulated in float64 by explicit elementwise adds over d_in and rounded once
    to float32, so no BLAS (whose bits may depend on threads or alignment) shapes the data.
    """
    _check_batches(seed, data_step, count, batch_size)
    teacher = torch.empty(cfg.d_in, cfg.d_out, dtype=torch.float64)
    teacher.normal_(
        0.0, 1.0 / math.sqrt(cfg.d_in), generator=generator(stable_seed("mlp-teacher", seed))
    )
    out = []
    for j in range(count):
        g = generator(stable_seed("mlp-data", seed, data_step, j))
        x = torch.randn(batch_size, cfg.d_in, generator=g, dtype=torch.float32)
        xd = x.double()
        y = xd[:, 0:1] * teacher[0]
        for i in range(1, cfg.d_in):
            y = y + xd[:, i : i + 1] * teacher[i]
        out.append((x, y.float()))
    return out


# ---------------------------------------------------------------------------------------------
# GPT configurations of a requested size, in the paper's shapes

# (largest size in parameters, hidden, heads) from the paper's configurations (docs/paper.md §1.9):
# GPT-2 1.5B uses 1600/16; 4B 2304/24; 8B 3072/24; 10-20B 4096/32; 40-60B 6144/32; larger 8192/64.
PAPER_SHAPES = (
    (2.0e9, 1600, 16),
    (5.0e9, 2304, 24),
    (9.0e9, 3072, 24),
    (2.5e10, 4096, 32),
    (7.0e10, 6144, 32),
    (float("inf"), 8192, 64),
)


def gpt_num_params(cfg: GPTConfig) -> int:
    """Exact parameter count of GPT(cfg), embeddings included, the tied head counted once:
    per block 12h² + 13h (attention 4h² + 4h, MLP 8h² + 5h, two LayerNorms 4h), plus the token
    and position embeddings (V + S)·h and the final LayerNorm 2h (biases as cfg.bias says)."""
    h, b = cfg.n_embd, 1 if cfg.bias else 0
    block = 12 * h * h + b * 9 * h + (2 + 2 * b) * h
    return cfg.n_layer * block + (cfg.vocab_size + cfg.block_size) * h + (1 + b) * h


def gpt_flops(batch, seq, layers, hidden, vocab, *, recompute: bool) -> float:
    """Megatron-LM's FLOPs of one step (forward and backward) on `batch` sequences: per block
    24·B·s·h² + 4·B·s²·h in forward, the logits 2·B·s·h·V, backward twice forward; activation
    checkpointing runs the blocks' forward once more. So 72 (96) · B·s·l·h²·(1 + s/(6h)) +
    6·B·s·h·V, which is Megatron's 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with recomputation."""
    c, h = (96 if recompute else 72), hidden
    return c * batch * seq * layers * h * h * (1 + seq / (6 * h)) + 6 * batch * seq * h * vocab


def gpt_config_for(
    num_params: float, *, vocab_size: int = 50257, block_size: int = 1024
) -> tuple[GPTConfig, int]:
    """A GPT of about `num_params` parameters in the paper's shapes: hidden size and heads from
    the paper's configuration of that size (PAPER_SHAPES; below 1B, a GPT-2-like aspect of about
    hidden/64 layers with 64-wide heads), layers chosen to hit the count.
    Returns (config, exact parameter count)."""
    if not num_params >= 1e6:
        raise ValueError(f"num_params={num_params}: must be >= 1e6")
    if num_params < 1e9:  # GPT-2-like aspect: about hidden/64 layers, 64-wide heads
        fits = [
            h
            for h in (64, 128, 256, 384, 512, 768, 1024, 1280, 1536)
            if (vocab_size + block_size + 2) * h < num_params
        ]
        if not fits:
            raise ValueError(
                f"num_params={num_params:g}: smaller than the embeddings of vocab_size="
                f"{vocab_size}, block_size={block_size} at hidden 64; pass a smaller vocab_size"
            )
        fixed_of = lambda h: (vocab_size + block_size + 2) * h  # noqa: E731
        hidden = min(fits, key=lambda h: abs((num_params - fixed_of(h)) / (12 * h * h) - h / 64))
        heads = max(1, hidden // 64)
    else:
        _, hidden, heads = next(s for s in PAPER_SHAPES if num_params <= s[0])
    base = GPTConfig(
        vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=heads, n_embd=hidden
    )
    fixed = (vocab_size + block_size) * hidden + 2 * hidden
    per_block = gpt_num_params(base) - fixed
    layers = max(1, round((num_params - fixed) / per_block))
    cfg = replace(base, n_layer=layers)
    return cfg, gpt_num_params(cfg)
