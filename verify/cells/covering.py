"""Covering arrays: few rows in which every combination of t dimension values appears.

The verification matrix has a dozen dimensions (stage, N, precision, optimizer, clipping, M/N,
unit size, parameter sizes, overlap, mode, where the gradients come from). Their full product is
tens of thousands of cells; a bug that needs a particular *pair* (say stage 3 with N = 3) or
*triple* of values to show is still found by any set of rows that contains every pair (triple).
Such a set is a covering array of strength t, and it has roughly (largest dimension)^t rows
instead of the product of all dimensions.

Construction (greedy, in the style of AETG: Cohen et al., IEEE TSE 1997): keep the set of
t-tuples not yet covered; build each new row from several candidates, each started from an
uncovered tuple and completed dimension by dimension with the value that covers the most
uncovered tuples together with the values already chosen; keep the candidate that covers the
most. A candidate always covers the tuple it started from, so every row makes progress and the
loop ends. Every random choice comes from `random.Random(seed)`, so the same call returns the
same rows on every machine and Python version.

Constraints: `allowed(partial)` receives a dict of some dimensions' values and returns False if
no valid row may contain them. Tuples it rejects are not required, and rows are only completed
with allowed values.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Mapping, Sequence

Row = dict[str, object]
Tuple_ = tuple[tuple[int, ...], tuple[int, ...]]  # (dimension indices, value indices)


def _check(dims: Mapping[str, Sequence], strength: int) -> None:
    if not dims:
        raise ValueError("dims={}: at least one dimension is needed")
    for name, values in dims.items():
        if len(values) == 0:
            raise ValueError(f"dims[{name!r}] is empty: every dimension needs a value")
        if len(set(map(repr, values))) != len(values):
            raise ValueError(f"dims[{name!r}]={list(values)!r}: values must be distinct")
    if not isinstance(strength, int) or not 1 <= strength <= len(dims):
        raise ValueError(f"strength={strength!r}: allowed are 1..{len(dims)} (the dimensions)")


def required_tuples(
    dims: Mapping[str, Sequence], strength: int, allowed: Callable[[Row], bool] | None = None
) -> set[Tuple_]:
    """Every t-tuple of (dimension, value) that a covering array must contain."""
    _check(dims, strength)
    names = list(dims)
    out: set[Tuple_] = set()
    for ds in itertools.combinations(range(len(names)), strength):
        for vs in itertools.product(*(range(len(dims[names[d]])) for d in ds)):
            partial = {names[d]: dims[names[d]][v] for d, v in zip(ds, vs)}
            if allowed is None or allowed(partial):
                out.add((ds, vs))
    return out


def _covered_by(row: Sequence[int], strength: int) -> set[Tuple_]:
    return {(ds, tuple(map(row.__getitem__, ds))) for ds in _combinations(len(row), strength)}


@functools.cache
def _combinations(k: int, strength: int) -> tuple:
    return tuple(itertools.combinations(range(k), strength))


def uncovered(
    rows: Sequence[Mapping[str, object]],
    dims: Mapping[str, Sequence],
    strength: int,
    allowed: Callable[[Row], bool] | None = None,
) -> list[Row]:
    """The required t-tuples that no row contains, as partial dicts (empty: rows cover all)."""
    names = list(dims)
    index = [{repr(v): i for i, v in enumerate(dims[n])} for n in names]
    have: set[Tuple_] = set()
    for row in rows:
        have |= _covered_by([index[d][repr(row[n])] for d, n in enumerate(names)], strength)
    missing = sorted(required_tuples(dims, strength, allowed) - have)
    return [{names[d]: dims[names[d]][v] for d, v in zip(ds, vs)} for ds, vs in missing]


def covering_array(
    dims: Mapping[str, Sequence],
    *,
    strength: int = 2,
    seed: int = 0,
    allowed: Callable[[Row], bool] | None = None,
    candidates: int = 12,
) -> list[Row]:
    """Rows (dicts dimension -> value) containing every allowed t-tuple of values at least once.

    dims: dimension name -> its values (distinct); strength: t; seed: the only source of the
    rows' order and choices; candidates: rows tried per row kept (more: fewer rows, slower).
    """
    _check(dims, strength)
    if candidates < 1:
        raise ValueError(f"candidates={candidates}: must be >= 1")
    names = list(dims)
    k = len(names)
    sizes = [len(dims[n]) for n in names]
    todo = required_tuples(dims, strength, allowed)
    pending = sorted(todo)  # a stable order to draw starting tuples from
    rng = random.Random(seed)

    def ok(assign: dict[int, int]) -> bool:
        if allowed is None:
            return True
        return allowed({names[d]: dims[names[d]][v] for d, v in assign.items()})

    def gains(assign: dict[int, int], d: int, options: list[int]) -> list[int]:
        """For each v of options: the uncovered tuples that d = v completes together with the
        values already assigned (each tuple's dimensions in order, d's place kept open)."""
        keys = []
        for rest in itertools.combinations(sorted(assign), strength - 1):
            ds = tuple(sorted((*rest, d)))
            at = ds.index(d)
            vals = tuple(assign[x] for x in ds if x != d)
            keys.append((ds, vals[:at], vals[at:]))
        return [sum((ds, (*a, v, *b)) in todo for ds, a, b in keys) for v in options]

    rows: list[Row] = []
    while todo:
        if len(pending) > 4 * len(todo):  # keep the draws below cheap
            pending = sorted(todo)
        best, best_gain = None, -1
        for _ in range(candidates):
            # start from an uncovered tuple (rejection-sampled from the pending list)
            while True:
                start = pending[rng.randrange(len(pending))]
                if start in todo:
                    break
            assign = dict(zip(*start))
            free = [d for d in range(k) if d not in assign]
            rng.shuffle(free)
            dead = False
            for d in free:
                options = [v for v in range(sizes[d]) if ok({**assign, d: v})]
                if not options:
                    dead = True
                    break
                scores = gains(assign, d, options)
                top = max(scores)
                assign[d] = rng.choice([v for v, s in zip(options, scores) if s == top])
            if dead:
                continue
            row = [assign[d] for d in range(k)]
            g = len(_covered_by(row, strength) & todo)
            if g > best_gain:
                best, best_gain = row, g
        if best is None:
            raise ValueError(
                f"covering_array: no allowed row contains {dict(zip(*pending[-1]))}; the "
                "constraint admits the tuple alone but no complete row"
            )
        todo -= _covered_by(best, strength)
        rows.append({names[d]: dims[names[d]][best[d]] for d in range(k)})
    return rows
