"""Bad input refused before any work, where the survey's rows (verify/refusals/bad_inputs.py, run by
tests/unit/test_bad_input.py) cannot show it alone: the simulated rank's fit check counts the
padding of a large world, a CUDA device this process lacks is named, the Python API refuses
before building, group_of's errors are named on the engine itself, and under torchrun the rank
the watchdog blames for a stop is the one torchrun's summary names first."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from measure import fake_rank
from measure.bench import read_results
from measure.fake_rank import SimulateConfig, estimate_peak_bytes, refuse_unless_fits
from verify.refusals import bad_inputs
from zero.ranks import launch
from zero.ranks.watchdog import CollectiveError, blame_line

# -- the simulated rank: padding, device, options ------------------------------------------------


def layout_padding(params: float, vocab: int, world_size: int, chunk: int) -> tuple[int, int]:
    """(padded elements of every unit, of the largest) of the GPT as the engine lays it out
    (reference/layout.py on the meta model's parameters)."""
    from reference.layout import unit_layout
    from zero.workloads.models import GPT

    cfg, _ = fake_rank._gpt(params, seq=64, vocab_size=vocab)
    model = GPT(cfg, device="meta")
    units = {u: [] for u in model.unit_names()}
    root = []
    for name, p in model.named_parameters():
        unit = next((u for u in units if name.startswith(u + ".")), None)
        (units[unit] if unit else root).append((name, tuple(p.shape)))
    padded = [
        unit_layout(ps, chunk=chunk).padded_numel(world_size) for ps in [*units.values(), root]
    ]
    return sum(padded), max(padded)


@pytest.mark.parametrize(
    "params, vocab, n, chunk",
    [(2e6, 256, 1, 4096), (2e6, 256, 10**6, 4096), (3e7, 256, 64, 4096), (3e7, 50257, 1024, 128)],
)
def test_the_estimate_bounds_the_padded_units(params, vocab, n, chunk):
    est = estimate_peak_bytes(
        params=params, world_size=n, stage=3, vocab_size=vocab, options={"chunk": chunk}
    )
    padded, largest = layout_padding(params, vocab, n, chunk)
    assert padded <= est["padded_params"] <= padded + n * chunk * 2, (padded, est)
    assert largest <= est["largest_unit"], (largest, est)


def test_a_large_world_is_refused_with_the_numbers_of_its_padding(monkeypatch):
    """2M parameters at N = 10^6 passed the check (it counted 2M) and then failed to allocate
    16 GB: every unit is padded to N·C elements, and a rank gathers one at a time."""
    est = estimate_peak_bytes(params=2e6, world_size=10**6, stage=3, vocab_size=256)
    assert est["largest_unit"] == 10**6 * 4096
    assert est["peak"] > 16e9  # what the rank really went on to allocate
    small = estimate_peak_bytes(params=2e6, world_size=1, stage=3, vocab_size=256)
    assert small["peak"] < 1e9  # the padding, not the model, is what does not fit
    monkeypatch.setattr(fake_rank, "fits_here", lambda e, device: (False, "does not fit: here"))
    with pytest.raises(ValueError) as exc:
        refuse_unless_fits(est, params=2e6, world_size=10**6, device="cpu")
    line = str(exc.value)
    assert line.startswith("params=2e+06, world_size=1000000: does not fit: here"), line
    assert "12,288,000,000" in line and "\n" not in line
    big = estimate_peak_bytes(params=1e12, world_size=1, stage=0, vocab_size=256)
    with pytest.raises(ValueError, match=r"^params=1e\+12: does not fit") as exc:
        refuse_unless_fits(big, params=1e12, world_size=1, device="cpu")
    assert "world_size" not in str(exc.value)


def test_cuda_is_refused_by_name_where_there_is_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device='cuda': this process has no CUDA device .*"
                       r"allowed here is 'cpu'$"):  # fmt: skip
        SimulateConfig(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fake_rank.check_device("cuda:1")
    with pytest.raises(ValueError, match=r"^device='cuda:2': this process has 2 CUDA device"):
        fake_rank.check_device("cuda:2")


def test_the_python_api_refuses_before_building(monkeypatch):
    """simulate_rank and measure_rank refuse bad options and devices before a process group, a
    model or a child process exists (they were an AttributeError or TypeError after both)."""
    monkeypatch.setattr(fake_rank.subprocess, "run", lambda *a, **k: pytest.fail("started"))
    kw = dict(params=2e6, vocab_size=256, world_size=2, rank=0, stage=3, steps=1)
    for bad, named in (({"stage": 2}, "options="), ({"bogus": 1}, "options="), ([1], "options=")):
        with pytest.raises(ValueError, match=f"^{named}"):
            fake_rank.simulate_rank(**kw, options=bad)
        with pytest.raises(ValueError, match=f"^{named}"):
            fake_rank.measure_rank(**kw, options=bad)
    with pytest.raises(ValueError, match=r"^device='cuda:99'"):
        fake_rank.simulate_rank(**kw, device="cuda:99")
    assert not dist.is_initialized()


def test_good_options_pass():
    """Valid further ZeroConfig fields are accepted and kept as given (the refusals above are
    not a check that refuses everything)."""
    one = {"activation_checkpointing": True, "chunk": 128}
    two = {"activation_checkpointing": True, "partition_activations": True}
    assert SimulateConfig(options=one).options == one
    assert SimulateConfig(mp=2, options=two).options == two


# -- measure.bench --from-json ------------------------------------------------------------------


def test_results_files_are_read_or_refused_naming_the_file(tmp_path):
    good = tmp_path / "good.json"
    record = {"config": {"system": "ddp", "world_size": 2}, "result": {"status": "ok"}}
    good.write_text(json.dumps({"records": [record]}))
    assert read_results(str(good)) == [record]
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\x89PNG\x00")
    with pytest.raises(ValueError) as exc:
        read_results(str(binary))
    assert str(exc.value).startswith(f"from_json={str(binary)!r}: not UTF-8 text (byte 0x89")


# -- group_of, on the engine itself ------------------------------------------------------------


def _engine_with_group_of(rank, world_size, group_of):
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine

    try:
        ZeroEngine(nn.Linear(2, 2), ZeroConfig(group_of=group_of))
    except ValueError as exc:
        return str(exc), repr(exc.__cause__)
    return "accepted", None


def test_group_of_errors_name_the_parameter_on_the_engine():
    from zero.ranks.local import spawn

    out = spawn(_engine_with_group_of, 1, bad_inputs.GroupOf("0"), timeout_s=60)[0]
    assert out == ("group_of('weight')='0': allowed are 0..0 (an int index into groups)", "None")
    boom = bad_inputs.GroupOf(ZeroDivisionError("division by zero"))
    message, cause = spawn(_engine_with_group_of, 1, boom, timeout_s=60)[0]
    assert message.startswith("group_of('weight') raised ZeroDivisionError: division by zero;")
    assert cause == "ZeroDivisionError('division by zero')"  # chained: the original is kept


# -- torchrun's error file for a stopped rank ----------------------------------------------------


def torchrun_env(tmp_path, rank=0, local=0, local_world=2):
    attempt = tmp_path / "attempt_0"
    for r in range(local_world):
        (attempt / str(r)).mkdir(parents=True, exist_ok=True)
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_world),
        "TORCHELASTIC_ERROR_FILE": str(attempt / str(local) / "error.json"),
    }  # fmt: skip


def stopped(rank=1) -> CollectiveError:
    why = "not responding (its process is stopped); waiting in #29"
    text = f"{blame_line([rank], why)}\n  rank 0 failed in a collective: RuntimeError: timed out"
    return CollectiveError(text, blamed=(rank,))


def fail_as_rank_0(exc: BaseException, env: dict, monkeypatch, *, blame: bool) -> tuple:
    """Rank 0 fails with `exc` as zero.common.cli.run records it (torch's ErrorHandler), then
    (blame=True) as the process ends; torchrun's summary of rank 0 failed and rank 1 killed:
    (the root cause's rank, the summary)."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ErrorHandler,
        ProcessFailure,
    )

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        raise exc
    except BaseException as caught:
        ErrorHandler().record_exception(caught)
        if blame:
            launch.record_blamed(caught)
    folder = env["TORCHELASTIC_ERROR_FILE"].rsplit("/", 2)[0]
    failures = {
        0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=f"{folder}/0/error.json"),
        1: ProcessFailure(local_rank=1, pid=2, exitcode=-9, error_file=f"{folder}/1/error.json"),
    }
    error = ChildFailedError("zero.workloads.train", failures)
    return error.get_first_failure()[0], error.format_msg()


def test_torchrun_names_the_stopped_rank_first(tmp_path, monkeypatch):
    env = torchrun_env(tmp_path)
    first, summary = fail_as_rank_0(stopped(), env, monkeypatch, blame=True)
    assert first == 1, summary
    root = summary.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "watchdog blames rank 1: not responding (its process is stopped)" in root


def test_without_the_blamed_rank_file_torchrun_names_rank_0(tmp_path, monkeypatch):
    """The teeth of the test above: what torchrun said before (rank 0, the rank that timed out)."""
    first, _ = fail_as_rank_0(stopped(), torchrun_env(tmp_path), monkeypatch, blame=False)
    assert first == 0


def test_the_blamed_rank_file_is_found_through_a_wrapping_error(tmp_path):
    env = torchrun_env(tmp_path, rank=4, local=0, local_world=2)  # node 2 of 2-rank nodes
    try:
        try:
            raise stopped(rank=5)
        except CollectiveError as inner:
            raise RuntimeError("the step failed") from inner
    except RuntimeError as exc:
        files = launch.blamed_error_files(exc, env, now=1000)
    path = str(tmp_path / "attempt_0" / "1" / "error.json")
    assert list(files) == [path]
    message = files[path]["message"]
    assert message["extraInfo"]["timestamp"] == "999"
    assert message["message"].startswith("CollectiveError: watchdog blames rank 5: not respond")


@pytest.mark.parametrize(
    "exc, env_change",
    [
        (stopped(rank=0), {}),  # this rank itself: it writes its own
        (stopped(rank=3), {}),  # on another node: its agent's business
        (RuntimeError("no watchdog"), {}),
        (stopped(), {"TORCHELASTIC_ERROR_FILE": ""}),  # not torchrun
        (stopped(), {"LOCAL_RANK": "1"}),  # a layout not torchrun's: do not guess
    ],
)
def test_no_error_file_is_written_where_none_is_due(tmp_path, exc, env_change):
    env = {**torchrun_env(tmp_path), **env_change}
    assert launch.blamed_error_files(exc, env) == {}


def test_an_existing_error_file_is_kept(tmp_path):
    env = torchrun_env(tmp_path)
    theirs = tmp_path / "attempt_0" / "1" / "error.json"
    theirs.write_text('{"message": "its own"}')
    assert launch.record_blamed(stopped(), env) == []
    assert theirs.read_text() == '{"message": "its own"}'


def test_the_hook_writes_as_the_process_ends(tmp_path, monkeypatch):
    """init_from_env installs it (once): an error that ends the process writes the file."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[1]))
    for key, value in torchrun_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    launch._record_blame_at_exit()
    launch._record_blame_at_exit()
    exc = stopped()
    sys.excepthook(type(exc), exc, None)
    assert seen == [exc]  # the previous hook still prints the traceback, once
    assert (tmp_path / "attempt_0" / "1" / "error.json").is_file()
