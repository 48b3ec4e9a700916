"""Where verify's ranks run: --backend and --device of python -m verify, zero.ranks.launch's rank
device, and the report naming both.

Nothing here starts a rank or touches CUDA: GPUs are counted through zero.ranks.launch.visible_gpus
(which a test replaces), torchrun is its environment variables. Refusals are one line naming
the option and its value, exit status 2, before anything starts (docs/design.md §5, "Bad input").
"""

import json

import pytest
import torch

from verify.__main__ import main, parse
from verify.checks import harness
from verify.checks.report import markdown
from verify.command.options import choose_where
from zero.common import cli
from zero.ranks import launch

ONE_CELL = ["--stages", "0", "--precisions", "fp32", "--optimizers", "sgd", "--models", "mlp"]
TORCHRUN = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def local(monkeypatch):
    """A plain launch: no launcher variables from the shell the tests run in."""
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)


def gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(launch, "visible_gpus", lambda: count)


def refused(argv, capsys) -> str:
    """The one error line of `python -m verify *argv`, which must exit 2."""
    with pytest.raises(SystemExit) as exc:
        cli.run(main, "python -m verify", argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("python -m verify: error: ") and "Traceback" not in err, err
    return last


@pytest.mark.parametrize(
    "torchrun, count, backend, device, want",
    [
        (False, 1, None, None, ("gloo", "cpu")),  # launched plainly: the CPU, even beside a GPU
        (False, 1, None, "cuda", ("gloo", "cuda")),  # gloo ranks sharing the GPU
        (False, 2, "nccl", None, ("nccl", "cuda")),
        (False, 0, "gloo", "cpu", ("gloo", "cpu")),
        (True, 1, None, None, ("nccl", "cuda")),  # torchrun on a GPU machine
        (True, 0, None, None, ("gloo", "cpu")),  # torchrun on a CPU machine
        (True, 1, None, "cuda", ("nccl", "cuda")),
        (True, 1, "gloo", None, ("gloo", "cpu")),
        (True, 1, "gloo", "cuda", ("gloo", "cuda")),
    ],
)
def test_the_defaults_of_backend_and_device(monkeypatch, torchrun, count, backend, device, want):
    gpus(monkeypatch, count)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    assert choose_where(backend, device) == want


def test_device_cuda_without_cuda_is_refused_by_name(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)  # as this CPU build of torch, anywhere
    gpus(monkeypatch, 0)
    err = refused(["--device", "cuda", *ONE_CELL, "--list"], capsys)
    assert err.endswith(
        "--device cuda: this torch is built without CUDA (torch.version.cuda is None); "
        "allowed here is --device cpu"
    )
    err = refused(["--backend", "nccl", *ONE_CELL, "--list"], capsys)  # NCCL means the GPU
    assert "--backend nccl (on --device cuda): this torch is built without CUDA" in err
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build on a machine without GPUs
    err = refused(["--device", "cuda", *ONE_CELL, "--list"], capsys)
    assert "--device cuda: no CUDA device is visible (torch.cuda.device_count() is 0)" in err


def test_nccl_on_the_cpu_is_refused_by_name(monkeypatch, capsys):
    gpus(monkeypatch, 8)  # refused for what it is, not for a missing GPU
    err = refused(["--backend", "nccl", "--device", "cpu", *ONE_CELL, "--list"], capsys)
    assert err.endswith(
        "--backend nccl --device cpu: NCCL carries GPU tensors only; allowed are "
        "--backend nccl --device cuda, or --backend gloo on either device"
    )
    with pytest.raises(ValueError, match=r"^device='cpu' is not allowed: expected 'cuda' with"):
        launch.init_from_env(backend="nccl", device="cpu")  # before it reads the environment
    with pytest.raises(ValueError, match=r"^device='tpu' is not allowed: expected one of"):
        launch.resolve_device("gloo", "tpu")


def test_local_nccl_needs_a_gpu_per_rank(monkeypatch, capsys):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): launched plainly, the
    largest world the run would start must have a GPU per rank (the preset's invariance table
    goes to N = 8); gloo ranks may share the GPU."""
    gpus(monkeypatch, 1)
    err = refused(["--backend", "nccl", "--world-sizes", "1", "2", *ONE_CELL, "--list"], capsys)
    assert "--backend nccl: world size 2 needs 2 GPUs (NCCL refuses two ranks on one GPU)" in err
    assert "1 are visible; allowed are world sizes up to 1 (--world-sizes), " in err
    assert "--backend gloo --device cuda (gloo ranks sharing the GPUs), or torchrun" in err
    gpus(monkeypatch, 4)
    assert "world size 8 needs 8 GPUs" in refused(["--quick", "--backend", "nccl"], capsys)
    assert main(["--backend", "nccl", "--world-sizes", "1", "2", "4", *ONE_CELL, "--list"]) == 0
    assert "ranks: backend nccl, device cuda (local worker pools)" in capsys.readouterr().out
    assert main(["--device", "cuda", "--world-sizes", "8", *ONE_CELL, "--list"]) == 0
    out = capsys.readouterr().out  # gloo: eight ranks on four GPUs
    assert "ranks: backend gloo, device cuda (local worker pools, ranks sharing the GPUs)" in out


def test_sections_that_compute_on_the_cpu_say_they_are_skipped_on_a_gpu(monkeypatch, capsys):
    gpus(monkeypatch, 1)
    assert main(["--quick", "--device", "cuda", "--world-sizes", "1", "2", "--list"]) == 0
    out = capsys.readouterr().out
    assert "(parity skipped on device cuda: it computes on the CPU; --device cpu runs it)" in out
    assert "(mp skipped on device cuda: it computes on the CPU; --device cpu runs it)" in out
    assert "N=2: " in out and "parity: " not in out
    err = refused(["--parity", "--device", "cuda", "--list"], capsys)  # it alone: nothing to run
    assert err.endswith("--parity with --device cuda: that section computes on the CPU; "
                        "allowed is --device cpu")  # fmt: skip


def test_a_baseline_from_another_device_is_refused(tmp_path, capsys):
    base = tmp_path / "gpu.json"
    base.write_text(json.dumps({"cells": [], "provenance": {"device": "cuda"}}))
    with pytest.raises(SystemExit) as exc:
        parse([*ONE_CELL, "--baseline", str(base)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--baseline {str(base)!r}: provenance.device='cuda' but this run's is 'cpu'" in err
    base.write_text(json.dumps({"cells": [], "provenance": {}}))  # older: no device recorded
    assert parse([*ONE_CELL, "--baseline", str(base)]).device == "cpu"


def test_cell_device_follows_the_rank_device(monkeypatch):
    assert harness.cell_device() == launch.rank_device() == torch.device("cpu")  # nothing set it
    monkeypatch.setattr(launch, "rank_device", lambda: torch.device("cuda", 3))
    assert harness.cell_device() == torch.device("cuda", 3)


def test_the_markdown_report_names_backend_and_device():
    prov = {"git_commit": "abc", "torch": "2.11", "gpu": "NVIDIA H200"}
    prov |= {"backend": "gloo", "device": "cuda", "launcher": "local"}
    text = markdown({"cells": [], "provenance": prov})
    assert "- ranks: backend gloo, device cuda (NVIDIA H200), local launch\n" in text
    prov |= {"backend": "gloo", "device": "cpu"}
    assert "- ranks: backend gloo, device cpu, local launch\n" in markdown({"provenance": prov})
