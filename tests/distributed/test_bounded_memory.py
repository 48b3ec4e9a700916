"""Long runs stay bounded: the engine's traffic records and a checkpoint's manifest do not grow
with the step count ([Note: bounded traffic records] in zero/common/traffic.py, [Note: bounded
manifests] in zero/workloads/history.py), while the totals and a resumed run's loss history stay
exact."""

import json

import pytest
from engine_tools import mlp_engine, one_step

from zero.collectives import KEEP_STEPS
from zero.ranks.local import get_pool
from zero.workloads.models import mlp_microbatches
from zero.workloads.train import main

STEPS = 300


def _long_run(rank, n):
    model, eng = mlp_engine(2, n, 1)
    sizes, by_step = [], []
    for step in range(STEPS):
        one_step(eng, model, rank, n, 1, step)
        done = eng.counter.step - 1
        by_step.append({kind: eng.counter.volume(done, kind) for kind in ("model", "control")})
        sizes.append(len(eng.counter.records))
    try:
        eng.counter.of_step(0)
        dropped = None
    except ValueError as exc:
        dropped = str(exc)
    totals = {kind: eng.counter.total(kind) for kind in ("model", "control")}
    return sizes, by_step, dropped, totals


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_traffic_records_stay_flat_and_totals_stay_exact():
    """300 steps at stage 2 on 2 ranks: the record count is the same after every step once the
    window of KEEP_STEPS steps is full (today's code grew by a step's records per step); a
    dropped step is refused by name, not answered with an empty list; and the totals equal the
    sum of the per-step volumes read while the steps were still kept."""
    for sizes, by_step, dropped, totals in get_pool(2).run(_long_run):
        full = sizes[KEEP_STEPS:]
        assert len(set(full)) == 1, sorted(set(full))
        assert full[0] <= KEEP_STEPS * max(1, sizes[0]), (full[0], sizes[0])
        assert dropped is not None and "step=0" in dropped and "keep_steps" in dropped
        for kind in ("model", "control"):
            stepped = sum(v[kind][0] for v in by_step)
            # the totals also hold construction's step -1 checks (control traffic only)
            assert totals[kind]["elements"] >= stepped
            if kind == "model":
                assert totals[kind]["elements"] == stepped, (totals[kind], stepped)


FAST = ["--model", "tiny", "--nproc", "1", "--log-every", "1000", "--eval-batches", "1"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_manifest_size_is_flat_and_resume_keeps_the_history(tmp_path):
    """A checkpoint at step 40 has a manifest of the same size as one at step 10 (it held the
    whole loss history, ~130 bytes more per step); resuming from the step-30 checkpoint of a
    run whose history file runs further gives back exactly the history up to the checkpoint,
    and the resumed run's history is the uninterrupted run's (losses and steps)."""
    out = tmp_path / "a"
    args = [*FAST, "--out", str(out), "--eval-every", "10", "--ckpt-every", "10"]
    main([*args, "--steps", "40"])
    ckpt = out / "ckpt"
    sizes = {}
    for d in ckpt.iterdir():
        if d.is_dir() and (d / "manifest.json").is_file():
            m = json.loads((d / "manifest.json").read_text())
            sizes[m["data_step"]] = len((d / "manifest.json").read_bytes())
            assert "history" not in m["extra"], "the manifest embeds the history again"
    assert set(sizes) == {30, 40}, sizes  # keep_last=2
    # the same digit counts: sha256 hex digests and step numbers of equal width
    assert sizes[30] == sizes[40], sizes
    whole = json.loads((out / "train_log.json").read_text())["result"]["history"]

    # resume from the step-30 checkpoint: the history file holds entries up to step 40
    step30 = [d for d in ckpt.iterdir() if d.is_dir() and (d / "manifest.json").is_file()]
    step30 = [d for d in step30 if json.loads((d / "manifest.json").read_text())["data_step"] == 30]
    (ckpt / "latest").write_text(f"{step30[0].name}\n")
    main([*args, "--steps", "40", "--resume"])
    again = json.loads((out / "train_log.json").read_text())["result"]["history"]

    def strip(h):  # tokens/s is a timing; everything else must be the same
        return {k: [{x: v for x, v in e.items() if x != "tokens_per_s"} for e in h[k]] for k in h}

    assert strip(again) == strip(whole)
    assert [e["step"] for e in again["train"]] == list(range(1, 41))


def _in_flight_at_launch(rank, n, stage, deterministic):
    """One step of a 3-unit MLP engine whose stages record, at every reduce-scatter launch,
    how many reductions were already in flight (the new one's buffers are allocated next), and
    at stage 3 the unit's state when its gradient's arrival buffer is allocated; then, after
    backward and before step(), which units still hold a launched reduction (u.pending)."""
    model, eng = mlp_engine(stage, n, 1, deterministic=deterministic)
    queue, seen, states = eng.ctx.reductions, [], []
    for st in eng.stages.values():
        plain = st.reduce_scatter

        def counted(u, *args, _plain=plain, **kwargs):
            seen.append(len(queue))
            return _plain(u, *args, **kwargs)

        st.reduce_scatter = counted
    buckets = eng.ctx.buckets
    arrival = buckets.arrival

    def observed(u, *args):
        states.append(u.state.value if u.state is not None else None)
        return arrival(u, *args)

    buckets.arrival = observed
    batches = mlp_microbatches(model.cfg, seed=0, data_step=0, count=n, batch_size=4)
    _, loss = eng(*batches[rank])
    eng.backward(loss)
    held = [u.index for u in eng.units if u.pending is not None]
    eng.step()
    return seen, states, held, queue.max_inflight


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,deterministic", [(0, True), (1, True), (1, False), (2, False),
                                                 (2, True), (3, False)])  # fmt: skip
def test_reduction_buffers_are_bounded_and_freed_in_backward(stage, deterministic):
    """[Note: bounded reductions in flight], made strict: a reduction's buffers are allocated
    only once fewer than max_inflight others are in flight (the oldest completes first), so
    at most max_inflight sets are ever alive; fast stage 1's reduce-scatters complete in
    backward, so no unit holds its receive buffer (N·L) into step(); and stage 3 frees a
    unit's gathered parameters before its gradient's arrival buffer exists. Each part fails on
    the engine before this change (there the count reached max_inflight, every stage-1 unit
    held a Pending into step(), and the arrival came while the unit was gathered)."""
    for seen, states, held, bound in get_pool(2).run(_in_flight_at_launch, stage, deterministic):
        # every unit launched one; with 3 units the third launch is where the old order had
        # max_inflight (2) already in flight
        assert len(seen) == 3, seen
        assert max(seen) < bound, (seen, bound)
        if stage in (1, 2, 3):
            assert held == [], held  # stage 0 fast waits its in-place all-reduce at step()
        if stage == 3:
            assert states and set(states) == {"sharded"}, states


def _grads_between_steps(rank, n, stage, deterministic, kw):
    """Three steps of an MLP engine with release_grads as `kw` sets it and of one with
    release_grads=False: per step, whether each old gradient buffer was freed (nothing holds a
    reference), and both engines' end-state digests."""
    import time
    import weakref

    from verify.checks.harness import state_digest

    out = {}
    for keep in (False, True):
        options = {**kw, "release_grads": False} if keep else kw
        model, eng = mlp_engine(
            stage, n, 1, deterministic=deterministic, precision="bf16", **options
        )
        freed, ptrs, digests = [], [], []
        before = [u.grad_released for u in eng.units]  # released ones are allocated on first use
        for step in range(3):
            old = [weakref.ref(u.grad) for u in eng.units]
            ptrs.append([u.grad.data_ptr() for u in eng.units])
            result = one_step(eng, model, rank, n, 1, step)
            # gloo's worker thread drops its last completed work (and the tensors it holds) just
            # after the wait returns ([Note: frees on gloo's thread] in measure/tensor_memory.py)
            deadline = time.monotonic() + 5
            released = [r for r, u in zip(old, eng.units, strict=True) if u.grad_released]
            while any(r() is not None for r in released) and time.monotonic() < deadline:
                time.sleep(0.005)
            freed.append([r() is None for r in old])
            digests.append(state_digest(eng, result))
        report = eng.memory_report()["grads"]
        out[keep] = freed, digests, before, [u.grad_released for u in eng.units], ptrs, report
    return out


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,deterministic,kw", [
    (0, True, {}), (1, False, {}), (3, True, {}),  # a CPU's default: kept
    (0, True, {"release_grads": True}), (0, False, {"release_grads": True}),
    (1, True, {"release_grads": True}), (1, False, {"release_grads": True}),
    (2, True, {"release_grads": True}), (2, False, {"release_grads": True}),
    (3, True, {"release_grads": True}), (3, False, {"release_grads": True}),
    (3, True, {"release_grads": True, "persist_below": 1000}),
    (2, True, {"release_grads": True, "contiguous_memory": True}),
    (3, False, {"release_grads": True, "offload_optimizer": True}),
])  # fmt: skip
def test_gradient_buffers_live_within_a_step(stage, deterministic, kw):
    """[Note: gradients live within a step]: with release_grads, each unit's gradient buffer is
    not allocated before the first step and is freed after every update (no reference left
    anywhere: a weak reference to it dies), the next step allocating it again; the end-state
    bits equal those of an engine that keeps its buffers, step by step; memory_report counts
    the buffer with what a step holds either way. contiguous_memory's arena views and
    offload_optimizer's host shards (stages 2-3) stay, at one address, and so does every buffer
    on a CPU by default."""
    releases = kw.get("release_grads") and not (
        kw.get("contiguous_memory") or kw.get("offload_optimizer")
    )
    for out in get_pool(2).run(_grads_between_steps, stage, deterministic, kw):
        (freed, digests, before, released, ptrs, report) = out[False]
        (kept_freed, kept_digests, kept_before, kept_released, kept_ptrs, kept_report) = out[True]
        assert digests == kept_digests  # the release moves no bit
        assert report == kept_report > 0  # reported as a step's model state either way
        assert not any(map(any, kept_freed)) and not any(kept_released + kept_before)
        assert len(set(map(tuple, kept_ptrs))) == 1  # the keeping engine: one buffer per unit
        if releases:
            assert all(map(all, freed)) and all(released) and all(before), (freed, released)
        else:
            assert not any(map(any, freed)) and not any(released + before)
            assert len(set(map(tuple, ptrs))) == 1
