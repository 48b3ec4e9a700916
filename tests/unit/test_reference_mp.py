"""reference/mp.py: a step over N_m model-parallel slices (docs/design.md §6).

- N_m = 1 is train_step, bit for bit (states, norm).
- A model cut into two slices, with a "replicated" parameter copied on both, steps to the bits
  of the same step on the uncut model (the optimizer is elementwise; one clip coefficient),
  provided the norm counts the copy once. The norm itself differs from the uncut model's only
  by the order of its float64 sum, which is the slices' (s_0 + s_1), not one tree over all
  chunks; so the test clips with a coefficient computed from each side's own norm and checks
  the norms agree within float64 summation error, and counting the copy twice fails by far.
- An overflow in one slice alone skips every slice.
"""

import numpy as np
import pytest

from reference import Hyper, ModelSpec, StepConfig, cast, init_state, train_step
from reference.mp import mp_train_step
from reference.precision import bits
from reference.tree import global_norm, mp_norm

UNITS = [[("w", (6, 8)), ("b", (8,))], [("h", (40,))]]
CFG = StepConfig(
    optimizer="adamw",
    micro_batches=4,
    world_size=2,
    clip_norm=0.5,
    groups=(Hyper(lr=1e-2, weight_decay=0.1),),
)


def draw(seed, shapes, m=4):
    rng = np.random.default_rng(seed)
    return [{n: cast(rng.standard_normal(s), "fp32") for n, s in shapes.items()} for _ in range(m)]


def same(a, b):
    return all(np.array_equal(bits(a[n]), bits(b[n])) for n in a)


def test_one_slice_is_train_step():
    spec = ModelSpec.build(UNITS, chunk=128)
    rng = np.random.default_rng(0)
    master = {n: rng.standard_normal(s).astype(np.float32) for n, s in spec.shapes.items()}
    state = init_state(master, spec, CFG)
    g = draw(1, spec.shapes)
    want, info = train_step(state, g, spec, CFG)
    (got,), ginfo = mp_train_step([state], [g], [spec], CFG, lambda n, m: True)
    assert same(got.master, want.master) and got.steps == want.steps
    assert all(same(got.opt[n], want.opt[n]) for n in want.opt)
    assert np.float64(ginfo.norm).tobytes() == np.float64(info.norm).tobytes()
    parts = [np.arange(5.0), np.ones(3)]
    assert mp_norm([parts]).tobytes() == global_norm(parts).tobytes()


def _split(count_replicated_twice=False):
    """The uncut model's step and the two-slice step: w cut by columns, h cut in halves, b
    replicated (the same gradient bits on both slices, as a TPGPT's replicated ones)."""
    full = ModelSpec.build(UNITS, chunk=128)
    halves = [
        ModelSpec.build([[("w", (6, 4)), ("b", (8,))], [("h", (20,))]], chunk=128) for _ in range(2)
    ]
    rng = np.random.default_rng(2)
    master = {n: rng.standard_normal(s).astype(np.float32) for n, s in full.shapes.items()}
    g = draw(3, full.shapes)

    def cut(d, m):
        return {
            "w": d["w"][:, 4 * m : 4 * m + 4].copy(),
            "b": d["b"].copy(),
            "h": d["h"][20 * m : 20 * m + 20].copy(),
        }

    states = [init_state(cut(master, m), halves[m], CFG) for m in range(2)]
    grads = [[cut(x, m) for x in g] for m in range(2)]
    rule = (lambda n, m: True) if count_replicated_twice else (lambda n, m: n != "b" or m == 0)
    new, info = mp_train_step(states, grads, halves, CFG, rule)
    want, winfo = train_step(init_state(master, full, CFG), g, full, CFG)
    return new, info, want, winfo, cut


def test_two_slices_step_as_the_uncut_model():
    new, info, want, winfo, cut = _split()
    # the norm is a float64 sum of the same squares in another order: within n·2^-53 relative
    # (n = 88 squares; each partial sum of non-negative terms rounds once per addition)
    assert abs(info.norm - winfo.norm) <= 88 * 2.0**-53 * winfo.norm
    # float32 rounding of clip_norm / (norm + eps) absorbs that difference for this draw (a
    # float64 relative change of 1e-14 moves a float32 only across a rounding boundary), and
    # then every slice has the uncut model's bits
    assert info.clip_coef is not None and info.clip_coef == winfo.clip_coef
    for m in range(2):
        assert same(new[m].master, cut(want.master, m))
        for key in want.opt["w"]:
            mine = {n: new[m].opt[n][key] for n in new[m].opt}
            assert same(mine, cut({n: want.opt[n][key] for n in want.opt}, m))


def test_counting_a_replicated_parameter_twice_changes_the_norm():
    _, info, _, winfo, _ = _split(count_replicated_twice=True)
    assert info.norm > winfo.norm * (1 + 1e-6)  # b's squares added twice


def test_overflow_in_one_slice_skips_every_slice():
    spec = ModelSpec.build(UNITS, chunk=128)
    cfg = StepConfig(micro_batches=4, world_size=2, nonfinite="skip")
    master = {n: np.ones(s, np.float32) for n, s in spec.shapes.items()}
    states = [init_state(master, spec, cfg) for _ in range(2)]
    grads = [draw(4, spec.shapes), draw(5, spec.shapes)]
    grads[1][2]["h"][7] = np.float32(np.inf)
    new, info = mp_train_step(states, grads, [spec, spec], cfg, lambda n, m: True)
    assert info.skipped and all(s.t == 0 and s.data_step == 1 for s in new)
    assert all(same(s.master, master) for s in new)


def test_bad_input():
    spec = ModelSpec.build(UNITS, chunk=128)
    with pytest.raises(ValueError, match="states"):
        mp_train_step([], [[]], [spec], CFG, lambda n, m: True)
