"""The deterministic Adam/AdamW update on CUDA as one Triton kernel per unit shard:
reference/optim.py's operations, in its order, one pass over memory ([Note: a kernel with the
reference's roundings]); and the norm's chunk partials (reference.tree.chunk_sumsq) in one pass.

zero/optim/update.py's torch ops make fourteen passes (and launches) per run, a unit of a GPT block
has about nine runs (its groups alternate), and this kernel makes one pass for all of them. It is
used on CUDA where Triton imports; elsewhere, or with ENABLED False, `adam_runs` returns False and
zero/optim/update.py falls back to its torch ops (the same bits); on a CPU the compiled loop
(zero/optim/native.py) does the job. With TRITON_INTERPRET=1 Triton runs the kernels in NumPy on
CPU tensors: tests/unit/test_optim_blocks.py checks their operations that way, tests/gpu compiled.

[Note: a kernel with the reference's roundings] Each statement is one of the reference's float32
operations, rounded once: enable_fp_fusion=False forbids contracting a·b + c into an FMA (Triton
contracts by default); tl.div_rn and tl.sqrt_rn are the correctly rounded division and square
root (Triton's `/` and tl.sqrt are approximate on NVIDIA GPUs); the scalars are float32 values
held in a float32 table, one row per run. Legend as reference/optim.py.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..collectives import to_device
from .native import ADAM_SCALARS, chunked_numel

tl = None  # triton.language, imported with the kernel (_kernel): the body's `tl`
ENABLED = True
"""Set False to run zero/optim/update.py's torch ops on CUDA instead (tests compare them)."""
BLOCK = 1024
"""Elements per Triton program; the update is elementwise, so no bit depends on it."""


def _adam_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    bounds_ptr,
    table_ptr,
    lo,
    hi,
    ADAMW: tl.constexpr,
    BLOCK: tl.constexpr,
    RUNS: tl.constexpr,
):
    # reference/optim.py's Adam/AdamW over a whole unit shard in one launch: element i takes
    # the scalars of the run that holds it (table row: SCALAR_COLUMNS), and an element in no run
    # (a parameter without a gradient this step) is neither read nor written
    offs = lo + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = tl.full([BLOCK], 0, tl.int32)  # (tl.zeros is a jit function; tl.full a builtin)
    inside = offs < 0
    for r in tl.static_range(RUNS):  # RUNS: a power of two; the rows past the runs are empty
        hit = (offs >= tl.load(bounds_ptr + 2 * r)) & (offs < tl.load(bounds_ptr + 2 * r + 1))
        row = tl.where(hit, r, row)
        inside = inside | hit
    mask = inside & (offs < hi)
    sc = table_ptr + row * 10  # row 0 outside every run: its loads stay in the table
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    decay_on = tl.load(sc + 9) != 0
    if ADAMW:
        p = tl.where(decay_on, p * tl.load(sc + 0), p)
    else:
        tmp = p * tl.load(sc + 1)
        g = tl.where(decay_on, tmp + g, g)
    tmp = g * tl.load(sc + 3)
    m = m * tl.load(sc + 2)
    m = m + tmp
    tmp = g * g
    tmp = tmp * tl.load(sc + 5)
    v = v * tl.load(sc + 4)
    v = v + tmp
    d = tl.sqrt_rn(v)
    d = d * tl.load(sc + 6)
    d = d + tl.load(sc + 7)
    d = tl.div_rn(m, d)
    d = d * tl.load(sc + 8)
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
        log_c = chunk.bit_length() - 1
        options = {"HAS_KEEP": keep is not None, "C": chunk, "LOG_C": log_c, **_options()}
        _kernel(_sumsq_kernel)[(n // chunk,)](x, mask, out, **options)
    return out


SCALAR_COLUMNS = (*ADAM_SCALARS, "decay_on")
"""A run's row in _adam_kernel's table: the step's float32 scalars, then 1.0 where the
group decays (0.0: the decay line is skipped, as reference/optim.py skips it)."""


def adam_runs(kind: str, runs: list, p, g, m, v) -> bool:
    """One deterministic Adam/AdamW step over one unit shard in one launch: `runs` are
    (start, stop, scalars, decay_on) in order, not overlapping, each run's scalars its group's
    and t_p's (reference.optim.step_scalars); elements in no run are left as they are. False,
    touching nothing, where the kernel cannot run. The tables (16 bytes and 40 bytes a run)
    travel to the device without waiting (zero/collectives.py's to_device)."""
    tensors = (p, g, m, v)
    if (
        not runs
        or not available(p.device)
        or not all(
            t.device == p.device and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
        )
    ):
        return False
    if any(t.numel() != p.numel() for t in tensors):
        raise ValueError(f"adam_runs: tensors of {[t.numel() for t in tensors]} elements")
    rows = 1 << (len(runs) - 1).bit_length()  # a power of two: few compiled variants
    edges = [x for a, b, _, _ in runs for x in (a, b)] + [0, 0] * (rows - len(runs))
    # an empty run [0, 0) holds no element
    bounds = to_device(torch.tensor(edges, dtype=torch.int64), p.device)
    table_rows = [
        [float(s.get(k, 0.0)) for k in ADAM_SCALARS] + [float(on)] for _, _, s, on in runs
    ]
    table = to_device(torch.tensor(table_rows, dtype=torch.float32), p.device)
    lo, hi = runs[0][0], runs[-1][1]
    grid = (-(-(hi - lo) // BLOCK),)
    options = {"ADAMW": kind == "adamw", "BLOCK": BLOCK, "RUNS": rows, **_options()}
    _kernel()[grid](*tensors, bounds, table, lo, hi, **options)
    return True
