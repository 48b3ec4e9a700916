"""A dropped engine frees what it holds ([Note: gradient hooks hold the engine weakly] in
zero/hooks.py).

An engine and its module, dropped after training, must leave no tensor of theirs alive: in one
process that builds engine after engine (a benchmark, a notebook, a sweep) every leaked engine
is a whole model's states. A module that outlives its engine keeps no hook of the engine.
"""

import datetime
import gc
import weakref

import pytest
import torch.distributed as dist
from engine_tools import mlp_engine, one_step, patched

import zero.hooks
from zero import collectives
from zero.ranks.local import get_pool
from zero.workloads.models import mlp_microbatches

pytestmark = pytest.mark.timeout(300)

OPTIONS = {
    "plain": {},
    "checkpointing + contiguous": {"activation_checkpointing": True, "contiguous_memory": True},
    "offload": {"offload_optimizer": True, "offload_activations": True,
                "activation_checkpointing": True},
}  # fmt: skip


def _strong_hook(engine_ref, index, i):
    """The defect planted: a hook that closes over the engine itself."""
    engine = engine_ref()

    def post_accumulate(_param) -> None:
        u = engine.units[index]
        u.used[i] = True
        u.ready += 1
        if u.ready == len(u.params):
            engine.launch_ready()

    return post_accumulate


def _train_and_drop(rank, n, stage, deterministic, options, keep_module, planted=False):
    """Two steps, then drop the engine (and the module unless keep_module). Returns whether the
    engine, its first unit's master and working buffer, and the module are still alive after a
    full collection, and how many post-accumulate-grad hooks the module's parameters carry."""
    k = 2
    with patched(zero.hooks, **({"_post_accumulate": _strong_hook} if planted else {})):
        model, eng = mlp_engine(stage, n, k, deterministic, "bf16", optimizer="adamw", **options)
    for step in range(2):
        one_step(eng, model, rank, n, k, step)
    watched = {
        "engine": weakref.ref(eng),
        "master": weakref.ref(eng.units[0].master),
        "working": weakref.ref(eng.units[0].working),
        "module": weakref.ref(model),
    }
    del eng
    if not keep_module:
        del model
    gc.collect()
    alive = sorted(name for name, ref in watched.items() if ref() is not None)
    hooks = 0
    if keep_module:  # parameter hooks, module hooks, and checkpointing wrappers left behind
        hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
        for m in model.modules():
            hooks += len(m._forward_pre_hooks) + len(m._forward_hooks) + ("forward" in vars(m))
    return alive, hooks


@pytest.mark.dist
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
def test_a_dropped_engine_frees_its_tensors(options, deterministic):
    for stage in range(4):
        got = get_pool(2).run(_train_and_drop, stage, deterministic, OPTIONS[options], False)
        assert got == [([], 0)] * 2, f"stage {stage}: still alive per rank {got}"


@pytest.mark.dist
@pytest.mark.parametrize("options", ["plain", "checkpointing + contiguous"])
def test_a_module_outliving_its_engine_keeps_no_hook(options):
    """Stages 0-2: the module keeps nothing of the engine. Stage 3: its parameters are the
    engine's Stage3Parameter views, each naming its unit, so the units stay with the module;
    the engine and every hook still go."""
    for stage in range(4):
        got = get_pool(2).run(_train_and_drop, stage, True, OPTIONS[options], True)
        kept = ["master", "module", "working"] if stage == 3 else ["module"]
        assert got == [(kept, 0)] * 2, f"stage {stage}: per rank {got}"


@pytest.mark.dist
def test_a_hook_holding_the_engine_is_seen_leaking():
    """The check sees the defect it guards against: with the hook closing over the engine the
    engine and its buffers outlive the drop."""
    got = get_pool(2).run(_train_and_drop, 0, True, {}, False, True)
    assert got == [(["engine", "master", "module", "working"], 0)] * 2


def _backward_and_drop(rank, n, stage, deterministic):
    """A backward whose step() never comes (an error, or a rebuilt engine), then the engine
    dropped: its collectives still in flight are parked ([Note: abandoned collectives] in
    zero/collectives.py), and the group's next collective completes."""
    collectives._ABANDONED.clear()
    model, eng = mlp_engine(stage, n, 1, deterministic, "fp32", optimizer="adamw")
    x, y = mlp_microbatches(model.cfg, seed=0, data_step=0, count=n, batch_size=4)[rank]
    eng.backward(eng(x, y)[1])
    del eng, model
    gc.collect()
    parked = len(collectives._ABANDONED)
    work = dist.barrier(async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=30))
    except RuntimeError as e:
        return parked, f"barrier: {e}"
    return parked, "barrier ok"


@pytest.mark.dist
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
def test_an_engine_dropped_mid_step_leaves_its_group_usable(deterministic):
    for stage in range(4):
        got = get_pool(2).run(_backward_and_drop, stage, deterministic)
        assert [g[1] for g in got] == ["barrier ok"] * 2, f"stage {stage}: {got}"
        if stage == 0 and deterministic:  # R's all-gather, launched in backward, is in flight
            assert all(parked > 0 for parked, _ in got), got
