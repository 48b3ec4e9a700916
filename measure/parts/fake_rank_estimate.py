"""measure.fake_rank's estimate of one rank's peak, before anything is built: the GPT a rank is
asked for (gpt_for), the padded flat buffers of its units (padded_unit_numel) and the analytic
model states of those, plus [Note: transient bound] and RUNTIME_BYTES (estimate_peak_bytes).
Pure arithmetic on the model's shape; whether the estimate fits the machine now is
measure.fake_rank.fits_here's to say. Legend: Ψ parameters, N world size, C the chunk.
"""

from __future__ import annotations

import math

TRANSIENT_BYTES_PER_UNIT_ELEMENT = 24
"""[Note: transient bound] Bytes per element of the largest unit that a rank holds on top of its
model states at its peak. Construction holds one unit's fp32 start values twice (the flat buffer
and the per-parameter values, 8 B) and its compute-dtype working copy (2 B); a stage-3 step holds
up to two gathered units and the root (2 B each), a unit's full-size gradient (2 B), the receive
buffers of up to two reductions in flight (2 B each) and the parameters' .grad (2 B), about 16 B.
24 B leaves a margin: the 7.5B rank of Figure 1 peaked 3.0 GB above its model states, 19.5 B
times its largest unit (the root, 154M elements). Used only to decide whether a rank fits."""

RUNTIME_BYTES = 256 * 1024**2
"""What a first step costs whatever the model (kernel workspaces, autograd's thread: about 31 MB
measured) plus activations at sequence 64 and batch 1, with room to spare."""


def gpt_for(params: float, *, seq: int, vocab_size: int, shape: dict | None = None):
    """The GPT of `gpt_config_for(params)`, or of `shape` (n_layer, n_embd, n_head) when given."""
    from zero.workloads.models import GPTConfig, gpt_config_for, gpt_num_params

    if shape:
        cfg = GPTConfig(vocab_size=vocab_size, block_size=max(seq, 16), **shape)
    else:
        cfg, _ = gpt_config_for(params, vocab_size=vocab_size)
        cfg = type(cfg)(**{**cfg.__dict__, "block_size": max(seq, 16)})
    return cfg, gpt_num_params(cfg)  # arithmetic: a 1e15 model is never built to be counted


BLOCK_TENSORS, ROOT_TENSORS = 12, 5
"""Parameter tensors of a GPT block (two layer norms, attention and MLP, weights and biases) and
at most of its root unit (the embeddings, the last layer norm, an untied head): each starts at an
aligned offset, so each adds at most ALIGN - 1 elements of gap to its unit's flat buffer."""


def padded_unit_numel(numel: int, tensors: int, *, chunk: int, world_size: int) -> int:
    """An upper bound of the flat buffer N·L of a unit of `numel` parameters in `tensors`
    tensors (reference/layout.py): offsets aligned to ALIGN, the extent rounded up to whole
    chunks C, then to N·L with L a multiple of C. At a large N this is N·C, whatever the unit:
    every rank holds at least one chunk of every unit, and a gathered unit is N of them."""
    from reference.layout import ALIGN

    chunks = max(1, math.ceil((numel + tensors * (ALIGN - 1)) / chunk))
    return world_size * math.ceil(chunks / world_size) * chunk


def estimate_peak_bytes(
    *,
    params: float,
    world_size: int,
    stage: int,
    seq: int = 64,
    vocab_size: int = 50257,
    shape: dict | None = None,
    options: dict | None = None,
) -> dict:
    """The analytic model states of one rank (the paper's formula on Ψ: model_states) and an
    upper estimate of its peak, in bytes.

    Peak = model states of the padded units (zero.common.memory, the paper's configuration)
    + TRANSIENT_BYTES_PER_UNIT_ELEMENT × the largest padded unit ([Note: transient bound])
    + RUNTIME_BYTES. Pure arithmetic on the model's shape: nothing is allocated. The padding
    counts: each unit is padded to N·L elements (padded_unit_numel), which at a large world
    size is N·C for every unit, far above its parameters (2M parameters at N = 10^6 are
    padded to 12·10^9 elements, and a rank gathers 4·10^9 of them at once). `options` (further
    ZeroConfig fields) may set the chunk C.
    """
    from zero.common.memory import model_state_breakdown
    from zero.config import ZeroConfig

    chunk = (options or {}).get("chunk", ZeroConfig.__dataclass_fields__["chunk"].default)
    cfg, count = gpt_for(params, seq=seq, vocab_size=vocab_size, shape=shape)
    h = cfg.n_embd
    block = 12 * h * h + 13 * h
    root = count - cfg.n_layer * block
    pad = dict(chunk=chunk, world_size=world_size)
    padded_block = padded_unit_numel(block, BLOCK_TENSORS, **pad)
    padded_root = padded_unit_numel(root, ROOT_TENSORS, **pad)
    padded = cfg.n_layer * padded_block + padded_root
    states = model_state_breakdown(num_params=count, world_size=world_size, stage=stage).total
    held = model_state_breakdown(num_params=padded, world_size=world_size, stage=stage).total
    largest = max(padded_block, padded_root)
    peak = held + TRANSIENT_BYTES_PER_UNIT_ELEMENT * largest + RUNTIME_BYTES
    return {
        "num_params": count,
        "model_states": states,
        "padded_params": padded,
        "padded_model_states": held,
        "largest_unit": largest,
        "chunk": chunk,
        "peak": peak,
    }
