"""The exercises of notebook 02 and their checkers: (1) the tree-ordered reduce-scatter,
(2) the bytes one rank holds per stage.

A checker runs the student's function on every case and prints one line per case. Until the
student has written it (it raises NotImplementedError) the checker checks the solution instead
and says so, so that the notebook still runs headless.

Legend: see the package docstring; T is the reduction tree of reference/tree.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference import bits, cast
from reference.simulate import reduce_scatter

from .simulation import padded_numel, simulate, toy_problem


@dataclass(frozen=True, kw_only=True)
class ExerciseResult:
    """The verdict of an exercise checker."""

    attempted: bool  # False: the student's function raised NotImplementedError
    passed: bool  # the checked function (the student's, or the fallback) gave the exact answer
    lines: tuple[str, ...]  # what was checked, one line per case

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _run_exercise(candidate, fallback, check_one, cases, what: str) -> ExerciseResult:
    """Shared driver: try the student's function on every case; if it is not written yet
    (NotImplementedError), check the fallback (the solution) instead and say so. A failing
    fallback raises: the solution itself is broken."""
    lines: list[str] = []
    fn, attempted = candidate, True
    try:
        first = check_one(candidate, cases[0][0])
    except NotImplementedError:
        if fallback is None:
            return ExerciseResult(attempted=False, passed=False, lines=(f"{what}: not attempted",))
        fn, attempted = fallback, False
        lines.append(f"{what}: not attempted yet (NotImplementedError); checking the solution")
        first = check_one(fn, cases[0][0])
    passed = True
    for i, (args, label) in enumerate(cases):
        ok, detail = first if i == 0 else check_one(fn, args)
        passed &= ok
        lines.append(f"  {'PASS' if ok else 'FAIL'} {label}: {detail}")
    lines.append(f"{what}: {'every case passes' if passed else 'some cases fail'}")
    result = ExerciseResult(attempted=attempted, passed=passed, lines=tuple(lines))
    if not attempted and not passed:
        raise AssertionError("the solution fails its own checks:\n" + str(result))
    return result


# ---------------------------------------------------------------------------------------------
# Exercise 1: the tree-ordered reduce-scatter


def reduce_scatter_cases(
    *, world_sizes: Sequence[int] = (2, 3, 4, 5, 6, 8), shard: int = 128, seed: int = 0
) -> list[list[np.ndarray]]:
    """For each N, the N ranks' padded bf16 gradient buffers (N·shard elements each) of one
    unit, with values spread over many magnitudes so that the summation order shows in the bits."""
    rng = np.random.default_rng([seed, 2])
    cases = []
    for n in world_sizes:
        scale = 10.0 ** rng.integers(-3, 3, size=(n, n * shard))
        cases.append([cast(rng.standard_normal(n * shard) * s, "bf16") for s in scale])
    return cases


def expected_reduce_scatter(bufs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The simulation's reduce-scatter (reference/simulate.py), the answer to exercise 1."""
    n = len(bufs)
    shard = bufs[0].size // n
    log: list[list] = [[] for _ in range(n)]
    return reduce_scatter(list(bufs), shard, [0] * n, log, phase="grad", unit=0, kind="model")


def left_to_right_reduce_scatter(bufs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """A plausible wrong answer: ((x_0 + x_1) + x_2) + ... in rank order, not the tree T."""
    n = len(bufs)
    shard = bufs[0].size // n
    out = []
    for r in range(n):
        acc = bufs[0][r * shard : (r + 1) * shard]
        for b in bufs[1:]:
            acc = acc + b[r * shard : (r + 1) * shard]
        out.append(acc)
    return out


def check_reduce_scatter(candidate: Callable, *, fallback: Callable | None = None, cases=None):
    """Exercise 1: candidate(bufs) -> list of N shards; rank r's must be the tree T over ranks
    0..N-1 of slice r, bit for bit (compared as unsigned integers)."""
    cases = reduce_scatter_cases() if cases is None else cases

    def check_one(fn, args):
        (bufs,) = args
        want = expected_reduce_scatter(bufs)
        got = fn([b.copy() for b in bufs])
        if len(got) != len(want):
            return False, f"returned {len(got)} shards, expected {len(want)}"
        bad = 0
        for g, w in zip(got, want):
            g = np.asarray(g)
            if g.dtype != w.dtype or g.shape != w.shape:
                return (
                    False,
                    f"a shard has dtype {g.dtype} shape {g.shape}, want {w.dtype} {w.shape}",
                )
            bad += int(np.count_nonzero(bits(g) != bits(w)))
        naive = left_to_right_reduce_scatter(bufs)
        naive_bad = sum(int(np.count_nonzero(bits(a) != bits(w))) for a, w in zip(naive, want))
        return bad == 0, (
            f"{bad} of {bufs[0].size} elements differ (a left-to-right sum: {naive_bad} differ)"
        )

    labelled = [((c,), f"N = {len(c)}") for c in cases]
    return _run_exercise(candidate, fallback, check_one, labelled, "reduce-scatter")


# ---------------------------------------------------------------------------------------------
# Exercise 2: per-rank memory


def check_resident_bytes(
    candidate: Callable, *, fallback: Callable | None = None, world_sizes=(1, 2, 4, 8)
):
    """Exercise 2: candidate(stage, world_size, padded_numel) -> {category: bytes} for the
    toy problem's configuration (bf16 parameters and gradients, fp32 master, AdamW, M = N),
    compared exactly with what every simulated rank holds after one step."""
    cases = []
    for n in world_sizes:
        problem = toy_problem(world_size=n)
        for stage in range(4):
            cases.append(((stage, n, problem), f"stage {stage}, N = {n}"))

    def check_one(fn, args):
        stage, n, problem = args
        world = simulate(problem, stage).world
        got = dict(fn(stage, n, padded_numel(world)))
        for r in range(n):
            want = world.resident_bytes(r)
            if got != want:
                return False, f"rank {r} holds {want}, you said {got}"
        return True, f"every rank holds {got}"

    return _run_exercise(candidate, fallback, check_one, cases, "resident bytes")
