"""The deterministic Adam/AdamW update as one C loop: the reference's operations, in its order,
one pass over memory ([Note: a fused loop with the same roundings]).

zero/optim/update.py's deterministic kernel issues the reference's fourteen elementwise
operations as torch ops, block by block; each op is a pass over the block. This module does the same
operations element by element in one loop, compiled on first use with the system's C compiler
and loaded with ctypes (no torch headers, so the build takes well under a second). Where there
is no compiler, the build fails, or the tensors are not contiguous fp32 on the CPU, `available`
is False or `adam` returns False and zero/optim/update.py runs its torch ops instead: the same bits.

The same library holds the step's other full pass over the gradient, the clipping norm's chunk
partials (zero/control.py's chunk_sumsq): the torch ops copy the shard to float64 and halve it
log2(C) times, each halving a strided pass over the whole copy; the loop halves one chunk at a
time in a C-element buffer that stays in cache. The additions are the same, in the same pairs.

[Note: a fused loop with the same roundings] Each C statement below is one of the reference's
operations on float32 values, so each rounds once to float32, as the torch op does:
  - x86-64 evaluates float arithmetic in float32 (FLT_EVAL_METHOD 0; SSE, not x87);
  - -ffp-contract=off forbids fusing a·b + c into one FMA (one rounding instead of two);
  - no -ffast-math: no reassociation, no reciprocal for division, IEEE sqrt (correctly rounded,
    as NumPy's in the reference); vectorising the loop changes none of these;
  - + and · are commutative in IEEE arithmetic, so operand order inside one op cannot matter.
tests/unit/test_optim_blocks.py compares it with the torch ops and the reference bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* One Adam or AdamW step on n elements, in place; s holds the step's float32 scalars. The
   variable names are reference/optim.py's; each statement is one rounded operation. */
void adam_step(float *p, const float *g, float *m, float *v, int64_t n, int adamw,
               int decay_on, float decay, float wd, float b1, float one_minus_b1, float b2,
               float one_minus_b2, float inv_sqrt_bc2, float eps, float step_size) {
    for (int64_t i = 0; i < n; i++) {
        float pi = p[i], gi = g[i], tmp, d;
        if (adamw) {
            if (decay_on) pi = pi * decay;
        } else if (decay_on) {
            tmp = pi * wd;
            gi = tmp + gi;
        }
        tmp = gi * one_minus_b1;
        m[i] = m[i] * b1;
        m[i] = m[i] + tmp;
        tmp = gi * gi;
        tmp = tmp * one_minus_b2;
        v[i] = v[i] * b2;
        v[i] = v[i] + tmp;
        d = sqrtf(v[i]);
        d = d * inv_sqrt_bc2;
        d = d + eps;
        d = m[i] / d;
        d = d * step_size;
        p[i] = pi - d;
    }
}

/* reference/tree.py's chunk_sumsq: per chunk of c elements, float64 squares (exact: a float32
   has 24 significant bits), then s[i] = s[i] + s[i + h] for h = c/2, c/4, ..., 1. The same
   additions as the reference's whole-array passes, done one chunk at a time in buf (c doubles,
   in cache) instead of over the whole shard. keep (may be NULL): elements where it is 0 count
   as +0. */
void chunk_sumsq(const float *x, const uint8_t *keep, int64_t n, int64_t c, double *buf,
                 double *out) {
    for (int64_t k = 0; k < n / c; k++) {
        const float *xk = x + k * c;
        for (int64_t i = 0; i < c; i++) {
            double d = (keep && !keep[k * c + i]) ? 0.0 : (double)xk[i];
            buf[i] = d * d;
        }
        for (int64_t h = c / 2; h >= 1; h /= 2)
            for (int64_t i = 0; i < h; i++) buf[i] = buf[i] + buf[i + h];
        out[k] = buf[0];
    }
}
"""

_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-std=c99")

ENABLED = True
"""Set False to run zero/optim/update.py's torch ops instead (measure/optim_speed.py compares
them)."""
ADAM_SCALARS = (
    "decay",
    "wd",
    "b1",
    "one_minus_b1",
    "b2",
    "one_minus_b2",
    "inv_sqrt_bc2",
    "eps",
    "step_size",
)
"""reference.optim.step_scalars' names in the order the Adam kernels take them (this loop's and
zero/optim/triton_kernels.py's)."""


def _cache_dir() -> Path:
    # a fresh XDG_CACHE_HOME builds again (verify/linecoverage.py measures the build that way)
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "zero-optim-native"


def _build(source: str = _SOURCE, flags: tuple[str, ...] = _FLAGS) -> ctypes.CDLL | None:
    """Compile (once per source, flags and compiler) and load the loop; None if impossible."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None  # FLT_EVAL_METHOD 0 is checked there
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None  # no C compiler
    key = hashlib.sha256(("\0".join([source, *flags, cc])).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"adam_{key}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                src, out = Path(tmp) / "adam.c", Path(tmp) / "adam.so"
                src.write_text(source)
                cmd = [cc, *flags, "-o", str(out), str(src), "-lm"]
                subprocess.run(cmd, check=True, capture_output=True, timeout=60)
                os.replace(out, lib)  # atomic: a rank never loads a half-written library
        handle = ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError):
        return None
    fn = handle.adam_step
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fn.argtypes += [ctypes.c_float] * 9
    fn = handle.chunk_sumsq
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
    return handle


_LIB: list = []  # [the loaded library or None], filled on first use


def _cpu(t: torch.Tensor, dtype=torch.float32) -> bool:
    """Whether the loop can take t: a contiguous CPU tensor of `dtype`."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def available() -> bool:
    """Whether the compiled loop can be used in this process (built on first call)."""
    if not _LIB:
        _LIB.append(_build())
    return ENABLED and _LIB[0] is not None


def adam(kind: str, decay_on: bool, s: dict, p, g, m, v) -> bool:
    """One deterministic Adam/AdamW step on p, m, v in place, from g; `s` the step's float32
    scalars (reference.optim.step_scalars). False, touching nothing, where it cannot run."""
    tensors = (p, g, m, v)
    if not all(_cpu(t) for t in tensors) or not available():
        return False
    n = p.numel()
    if any(t.numel() != n for t in tensors):
        raise ValueError(f"adam: tensors of {[t.numel() for t in tensors]} elements, not equal")
    scalars = (float(s.get(k, 0.0)) for k in ADAM_SCALARS)  # float32 -> double -> float: exact
    ptrs = (t.data_ptr() for t in tensors)
    _LIB[0].adam_step(*ptrs, n, int(kind == "adamw"), int(decay_on), *scalars)
    return True


def chunk_sumsq(x: torch.Tensor, chunk: int, keep: torch.Tensor | None) -> torch.Tensor | None:
    """zero/control.py's chunk partials (float64, one per chunk) from the loop, or None where it
    cannot run (then the torch ops run: the same bits, tests/unit/test_optim_blocks.py)."""
    if not _cpu(x) or (keep is not None and not _cpu(keep, torch.bool)) or not available():
        return None
    n = chunked_numel(x, chunk, keep)
    out = torch.empty(n // chunk, dtype=torch.float64)
    buf = torch.empty(chunk, dtype=torch.float64)
    mask = None if keep is None else keep.data_ptr()
    _LIB[0].chunk_sumsq(x.data_ptr(), mask, n, chunk, buf.data_ptr(), out.data_ptr())
    return out


def chunked_numel(x: torch.Tensor, chunk: int, keep: torch.Tensor | None) -> int:
    """x's length, which chunk must divide, and keep's (if any) must equal: the partial-sum
    kernels' shared check (this loop's and zero/optim/triton_kernels.py's)."""
    n = x.numel()
    if n % chunk or (keep is not None and keep.numel() != n):
        k = None if keep is None else keep.numel()
        raise ValueError(
            f"chunk_sumsq: x has {n} elements, keep {k}; chunk={chunk} must divide both"
        )
    return n
