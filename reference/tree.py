"""The reduction order of a data-parallel step: the tree T, its streaming form, and the global norm.

Legend (ZeRO paper, arXiv 1910.02054, and docs/design.md §2):
    N       data-parallel degree (world size), ranks 0..N-1
    M       micro-batches per step; micro-batch j runs on rank j mod N at micro-step j div N
    g_j     gradient of micro-batch j (its loss is the mean over its samples)
    B_k     micro-step k's sum over ranks, T(g_{kN} ... g_{kN+N-1})
    R       the reduced gradient, T(B_0 ... B_{M/N-1})
    C       clipping-chunk size in elements, a power of two

IEEE addition is commutative but not associative, so a sum is defined by the *shape* of its tree,
never by the order of the operands inside one addition. Everything here fixes that shape.

[Note: the tree T] T(x_0) = x_0. For n > 1 let h be the largest power of two strictly below n;
T(x_0 .. x_{n-1}) = T(x_0 .. x_{h-1}) + T(x_h .. x_{n-1}). For a power-of-two n this is the
balanced tree, ((a+b)+(c+d)) for n = 4. The tree starts from the leaves, never from a zero
accumulator: -0 + +0 is +0, so a zero-initialised accumulator would change signed zeros.
Because T over a power-of-two count is balanced, T(T(block_0), ..., T(block_{K-1})) with equal
power-of-two blocks is T of the concatenation; that is why, for N and M powers of two with N | M,
every world size produces the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def split_point(n: int) -> int:
    """Largest power of two strictly less than n (n >= 2): where T splits n leaves."""
    assert n >= 2
    return 1 << ((n - 1).bit_length() - 1)


def tree_sum(xs: Sequence[np.ndarray]) -> np.ndarray:
    """T(xs): the recursive power-of-two-split sum of [Note: the tree T].

    Each addition is one elementwise IEEE addition in the leaves' dtype (NumPy and ml_dtypes
    round every bf16/fp16 addition once, exactly as torch does).
    """
    n = len(xs)
    if n == 0:
        raise ValueError("tree_sum: xs is empty; T needs at least one leaf")
    if n == 1:
        return xs[0]
    h = split_point(n)
    return tree_sum(xs[:h]) + tree_sum(xs[h:])


class StreamingTree:
    """T computed as the leaves arrive, with a binary counter of partial sums.

    Each partial sum covers a power-of-two run of consecutive leaves. push(x) adds a run of
    size 1; while the two newest runs have equal size they merge (older + newer), like carries in
    a binary counter. result() folds the leftovers from the newest backwards:
    p_0 + (p_1 + (... + p_last)). The runs left over are the binary digits of n from the most
    significant down, which is exactly how T splits n, so result() == tree_sum(leaves) for every
    n. The counter holds at most popcount(n) <= floor(log2 n) + 1 partial sums; while n leaves
    stream in and each new leaf sits in its own arrival buffer, at most floor(log2 n) *extra*
    buffers are needed (the maximum of popcount(j) over 1 <= j < n).
    """

    def __init__(self) -> None:
        self.runs: list[tuple[int, np.ndarray]] = []  # (leaves covered, partial sum), oldest first
        self.count = 0
        self.peak_partials = 0  # most partial sums held before a push, i.e. extra buffers needed

    def push(self, x: np.ndarray) -> None:
        self.peak_partials = max(self.peak_partials, len(self.runs))
        size, acc = 1, x
        while self.runs and self.runs[-1][0] == size:
            older_size, older = self.runs.pop()
            size, acc = older_size + size, older + acc
        self.runs.append((size, acc))
        self.count += 1

    def result(self) -> np.ndarray:
        if not self.runs:
            raise ValueError("StreamingTree.result: no leaf was pushed")
        acc = self.runs[-1][1]
        for _, partial in reversed(self.runs[:-1]):
            acc = partial + acc
        return acc


def microbatch_owner(j: int, world_size: int) -> tuple[int, int]:
    """(rank, micro-step) of micro-batch j: rank j mod N at micro-step j div N (docs/design.md
    §2)."""
    return j % world_size, j // world_size


def reduce_microbatches(grads: Sequence[np.ndarray], world_size: int) -> np.ndarray:
    """R = T(B_0 .. B_{M/N-1}) with B_k = T(g_{kN} .. g_{kN+N-1}), in the leaves' dtype.

    grads[j] is g_j already cast to the reduction dtype. M = len(grads) must be a multiple of N.
    Within a micro-step the ranks' contributions are combined by T in rank order; across
    micro-steps a rank streams the B_k through a StreamingTree, which equals T(B_0 ..).
    """
    m = len(grads)
    if world_size < 1 or m % world_size != 0 or m == 0:
        raise ValueError(
            f"reduce_microbatches: micro-batches M={m} must be a positive multiple of "
            f"world_size N={world_size}"
        )
    stream = StreamingTree()
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected by the caller
        for k in range(m // world_size):
            stream.push(tree_sum(grads[k * world_size : (k + 1) * world_size]))
        return stream.result()


def chunk_sumsq(x: np.ndarray, chunk: int) -> np.ndarray:
    """Per-chunk sums of squares of a flat array, in float64, by pairwise halving.

    x (1D, length a multiple of chunk) is cut into chunks of C elements. For each chunk:
    s = float64(x)^2, then repeatedly s = s[:h] + s[h:] with h = len(s)/2 until one value is left.
    These are plain elementwise float64 additions, so torch and NumPy give the same bits.
    Returns a 1D float64 array, one partial per chunk.
    """
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk_sumsq: chunk={chunk} must be a power of two")
    if x.ndim != 1 or x.size % chunk:
        raise ValueError(f"chunk_sumsq: x has shape {x.shape}; need 1D with size % {chunk} == 0")
    s = x.astype(np.float64).reshape(-1, chunk)
    s = s * s
    while s.shape[1] > 1:
        h = s.shape[1] // 2
        s = s[:, :h] + s[:, h:]
    return s[:, 0]


def sumsq_total(partials: Sequence[np.ndarray]) -> np.float64:
    """T(all chunk partials in global order), float64: the squared norm before its square root
    (0.0 for no partials). global_norm and mp_norm are its square roots."""
    flat = np.concatenate([np.asarray(p, dtype=np.float64) for p in partials])
    if flat.size == 0:
        return np.float64(0.0)
    return np.float64(tree_sum(list(flat)))


def global_norm(partials: Sequence[np.ndarray]) -> np.float64:
    """The global L2 norm from per-unit chunk partials: sqrt(T(all partials in global order)).

    partials[u] holds unit u's chunk partials (chunk_sumsq of its flat, aligned buffer, without
    the world-size padding; see [Note: norm invariance] in reference/layout.py). The partials
    are concatenated in unit order and summed by T in float64; the square root is float64's
    correctly rounded sqrt.
    """
    return np.sqrt(sumsq_total(partials)).astype(np.float64)


def mp_norm(per_slice: Sequence[Sequence[np.ndarray]]) -> np.float64:
    """The global L2 norm of a model split over N_m model-parallel slices: per_slice[m] holds
    slice m's per-unit chunk partials (each element of the model counted by one slice only,
    docs/design.md §6); sqrt(T(s_0, ..., s_{N_m-1})) with s_m = sumsq_total(per_slice[m]).
    At N_m = 1 it is global_norm."""
    return np.sqrt(tree_sum([sumsq_total(p) for p in per_slice])).astype(np.float64)
