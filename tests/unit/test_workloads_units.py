"""The workloads' pieces that need no ranks: the digits CLI's options, the optional-dependency
error, the ResNet's shapes and units, and train_steps' handling of keyword micro-batches and
Hugging Face outputs (docs/models.md, "Workloads")."""

import sys
from types import SimpleNamespace

import pytest
import torch

from zero.build import auto
from zero.loop import default_loss, train_steps
from zero.workloads import digits
from zero.workloads.resnet import ResNet, ResNetConfig


def test_digits_options_come_from_the_dataclass():
    cfg = digits.parse(["--stage", "1", "--nproc", "4", "--steps", "7", "--precision", "bf16"])
    assert (cfg.zero.stage, cfg.nproc, cfg.steps, cfg.zero.precision) == (1, 4, 7, "bf16")
    assert cfg.zero.units == "auto"
    zc = cfg.zero_config()
    assert zc.micro_batches == 4 and zc.groups[0].weight_decay == cfg.weight_decay
    assert zc.group_of("w", torch.zeros(2, 2)) == 0 and zc.group_of("b", torch.zeros(2)) == 1


@pytest.mark.parametrize(
    "argv, named",
    [(["--nproc", "2", "--micro-batches", "3"], "--micro-batches"), (["--lr", "0"], "--lr"),
     (["--test-fraction", "1.0"], "--test-fraction"), (["--stage", "5"], "--stage")],
)  # fmt: skip
def test_digits_refuses_bad_options_naming_them(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        digits.parse(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_digits_without_scikit_learn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install -e '\.\[models\]'"):
        digits.load_digits_split()


def test_resnet_shapes_units_and_seed():
    model = ResNet(ResNetConfig(depth=1), seed=0)
    logits, loss = model(torch.randn(5, 1, 8, 8), torch.arange(5))
    assert logits.shape == (5, 10) and loss.shape == ()
    assert model(torch.randn(5, 1, 8, 8))[1] is None
    assert auto(model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert model.num_params() == 77_754
    same, other = ResNet(seed=0), ResNet(seed=1)  # parameters (the forward moved the buffers)
    assert all(torch.equal(p, same.get_parameter(k)) for k, p in model.named_parameters())
    assert not torch.equal(model.head.weight, other.head.weight)


def test_default_loss_takes_a_model_outputs_loss():
    loss = torch.tensor(2.5)
    assert default_loss((None, loss)) is loss
    assert default_loss(SimpleNamespace(loss=loss, logits=None)) is loss
    assert default_loss(loss) is loss


class _Recorder:
    """An engine stand-in: records how it was called and what backward got."""

    world_size, rank = 1, 0
    config = SimpleNamespace(micro_batches=2)

    def __init__(self):
        self.calls, self.losses = [], []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return SimpleNamespace(loss=torch.tensor(float(len(self.calls))))

    def backward(self, loss):
        self.losses.append(float(loss))

    def step(self):
        return "stepped"


def test_train_steps_passes_a_dict_micro_batch_as_keywords():
    eng = _Recorder()
    out = train_steps(eng, lambda s, j: {"input_ids": s * 10 + j, "labels": j}, 1)
    assert out == ["stepped"]
    assert eng.calls == [((), {"input_ids": 0, "labels": 0}), ((), {"input_ids": 1, "labels": 1})]
    assert eng.losses == [1.0, 2.0]
