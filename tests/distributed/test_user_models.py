"""Bringing your own model (docs/models.md): what the engine supports, and what it refuses by
name instead of training something else quietly.

Each worker returns what happened (a value, or the error's type and message) instead of raising,
so that an expected refusal does not break the shared worker pool.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from reference import Hyper
from zero import build as zunits
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.local import get_pool
from zero.workloads.models import GPT, MLP, GPTConfig, MLPConfig


def outcome(fn, *args):
    """fn(*args), or ("error", type name, message): refusals travel back as values."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return ("error", type(e).__name__, str(e))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Two blocks in a ModuleList and a head; `bypass` calls block 0's layers, not block 0."""

    def __init__(self, d=8, bypass=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 2)
        self.bypass = bypass

    def forward(self, x, y):
        for i, b in enumerate(self.blocks):
            x = b.fc2(torch.tanh(b.fc1(x))) if self.bypass and i == 0 else b(x)
        return F.mse_loss(self.head(x), y)


def build(rank, n, stage, units, model="net", dtype=None, freeze=None, bypass=False):
    del rank
    m = Net(bypass=bypass) if model == "net" else MLP(MLPConfig(d_in=8, d_hidden=8, d_out=2))
    if dtype is not None:
        m = m.to(dtype)
    if freeze is not None:
        m.get_parameter(freeze).requires_grad_(False)
    cfg = ZeroConfig(stage=stage, micro_batches=n, chunk=128, units=units)
    return outcome(_one_step, m, cfg, n)


def _one_step(m, cfg, n):
    eng = ZeroEngine(m, cfg)
    x, y = torch.ones(4, 8), torch.zeros(4, 2)
    if isinstance(m, MLP):
        eng.backward(eng(x, y)[1])
    else:
        eng.backward(eng(x, y))
    return eng.step().loss


def run_build(*args, **kw):
    return get_pool(2).run(_build_kw, args, kw)[0]


def _build_kw(rank, n, args, kw):
    return build(rank, n, *args, **kw)


# -- 1. parameter dtypes ------------------------------------------------------------------------


@pytest.mark.dist
def test_float64_parameters_are_refused_by_name():
    got = run_build(0, (), model="mlp", dtype=torch.float64)
    assert got[:2] == ("error", "ValueError"), got
    assert "'layers.0.weight'" in got[2] and "torch.float64" in got[2], got
    assert "torch.float32" in got[2], got


# -- 2. units -----------------------------------------------------------------------------------


@pytest.mark.dist
def test_nested_units_are_refused_naming_both():
    got = run_build(0, ("blocks.0", "blocks.0.fc1"))
    assert got[:2] == ("error", "ValueError"), got
    assert "'blocks.0'" in got[2] and "'blocks.0.fc1'" in got[2], got


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])
def test_a_module_list_unit_is_refused_with_advice(stage):
    got = run_build(stage, ("blocks",))
    assert got[:2] == ("error", "ValueError"), got
    assert "ModuleList" in got[2] and "'blocks.0', 'blocks.1'" in got[2], got
    assert "zero.build.auto" in got[2], got


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_unit_whose_forward_is_never_called_is_named(stage):
    got = run_build(stage, ("blocks.0", "blocks.1"), bypass=True)
    assert got[0] == "error", got
    assert "'blocks.0'" in got[2] and "never called" in got[2], got


# -- 3. frozen parameters -----------------------------------------------------------------------


def frozen_step(rank, n, stage, freeze):
    """One step of Net with `freeze` frozen: (loss, frozen value before, after, a trained
    parameter before, after); tests/distributed/test_frozen.py checks the bits in depth."""
    del rank
    m = Net()
    for name in freeze:
        m.get_parameter(name).requires_grad_(False)
    cfg = ZeroConfig(stage=stage, micro_batches=n, chunk=128, units=("blocks.0", "blocks.1"))
    return outcome(_frozen_step, m, cfg, freeze)


def _frozen_step(m, cfg, freeze):
    eng = ZeroEngine(m, cfg)
    with eng.gathered_params():
        before = {k: p.detach().clone() for k, p in m.named_parameters()}
    eng.backward(eng(torch.ones(4, 8), torch.zeros(4, 2)))
    loss = eng.step().loss
    with eng.gathered_params():
        after = {k: p.detach().clone() for k, p in m.named_parameters()}
    return loss, before, after, {k: p.requires_grad for k, p in m.named_parameters()}


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_parameters_are_held_not_trained(stage):
    """Formerly refused by name; now supported (docs/models.md "Parameters"): a frozen
    parameter, and a unit whose parameters are all frozen, keep their values bit for bit while
    the rest trains."""
    freeze = ("blocks.1.fc1.bias", "blocks.0.fc1.weight", "blocks.0.fc1.bias")
    freeze += ("blocks.0.fc2.weight", "blocks.0.fc2.bias")  # blocks.0 all frozen
    got = get_pool(2).run(frozen_step, stage, freeze)[0]
    assert got[0] != "error", got
    _, before, after, trains = got
    for k in before:
        same = torch.equal(before[k].view(torch.int32), after[k].view(torch.int32))
        assert same == (k in freeze), k
        assert trains[k] == (k not in freeze), k


@pytest.mark.dist
def test_a_model_with_nothing_to_train_is_refused():
    names = tuple(n for n, _ in Net().named_parameters())
    got = get_pool(2).run(frozen_step, 0, names)[0]
    assert got[:2] == ("error", "ValueError"), got
    assert "requires_grad=True" in got[2] and "nothing to train" in got[2], got


# -- 4. buffers ---------------------------------------------------------------------------------


class CNN(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, device=device), nn.BatchNorm2d(8, device=device)
        )
        self.head = nn.Linear(8, 4, device=device)
        if device != "meta":
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, y):
        h = torch.relu(self.body(x)).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h).float(), y)


def cnn_batch(step, j):
    g = torch.Generator().manual_seed(1000 * step + j)
    # each rank's data has its own mean, so unsynchronised running stats drift apart
    return torch.randn(4, 3, 6, 6, generator=g) + j, torch.randint(0, 4, (4,), generator=g)


def bn_state(model):
    bn = model.body[1]
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


def cnn_engine_vs_ddp(rank, n, stage, steps=3, lr=0.1):
    """The CNN trained by the engine and by DDP(broadcast_buffers=True) with plain SGD on the
    same micro-batches (M = N); then one eval forward (which broadcasts in both)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours = CNN()
    cfg = ZeroConfig(
        stage=stage,
        micro_batches=n,
        chunk=128,
        optimizer="sgd",
        groups=(Hyper(lr=lr, momentum=0.0, weight_decay=0.0),),
        units=("body",),
    )
    eng = ZeroEngine(ours, cfg)
    theirs = CNN()
    ddp = DDP(theirs, broadcast_buffers=True)
    step_size = torch.tensor(lr, dtype=torch.float32)
    trained = []
    for s in range(steps):
        x, y = cnn_batch(s, rank)
        eng.backward(eng(x, y))
        eng.step()
        theirs.zero_grad()
        ddp(x, y).backward()
        with torch.no_grad():  # reference/optim.py's SGD: p - s(lr)·g, two roundings
            for p in theirs.parameters():
                p.copy_(p - step_size * p.grad)
        trained.append((bn_state(ours), bn_state(theirs)))
    with torch.no_grad():
        ours.eval(), theirs.eval()
        x, y = cnn_batch(steps, rank)
        eng(x, y), ddp(x, y)
    with eng.gathered_params():
        params = {k: p.detach().clone() for k, p in ours.named_parameters()}
    return bn_state(ours), bn_state(theirs), trained, params, dict(theirs.named_parameters())


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_batchnorm_buffers_equal_ddp_broadcast_buffers(stage):
    """Rank 0's buffers go to every rank before each forward, as DDP does: after training and
    one eval forward the running statistics are the same on every rank and bitwise DDP's. At
    N = 2 with M = N in fp32 the arithmetic is DDP's: the engine's tree sum of two gradients is
    DDP's a/2 + b/2 up to the exact factor 1/2, and SGD is p - s(lr)·g in both, so the
    parameters, hence the batch statistics, hence the running statistics, agree bit for bit.
    (The DDP side applies reference/optim.py's SGD by hand: torch.optim.SGD fuses the
    multiply-add and differs in the last bit, which the optimizer anchors cover elsewhere.)"""
    per_rank = get_pool(2).run(cnn_engine_vs_ddp, stage)
    for ours, theirs, trained, params, ddp_params in per_rank:
        for k, p in params.items():
            assert torch.equal(p, ddp_params[k].detach()), k
        for a, b in trained:  # during training every rank updates from its own batch
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
        for x, y, r0 in zip(ours, theirs, per_rank[0][0], strict=True):
            assert torch.equal(x, y) and torch.equal(x, r0)
    assert not torch.equal(per_rank[0][2][-1][0][0], per_rank[1][2][-1][0][0])  # data differs


def cnn_buffers(rank, n, stage, precision, broadcast=True, meta=False):
    model = CNN(device="meta" if meta else None)
    cfg = ZeroConfig(
        stage=stage,
        precision=precision,
        micro_batches=n,
        chunk=128,
        units=("body",),
        broadcast_buffers=broadcast,
    )
    eng = ZeroEngine(model, cfg, device="cpu")
    losses = []
    for s in range(2):
        x, y = cnn_batch(s, rank)
        eng.backward(eng(x, y))
        losses.append(eng.step().loss)
    buffers = [
        r for r in eng.counter.records if r.phase == "buffers" and r.step == eng.counter.step - 1
    ]
    return losses, bn_state(model), [(r.kind, r.elements) for r in buffers]


@pytest.mark.dist
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("meta", [False, True])
def test_batchnorm_trains_in_mixed_precision(precision, meta):
    """Floating buffers take the compute dtype, as the parameters do (docs/models.md)."""
    per_rank = get_pool(2).run(cnn_buffers, 3, precision, True, meta)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for losses, state, _ in per_rank:
        assert all(torch.isfinite(torch.tensor(losses)))
        assert state[0].dtype == dtype and state[2].dtype == torch.int64
        assert int(state[2]) == 2


@pytest.mark.dist
def test_buffer_broadcast_is_control_traffic_and_can_be_turned_off():
    on = get_pool(2).run(cnn_buffers, 2, "fp32", True)
    off = get_pool(2).run(cnn_buffers, 2, "fp32", False)
    # running_mean, running_var (float32) and num_batches_tracked (int64): one call per dtype
    assert sorted(on[0][2]) == [("control", 1), ("control", 16)]
    assert on[0][1][0].equal(on[1][1][0]) is False  # the last forward's own batch, per rank
    assert off[0][2] == []
    with pytest.raises(ValueError, match="broadcast_buffers"):
        ZeroConfig(broadcast_buffers=1)


def cnn_checkpoint(rank, n, directory):
    from zero.checkpoint import consolidate

    model = CNN()
    eng = ZeroEngine(model, ZeroConfig(stage=2, micro_batches=n, chunk=128, units=("body",)))
    for s in range(2):
        x, y = cnn_batch(s, rank)
        eng.backward(eng(x, y))
        eng.step()
    mine = bn_state(model)
    eng.save(directory)
    fresh = CNN()
    eng2 = ZeroEngine(fresh, ZeroConfig(stage=3, micro_batches=n, chunk=128, units=("body",)))
    eng2.load(directory)
    out = None
    if rank == 0:
        out = consolidate(directory)["model"]["body.1.running_mean"]
    return mine, bn_state(fresh), out


@pytest.mark.dist
def test_checkpoints_keep_rank_zeros_buffers(tmp_path):
    per_rank = get_pool(2).run(cnn_checkpoint, str(tmp_path / "ckpt"))
    zero_state = per_rank[0][0]
    for _, loaded, _ in per_rank:
        for a, b in zip(loaded, zero_state, strict=True):
            assert torch.equal(a, b)
    assert torch.equal(per_rank[0][2], zero_state[0])


# -- 5. stage-3 metadata ------------------------------------------------------------------------


def stage3_metadata(rank, n):
    del rank
    model = Net()
    ZeroEngine(model, ZeroConfig(stage=3, micro_batches=n, chunk=128, units=("blocks.0",)))
    p = model.blocks[0].fc1.weight
    meta = (p.is_contiguous(), p.is_floating_point(), p.dim(), p.numel(), tuple(p.shape))
    meta += (p.dtype, p.device.type, p.requires_grad)
    return meta, outcome(lambda: float(p.sum()))


@pytest.mark.dist
def test_stage3_metadata_reads_outside_a_gather():
    """Each metadata call docs/models.md lists works on a sharded parameter; a value does not."""
    got, value = get_pool(2).run(stage3_metadata)[0]
    assert got == (True, True, 2, 64, (8, 8), torch.float32, "cpu", True)
    assert value[0] == "error" and "'blocks.0.fc1.weight' of unit blocks.0 is sharded" in value[2]


def numpy_inside_a_gather(rank, n, touch):
    """One step after (touch=True) taking .numpy() of a parameter inside gathered_params()."""
    torch.set_num_threads(1)
    model = Net()
    eng = ZeroEngine(model, ZeroConfig(stage=3, micro_batches=n, chunk=128, units=("blocks.0",)))
    kept = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with eng.gathered_params():
            if touch:
                arr = model.blocks[0].fc1.weight.detach().numpy()
                kept = arr.copy()
    x, y = torch.ones(4, 8) * (1 + rank), torch.zeros(4, 2)
    eng.backward(eng(x, y))
    eng.step()
    with eng.gathered_params():  # gathers and frees again
        after = {k: p.detach().clone() for k, p in model.named_parameters()}
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    unchanged = None if kept is None else bool((arr == kept).all())
    return [u.master.clone().view(torch.int32) for u in eng.units], after, messages, unchanged


@pytest.mark.dist
def test_numpy_inside_gathered_params_leaves_the_engine_usable():
    """.numpy() inside the block made the unit's storage unresizable, so leaving the block
    failed and the engine stayed broken. Now: leaving it warns, naming the unit, the next step
    is bitwise the step of a run without it, gathering works again, and the array keeps its
    values (it no longer follows the parameter, which the warning says)."""
    plain = get_pool(2).run(numpy_inside_a_gather, False)
    touched = get_pool(2).run(numpy_inside_a_gather, True)
    for (m0, a0, w0, _), (m1, a1, w1, unchanged) in zip(plain, touched, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(m0, m1, strict=True))
        assert all(torch.equal(a0[k].view(torch.int32), a1[k].view(torch.int32)) for k in a0)
        assert w0 == [] and len(w1) == 1 and "unit blocks.0" in w1[0] and ".numpy()" in w1[0]
        assert unchanged
    assert not torch.equal(plain[0][1]["blocks.0.fc1.weight"], Net().blocks[0].fc1.weight)


# -- 6. automatic units -------------------------------------------------------------------------


def test_auto_units_pick_the_repeated_blocks():
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_embd=32), device="meta")
    assert zunits.auto(gpt) == gpt.unit_names()
    assert zunits.auto(Net()) == ["blocks.0", "blocks.1"]
    assert zunits.auto(nn.Linear(2, 2)) == []
    with pytest.raises(ValueError, match="units='every'"):
        ZeroConfig(units="every")


def auto_engine(rank, n, units):
    del rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = ZeroEngine(Net(), ZeroConfig(stage=3, micro_batches=n, chunk=128, units=units))
    return [u.name for u in eng.units], [str(w.message) for w in caught]


@pytest.mark.dist
def test_auto_units_and_the_one_root_unit_warning():
    names, caught = get_pool(2).run(auto_engine, "auto")[0]
    assert names == ["", "blocks.0", "blocks.1"] and not caught
    names, caught = get_pool(2).run(auto_engine, ())[0]
    assert names == [""]
    assert any("one root unit" in w for w in caught), caught
