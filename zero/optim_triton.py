"""The deterministic Adam/AdamW update on CUDA as one Triton kernel: reference/optim.py's
operations, in its order, one pass over memory ([Note: a kernel with the reference's roundings]);
and the norm's chunk partials (reference.tree.chunk_sumsq) in one pass, one program per chunk.

zero/optim.py's torch ops make fourteen passes (and fourteen launches) per run; this kernel makes
one. It is used on CUDA where Triton imports; elsewhere, or with ENABLED False, `adam` returns
False and zero/optim.py falls back to its torch ops (the same bits). On a CPU the compiled loop
(zero/optim_native.py) does the same job. With TRITON_INTERPRET=1 Triton runs the kernel in
NumPy on CPU tensors, which is how tests/unit/test_optim_blocks.py checks its operation order
without a GPU; tests/gpu checks the compiled kernel's bits.

[Note: a kernel with the reference's roundings] Each statement is one of the reference's float32
operations, rounded once: enable_fp_fusion=False forbids contracting a·b + c into an FMA (Triton
contracts by default); tl.div_rn and tl.sqrt_rn are the correctly rounded division and square
root (Triton's `/` and tl.sqrt are approximate on NVIDIA GPUs); the scalars are float32 values
passed as float32 arguments. Legend as reference/optim.py.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .optim_native import ADAM_SCALARS, chunked_numel

tl = None  # triton.language, imported with the kernel (_kernel): the body's `tl`
ENABLED = True
"""Set False to run zero/optim.py's torch ops on CUDA instead (tests compare them)."""
BLOCK = 1024
"""Elements per Triton program; the update is elementwise, so no bit depends on it."""


def _adam_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    n,
    decay,
    wd,
    b1,
    one_minus_b1,
    b2,
    one_minus_b2,
    inv_sqrt_bc2,
    eps,
    step_size,
    ADAMW: tl.constexpr,
    DECAY_ON: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: shards of 2^31 elements and more
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if ADAMW:
        if DECAY_ON:
            p = p * decay
    else:
        if DECAY_ON:
            tmp = p * wd
            g = tmp + g
    tmp = g * one_minus_b1
    m = m * b1
    m = m + tmp
    tmp = g * g
    tmp = tmp * one_minus_b2
    v = v * b2
    v = v + tmp
    d = tl.sqrt_rn(v)
    d = d * inv_sqrt_bc2
    d = d + eps
    d = tl.div_rn(m, d)
    d = d * step_size
    p = p - d
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def _sumsq_kernel(
    x_ptr, keep_ptr, out_ptr, HAS_KEEP: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr
):
    # reference.tree.chunk_sumsq for chunk k: float64 squares (exact for float32 values), then
    # s = s[:h] + s[h:] for h = C/2, ..., 1. Viewed as (2, h), row 0 of s is s[:h] and row 1
    # is s[h:]; transposed to (h, 2) and split, they are the two operands of one addition each
    k = tl.program_id(0).to(tl.int64)
    offs = k * C + tl.arange(0, C)
    s = tl.load(x_ptr + offs).to(tl.float64)
    if HAS_KEEP:  # outside the mask an element counts as +0
        s = tl.where(tl.load(keep_ptr + offs) != 0, s, 0.0)
    s = s * s
    for b in tl.static_range(LOG_C):  # h = C/2, C/4, ..., 1
        low, high = tl.split(tl.permute(tl.reshape(s, (2, C >> (b + 1))), (1, 0)))
        s = low + high
    tl.store(out_ptr + k + tl.arange(0, 1), s)


_JIT: dict[tuple, object] = {}  # (kernel, interpreted or compiled) -> the jitted kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel(fn=None):
    """triton.jit of a kernel (the update's by default), made on first use (TRITON_INTERPRET
    is read then); Triton is imported only here, so a process that never updates on CUDA never
    loads it."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    fn = _adam_kernel if fn is None else fn
    key = (fn.__name__, _interpreting())
    if key not in _JIT:
        _JIT[key] = triton.jit(fn)
    return _JIT[key]


def _options() -> dict:
    """The compiler's options for every kernel here ([Note: a kernel with the reference's
    roundings]): no FMA contraction, and no flush of subnormals in libdevice (the precise sqrt
    and division are PTX's IEEE instructions either way); none under the interpreter."""
    return {} if _interpreting() else {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def available(device) -> bool:
    """Whether the kernel runs on tensors of `device`: CUDA with Triton, or any CPU tensor
    under Triton's interpreter."""
    kind = torch.device(device).type
    if not ENABLED or not (kind == "cuda" or (kind == "cpu" and _interpreting())):
        return False
    return importlib.util.find_spec("triton") is not None  # the CPU wheel has no Triton


def adam(kind: str, decay_on: bool, s: dict, p, g, m, v) -> bool:
    """One deterministic Adam/AdamW step on p, m, v in place, from g; `s` the step's float32
    scalars (reference.optim.step_scalars). False, touching nothing, where it cannot run."""
    tensors = (p, g, m, v)
    if not available(p.device) or not all(
        t.device == p.device and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    ):
        return False
    n = p.numel()
    if any(t.numel() != n for t in tensors):
        raise ValueError(f"adam: tensors of {[t.numel() for t in tensors]} elements, not equal")
    if n == 0:
        return True
    _kernel()[(-(-n // BLOCK),)](
        *tensors,
        n,
        *(float(s.get(k, 0.0)) for k in ADAM_SCALARS),  # float32 values: exact as float32 arguments
        ADAMW=kind == "adamw",
        DECAY_ON=bool(decay_on),
        BLOCK=BLOCK,
        **_options(),
    )
    return True


MAX_CHUNK = 1 << 14
"""The largest chunk one program sums (C float64 values held at once); larger chunks, which
only a config far from the default (4096) has, take the torch ops."""


def chunk_sumsq(x: torch.Tensor, chunk: int, keep: torch.Tensor | None) -> torch.Tensor | None:
    """zero/control.py's chunk partials (float64, one per chunk) in one pass, or None where
    this kernel does not run (then the torch ops run: the same bits)."""
    if (
        not available(x.device)
        or chunk > MAX_CHUNK
        or x.dtype != torch.float32
        or not x.is_contiguous()
        or (keep is not None and (keep.device != x.device or not keep.is_contiguous()))
    ):
        return None
    n = chunked_numel(x, chunk, keep)
    out = torch.empty(n // chunk, dtype=torch.float64, device=x.device)
    if n:
        mask = x if keep is None else keep.view(torch.uint8)
        log_c, has_keep = chunk.bit_length() - 1, keep is not None
        grid = (n // chunk,)
        options = {"HAS_KEEP": has_keep, "C": chunk, "LOG_C": log_c, **_options()}
        _kernel(_sumsq_kernel)[grid](x, mask, out, **options)
    return out
