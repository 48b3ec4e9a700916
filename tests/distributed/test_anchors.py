"""External anchors: the reference against plain PyTorch and DDP, in lock-step
(verify/parity/anchors.py).

Every bound used here is derived in verify/parity/anchors.py's module docstring (checks 1-5); the
tests
assert them, show that an error of 10x a bound fails, and plant semantics bugs (a missing 1/M,
coupled weight decay) that the anchors must catch by a wide margin.
"""

import importlib.util
from dataclasses import replace
from functools import reduce

import numpy as np
import pytest

from verify.parity.anchors import (
    CHECKS,
    STATES,
    Anchor,
    Recipe,
    check_run,
    check_step,
    ddp_payload,
    ddp_run,
    deepspeed_run,
    plain_run,
    reference_run,
    step_bounds,
    worst,
)
from zero.ranks.local import get_pool

# Four lock-steps on the harness's GPT (tied head), M = 8, clipping at 0.5: steps 0, 2 and 3
# clip, step 1 does not (asserted below), so both branches of the clip are exercised.
ANCHOR = Anchor(model="gpt", micro_batches=8, steps=4, clip_norm=0.5)
BUGS = {"missing 1/M": Recipe(divide_loss=False), "coupled decay": Recipe(torch_optimizer="Adam")}


@pytest.fixture(scope="module")
def reference():
    return reference_run(ANCHOR)


@pytest.fixture(scope="module")
def plain(reference):
    return plain_run(ANCHOR, reference[2])


def report(name, ratios):
    line = ", ".join(f"{k} {v:.3g}" for k, v in worst(ratios).items())
    print(f"anchor {name}: worst diff/bound: {line}")
    return line


def test_clipping_is_exercised_both_ways(reference):
    clipped = [s.info.clip_coef is not None for s in reference[2]]
    assert any(clipped) and not all(clipped), clipped


def test_plain_pytorch_gradient_is_the_sequential_sum_bitwise(reference, plain):
    """Assumptions A1 and A2, checked: the textbook recipe's accumulated .grad is exactly the
    sequential float32 sum of the reference's g_j, times 1/M (a power of two, so exact)."""
    _, _, steps = reference
    for s, p in zip(steps, plain):
        for name, got in p.grad.items():
            seq = reduce(lambda acc, g: acc + g[name], s.grads[1:], s.grads[0][name].copy())
            want = seq * np.float32(1 / ANCHOR.micro_batches)
            assert got.dtype == want.dtype == np.float32
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_plain_pytorch_anchor(reference, plain):
    """torch.optim.AdamW + clip_grad_norm_ + (loss / M).backward(): every check of every
    lock-step within its derived bound (ratio <= 1)."""
    spec, rcfg, steps = reference
    ratios = check_run(spec, rcfg, steps, plain)
    line = report("plain", ratios)
    assert all(r[k] <= 1 for r in ratios for k in CHECKS), line
    # Not vacuous: torch's AdamW (lerp, addcdiv) and the reference really differ in bits.
    assert any(
        np.any(p.master[n] != s.after.master[n]) for s, p in zip(steps, plain) for n in p.master
    )


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_ddp_anchor(reference, n):
    """DDP at N ranks (no_sync for all but each rank's last micro-batch, loss / (M/N), DDP's
    average over ranks, gloo's all-reduce order): within the same bounds on every rank."""
    spec, rcfg, steps = reference
    per_rank = get_pool(n).run(ddp_run, ANCHOR, ddp_payload(steps), Recipe())
    ratios = [r for peers in per_rank for r in check_run(spec, rcfg, steps, peers)]
    line = report(f"ddp N={n}", ratios)
    assert all(r[k] <= 1 for r in ratios for k in CHECKS), line


def test_ten_times_the_bound_fails(reference, plain):
    """Twin of every check: an error of 10x the bound, on the element with the largest bound,
    must fail that check (diff >= 10·bound - |true diff| >= 9·bound)."""
    spec, rcfg, steps = reference
    s, p = steps[0], plain[0]
    b = step_bounds(spec, rcfg, s)
    assert check_step(s, p, b)["norm"] <= 1
    broken = check_step(s, replace(p, norm=p.norm + 10 * b.norm), b)
    assert broken["norm"] > 1
    fields = {"grad": ("grad", None), "master": ("master", "p")}
    fields.update({k: ("opt", k) for k in STATES})
    for check, (attr, key) in fields.items():
        bound = {n: (b.grad[n] if key is None else b.state[n][key]) for n in spec.names}
        name = max(bound, key=lambda n: float(bound[n].max()))
        i = np.unravel_index(np.argmax(bound[name]), bound[name].shape)
        held = getattr(p, attr)
        arr = (held[name] if attr != "opt" else held[name][key]).astype(np.float64)
        arr[i] += 10 * bound[name][i]
        if attr == "opt":
            new = {**held, name: {**held[name], key: arr}}
        else:
            new = {**held, name: arr}
        got = check_step(s, replace(p, **{attr: new}), b)
        assert got[check] > 1, (check, got)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_plain_anchor_catches_planted_semantics_bugs(reference, bug):
    """A missing 1/M makes the gradient M times too large: check 1 fails by ~1e6. Clipping
    then divides most of it out again (clip and Adam are nearly scale-invariant), so only the
    step that does not clip shows it in the parameters; that is why check 1 exists. Coupled
    weight decay (torch.optim.Adam) moves the update by ~lr·wd·|p|/|g| relative: check 5 fails
    by ~1e3."""
    spec, rcfg, steps = reference
    ratios = check_run(spec, rcfg, steps, plain_run(ANCHOR, steps, BUGS[bug]))
    w = worst(ratios)
    report(f"plain with {bug}", ratios)
    if bug == "missing 1/M":
        assert w["grad"] > 1e3
        unclipped = [r for r, s in zip(ratios, steps) if s.info.clip_coef is None]
        assert max(r["master"] for r in unclipped) > 100
    else:
        assert w["grad"] <= 1 and w["norm"] <= 1  # the gradient is right ...
        assert w["master"] > 100  # ... the update is not


@pytest.mark.dist
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_ddp_anchor_catches_planted_semantics_bugs(reference, bug):
    spec, rcfg, steps = reference
    per_rank = get_pool(2).run(ddp_run, ANCHOR, ddp_payload(steps), BUGS[bug])
    w = worst(check_run(spec, rcfg, steps, per_rank[0]))
    assert w["grad" if bug == "missing 1/M" else "master"] > 100, w


# DeepSpeed: one lock-step (the first) with one parameter group (verify/parity/anchors.py explains
# why);
# M = 8 at N = 2 is 4 accumulation steps per rank, and the first step clips (asserted).
DS_ANCHOR = Anchor(model="gpt", micro_batches=8, steps=1, clip_norm=0.5, one_group=True)


@pytest.fixture(scope="module")
def ds_reference():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")
    return reference_run(DS_ANCHOR)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_anchor(ds_reference, stage):
    """DeepSpeed ZeRO-1/2's own recipe (engine.backward's 1/(M/N), its ZeRO average over N, its
    gradient_clipping, torch's AdamW as client optimizer): the first step within the same
    derived bounds, on every rank."""
    spec, rcfg, steps = ds_reference
    assert steps[0].info.clip_coef is not None  # DeepSpeed's clipping is exercised
    per_rank = get_pool(2).run(deepspeed_run, DS_ANCHOR, ddp_payload(steps), stage, Recipe())
    ratios = [r for peers in per_rank for r in check_run(spec, rcfg, steps, peers)]
    line = report(f"deepspeed-s{stage} N=2", ratios)
    assert all(r[k] <= 1 for r in ratios for k in CHECKS), line


@pytest.mark.dist
def test_deepspeed_anchor_catches_a_missing_one_over_m(ds_reference):
    """engine.backward(loss, scale_wrt_gas=False): the gradient is M/N times too large."""
    spec, rcfg, steps = ds_reference
    broken = Recipe(divide_loss=False)
    per_rank = get_pool(2).run(deepspeed_run, DS_ANCHOR, ddp_payload(steps), 2, broken)
    assert worst(check_run(spec, rcfg, steps, per_rank[0]))["grad"] > 100


def test_anchor_rejects_inexact_averaging():
    with pytest.raises(ValueError, match="micro_batches=6"):
        Anchor(micro_batches=6)
