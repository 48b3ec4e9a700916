"""Meta-device models keep their own initialisation (zero/materialize.py, docs/models.md).

The expected values are built here without the engine: each unit is constructed on the CPU
after `torch.manual_seed(unit_seed(seed, unit))`, its modules calling reset_parameters in their
constructors (children in registration order: the order `module.apply` resets them in).
"""

import pytest
import torch
from torch import nn

from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.materialize import init_value, unit_seed
from zero.ranks.local import get_pool
from zero.workloads.models import GPT, GPTConfig

D, SEED = 8, 5
UNITS = ("blocks.0", "blocks.1")


class Gain(nn.Module):
    """A custom module with no reset_parameters: the counter-based rule gives it values."""

    def __init__(self, d, device=None):
        super().__init__()
        self.g = nn.Parameter(torch.empty(d, device=device))

    def forward(self, x):
        return x * self.g


class Block(nn.Module):
    def __init__(self, d, device=None):
        super().__init__()
        self.ln = nn.LayerNorm(d, device=device)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d, device=device), nn.Linear(2 * d, d, device=device)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, device=None, gain=False):
        super().__init__()
        self.emb = nn.Linear(4, D, device=device)
        self.blocks = nn.ModuleList(Block(D, device) for _ in range(2))
        self.ln_f = nn.LayerNorm(D, device=device)
        self.head = nn.Linear(D, 1, device=device)
        self.gain = Gain(D, device) if gain else None

    def forward(self, x, y):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        x = self.ln_f(x)
        if self.gain is not None:
            x = self.gain(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def linear_hook(m):
    """A user's init hook (as Hugging Face's _init_weights): draws from torch's RNG too."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)


def expected(hook=None) -> dict[str, torch.Tensor]:
    """Every unit built alone on the CPU under its unit seed (then the hook, as model.apply)."""
    out = {}
    for i in range(2):
        torch.manual_seed(unit_seed(SEED, f"blocks.{i}"))
        b = Block(D)
        if hook is not None:
            b.apply(hook)
        out |= {f"blocks.{i}.{k}": p.detach() for k, p in b.named_parameters()}
    torch.manual_seed(unit_seed(SEED, ""))  # the root: its modules in registration order
    root = {"emb": nn.Linear(4, D), "ln_f": nn.LayerNorm(D), "head": nn.Linear(D, 1)}
    for name, m in root.items():
        if hook is not None:
            m.apply(hook)
        out |= {f"{name}.{k}": p.detach() for k, p in m.named_parameters()}
    return out


def build_meta(rank, n, init="auto", gain=False):
    del rank
    model = Net(device="meta", gain=gain)
    cfg = ZeroConfig(stage=3, micro_batches=2 * n, chunk=128, units=UNITS)
    eng = ZeroEngine(model, cfg, device="cpu", init_seed=SEED, init=init)
    with eng.gathered_params():
        values = {k: p.detach().clone() for k, p in model.named_parameters()}
    return values, eng.init_report


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2])
def test_meta_units_take_their_modules_own_initialisation(n):
    """LayerNorm gains are exactly 1 and biases 0; every value has the bits of its unit built
    alone on the CPU under the unit's seed, on every rank, at N = 1 and 2 (hence independent
    of N); the report names reset_parameters for every parameter."""
    want = expected()
    for values, report in get_pool(n).run(build_meta):
        assert set(values) == set(want)
        for k, v in values.items():
            assert torch.equal(bits(v), bits(want[k])), k
        for k in ("blocks.0.ln.weight", "blocks.1.ln.weight", "ln_f.weight"):
            assert torch.equal(values[k], torch.ones(D))
            assert torch.equal(values[k.replace("weight", "bias")], torch.zeros(D))
        assert set(report) == {"", *UNITS}
        assert {r for u in report.values() for r in u.values()} == {"reset_parameters"}
        assert sorted(p for u in report.values() for p in u) == sorted(want)
    # the check can fail: the blocks' fc1 weights differ from each other and from N(0, 0.02)
    assert not torch.equal(want["blocks.0.fc1.weight"], want["blocks.1.fc1.weight"])


@pytest.mark.dist
def test_a_module_without_reset_parameters_falls_back_to_the_counter_rule():
    values, report = get_pool(2).run(build_meta, "auto", True)[1]
    assert report[""]["gain.g"] == "counter"
    assert report[""]["head.weight"] == "reset_parameters"
    want = init_value(SEED, "gain.g", (D,), "normal", std=0.02)
    assert torch.equal(bits(values["gain.g"]), bits(want))
    # the root's other modules drew the same stream as without the Gain (it draws nothing)
    assert torch.equal(bits(values["head.weight"]), bits(expected()["head.weight"]))


@pytest.mark.dist
def test_an_init_hook_runs_after_reset_parameters_in_apply_order():
    want = expected(linear_hook)
    for values, report in get_pool(2).run(build_meta, linear_hook):
        for k, v in values.items():
            assert torch.equal(bits(v), bits(want[k])), k
        assert report["blocks.0"]["blocks.0.fc1.weight"] == "hook"
        assert report["blocks.0"]["blocks.0.ln.weight"] == "reset_parameters"
    assert not torch.equal(want["blocks.0.fc1.bias"], expected()["blocks.0.fc1.bias"])


@pytest.mark.dist
def test_counter_rule_on_request_and_for_models_that_state_param_init():
    values, report = get_pool(2).run(build_meta, "counter")[0]
    assert {r for u in report.values() for r in u.values()} == {"counter"}
    w = values["blocks.0.ln.weight"]  # the default rule: LayerNorm weights 1 here too
    assert torch.equal(w, torch.ones(D))
    want = init_value(SEED, "blocks.0.fc1.weight", (2 * D, D), "normal", std=0.02)
    assert torch.equal(bits(values["blocks.0.fc1.weight"]), bits(want))
    gpt = get_pool(2).run(gpt_report)[0]
    assert {r for u in gpt.values() for r in u.values()} == {"counter"}


def gpt_report(rank, n):
    del rank
    model = GPT(
        GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16), device="meta"
    )
    cfg = ZeroConfig(stage=3, micro_batches=n, chunk=128, units=tuple(model.unit_names()))
    return ZeroEngine(model, cfg, device="cpu").init_report


def refused(rank, n, init):
    try:
        build_meta(rank, n, init)
    except ValueError as e:
        return str(e)
    return None


class Half(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, device=device))

    def reset_parameters(self):
        with torch.no_grad():
            self.w[:2] = 1.0

    def forward(self, x):
        return (x * self.w).sum()


def half_reset(rank, n):
    del rank
    try:
        ZeroEngine(Half("meta"), ZeroConfig(micro_batches=n, chunk=128), device="cpu")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_bad_init_values_are_refused_by_name():
    msg = get_pool(2).run(refused, "xavier")[0]
    assert msg is not None and "init='xavier'" in msg and "'own'" in msg
    msg = get_pool(2).run(half_reset)[0]
    assert msg is not None and "parameter 'w'" in msg and "only some" in msg


@pytest.mark.dist
def test_real_device_models_report_given_values():
    report = get_pool(2).run(real_report)[0]
    assert {r for u in report.values() for r in u.values()} == {"given"}


def real_report(rank, n):
    del rank
    cfg = ZeroConfig(stage=3, micro_batches=n, chunk=128, units=UNITS)
    return ZeroEngine(Net(), cfg).init_report


def build_meta_frozen(rank, n):
    """Net on meta with every block's fc1 frozen: each unit is split into a trainable and a
    frozen FlatUnit (zero/build.py)."""
    del rank
    model = Net(device="meta")
    for b in model.blocks:
        b.fc1.requires_grad_(False)
    cfg = ZeroConfig(stage=3, micro_batches=2 * n, chunk=128, units=UNITS)
    eng = ZeroEngine(model, cfg, device="cpu", init_seed=SEED)
    with eng.gathered_params():
        return {k: p.detach().float().clone() for k, p in model.named_parameters()}


@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2])
def test_a_unit_with_frozen_parameters_is_initialised_in_one_pass(n):
    """[Note: one pass per unit] (zero/materialize.py): the trainable half (ln, fc2) and the
    frozen half (fc1) of each block take the bits of the block built whole under its seed. Two
    passes would give fc2 the draws fc1 took (fc1 on meta draws nothing) and fail here."""
    want = expected()
    for values in get_pool(n).run(build_meta_frozen):
        for k, v in values.items():
            assert torch.equal(bits(v), bits(want[k])), k
