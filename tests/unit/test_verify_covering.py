"""Covering arrays (verify/cells/covering.py): every t-tuple appears, the rows are valid and
reproducible, and the checker itself finds a missing pair."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verify.cells import matrix
from verify.cells.covering import covering_array, required_tuples, uncovered


def all_tuples_present(rows, dims, t):
    """Independent of the module: enumerate every t-subset of dimensions and value combination."""
    names = list(dims)
    seen = {tuple(r[n] for n in names) for r in rows}
    for ds in itertools.combinations(names, t):
        for vs in itertools.product(*(dims[d] for d in ds)):
            if not any(all(row[names.index(d)] == v for d, v in zip(ds, vs)) for row in seen):
                return False, dict(zip(ds, vs))
    return True, None


dims_strategy = st.dictionaries(
    st.sampled_from("abcdefgh"),
    st.integers(1, 4).map(lambda k: tuple(range(k))),
    min_size=2,
    max_size=6,
)


@given(dims=dims_strategy, t=st.integers(2, 3), seed=st.integers(0, 3))
def test_every_tuple_appears(dims, t, seed):
    t = min(t, len(dims))
    rows = covering_array(dims, strength=t, seed=seed)
    ok, missing = all_tuples_present(rows, dims, t)
    assert ok, missing
    assert uncovered(rows, dims, t) == []
    assert all(set(r) == set(dims) and all(r[k] in dims[k] for k in dims) for r in rows)
    # never more rows than the full product, never fewer than the largest t-product
    sizes = sorted((len(v) for v in dims.values()), reverse=True)
    full = 1
    for s in sizes:
        full *= s
    floor = 1
    for s in sizes[:t]:
        floor *= s
    assert floor <= len(rows) <= full


def test_the_matrix_presets_cover_pairs_and_triples():
    for t in (2, 3):
        rows = covering_array(matrix.DIMENSIONS, strength=t)
        ok, missing = all_tuples_present(rows, matrix.DIMENSIONS, t)
        assert ok, missing
        # far fewer cells than the 69,120 of the product
        assert len(rows) <= {2: 40, 3: 140}[t]


def test_rows_are_reproducible_and_seeded():
    a = covering_array(matrix.DIMENSIONS, strength=2, seed=0)
    b = covering_array(matrix.DIMENSIONS, strength=2, seed=0)
    c = covering_array(matrix.DIMENSIONS, strength=2, seed=1)
    assert a == b and a != c


def test_the_checker_reports_a_missing_pair():
    dims = {"x": (0, 1), "y": (0, 1), "z": (0, 1)}
    # a minimal pairwise array of three binary dimensions: each row is needed
    rows = [
        {"x": 0, "y": 0, "z": 0},
        {"x": 0, "y": 1, "z": 1},
        {"x": 1, "y": 0, "z": 1},
        {"x": 1, "y": 1, "z": 0},
    ]
    assert uncovered(rows, dims, 2) == []
    for i in range(4):
        missing = uncovered(rows[:i] + rows[i + 1 :], dims, 2)
        assert len(missing) == 3  # the three pairs only that row held
        assert all(pair.items() <= rows[i].items() for pair in missing)


def test_constraints_remove_tuples_and_are_respected():
    dims = {"stage": (0, 1, 2, 3), "n": (1, 2, 3), "mode": ("det", "fast")}

    def allowed(partial):  # say stage 3 never runs at N = 1
        return not (partial.get("stage") == 3 and partial.get("n") == 1)

    rows = covering_array(dims, strength=2, allowed=allowed)
    assert all(allowed(r) for r in rows)
    assert uncovered(rows, dims, 2, allowed) == []
    assert len(required_tuples(dims, 2, allowed)) == len(required_tuples(dims, 2)) - 1


@pytest.mark.parametrize(
    "dims, strength, field",
    [
        ({}, 2, "dims"),
        ({"a": ()}, 1, "dims"),
        ({"a": (1, 1)}, 1, "distinct"),
        ({"a": (1, 2)}, 2, "strength"),
    ],
)
def test_bad_input_names_the_field(dims, strength, field):
    with pytest.raises(ValueError, match=field):
        covering_array(dims, strength=strength)


def test_an_unsatisfiable_constraint_is_an_error():
    dims = {"a": (0, 1), "b": (0, 1), "c": (0, 1)}

    def allowed(p):  # pairs are each fine, but a = 1, b = 1 leaves no value for c
        return not (p.get("a") == 1 and p.get("b") == 1 and "c" in p)

    with pytest.raises(ValueError, match="no allowed row"):
        covering_array(dims, strength=2, allowed=allowed)
