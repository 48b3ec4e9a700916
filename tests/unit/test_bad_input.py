"""Bad input is refused at the door (docs/design.md §5, "Bad input"): every configuration field
and every command-line option, given a value that is non-finite, negative, zero, huge, of the
wrong type or a path that cannot be used, gives one line that names the field, before any work
starts: a ValueError in the API, exit status 2 and no traceback on the command line.

The tables below are the survey: one row per bad value tried. `test_survey_size` states how
many there are, so that a row removed shows up in review."""

import math

import pytest
from torch import nn

from measure.bench import BenchConfig
from measure.simulate import SimulateConfig
from reference.optim import Hyper
from reference.precision import ScalerConfig
from zero import cli
from zero.collectives import CommCounter
from zero.config import ZeroConfig
from zero.digits import DigitsConfig
from zero.engine import ZeroEngine
from zero.launch import WorkerPool, check_launch_env, spawn
from zero.train import TrainConfig

INF, NAN = math.inf, math.nan


def _api_rows():
    rows = []

    def bad(make, field, *values):
        for v in values:
            rows.append(pytest.param(make, field, v, id=f"{make.__name__}.{field}={v!r}"))

    for f in ("lr", "weight_decay", "momentum"):
        bad(Hyper, f, INF, NAN, -1.0, "0.1", None)
    bad(Hyper, "dampening", 2.0, NAN, -INF)
    bad(Hyper, "eps", 0.0, INF, NAN, -1e-8)
    bad(Hyper, "betas", (1.0, 0.9), (0.9,), (0.9, NAN), (0.9, INF), "ab", (True, 0.9))
    bad(Hyper, "nesterov", "yes")
    for f in ("init_scale", "min_scale"):
        bad(ScalerConfig, f, INF, 0.0, NAN, -1.0)
    bad(ScalerConfig, "backoff", 1.0, 0.0, NAN)
    bad(ScalerConfig, "growth", 1.0, INF, NAN)
    bad(ScalerConfig, "growth_interval", 0, 1.5, True)
    bad(ZeroConfig, "stage", 4, -1, True, "2")
    bad(ZeroConfig, "precision", "fp8", None)
    bad(ZeroConfig, "reduce_dtype", "fp64")
    bad(ZeroConfig, "optimizer", "lion")
    bad(ZeroConfig, "groups", (None,), (), "adam", (Hyper(), 3))
    bad(ZeroConfig, "group_of", 3)
    bad(ZeroConfig, "micro_batches", 0, -2, 1.5)
    bad(ZeroConfig, "clip_norm", INF, NAN, 0.0, -1.0)
    bad(ZeroConfig, "scaler", None)
    bad(ZeroConfig, "nonfinite", "ignore")
    bad(ZeroConfig, "units", "everything", ("a", "a"), ("",))
    bad(ZeroConfig, "persist_below", -1, 1.5)
    bad(ZeroConfig, "chunk", 2**40, 100, 0, 64, True)
    bad(ZeroConfig, "bucket_elements", 0, True, 2.5)
    for f in ("deterministic", "overlap", "activation_checkpointing", "offload_optimizer"):
        bad(ZeroConfig, f, "yes", None)
    bad(ZeroConfig, "contiguous_memory", 1)
    bad(ZeroConfig, "broadcast_buffers", None)
    for f in ("lr",):
        bad(TrainConfig, f, INF, NAN, 0.0, -1.0)
    bad(TrainConfig, "weight_decay", INF, -0.1)
    bad(TrainConfig, "timeout_s", INF, NAN, 0.0, -5.0, 1e30)
    bad(TrainConfig, "val_fraction", 0.0, 1.0, NAN)
    bad(TrainConfig, "steps", 0, -1, 1.5)
    bad(TrainConfig, "nproc", 0, True)
    bad(TrainConfig, "model", "huge")
    bad(TrainConfig, "eval_every", -1)
    bad(TrainConfig, "ckpt_every", -1)
    bad(TrainConfig, "log_every", 0)
    bad(TrainConfig, "eval_batches", 0)
    bad(TrainConfig, "seed", -1)
    bad(TrainConfig, "micro_batches", 0)
    bad(TrainConfig, "out", "")
    bad(TrainConfig, "resume", "yes")
    bad(TrainConfig, "zero", None)
    bad(DigitsConfig, "lr", INF, NAN, 0.0)
    bad(DigitsConfig, "weight_decay", INF)
    bad(DigitsConfig, "test_fraction", 1.0, NAN)
    bad(DigitsConfig, "timeout_s", INF, 0.0)
    bad(DigitsConfig, "steps", 0)
    bad(DigitsConfig, "batch_size", 0)
    bad(SimulateConfig, "params", INF, NAN, 0.0, -1.0)
    bad(SimulateConfig, "steps", 0, -1)
    bad(SimulateConfig, "world_size", 0, True)
    bad(SimulateConfig, "rank", 64, -1)
    bad(SimulateConfig, "stage", 4)
    bad(SimulateConfig, "seq", 0)
    bad(SimulateConfig, "batch", 0)
    bad(SimulateConfig, "vocab_size", 0)
    bad(SimulateConfig, "device", "tpu")
    bad(SimulateConfig, "shape", {"n_layer": 0, "n_embd": 64, "n_head": 1}, {"layers": 2})
    bad(BenchConfig, "lr", INF, NAN, 0.0)
    bad(BenchConfig, "weight_decay", INF, -1.0)
    bad(BenchConfig, "quiet_cores", NAN, -1.0)
    bad(BenchConfig, "quiet_wait_s", INF, -1.0)
    bad(BenchConfig, "timeout_s", INF, 0.0)
    bad(BenchConfig, "repeats", 0)
    bad(BenchConfig, "world_sizes", (0,), ())
    return rows


API = _api_rows()


def _one_line_naming(text: str, field: str) -> None:
    text = text.strip()
    assert "\n" not in text, text
    assert "Traceback" not in text, text
    names = (f"{field}=", f"{field}[", f"--{field.replace('_', '-')}")
    assert any(name in text for name in names), (field, text)


@pytest.mark.parametrize("make, field, value", API)
def test_a_bad_field_is_a_value_error_naming_it(make, field, value):
    with pytest.raises(ValueError) as exc:
        make(**{field: value})
    _one_line_naming(str(exc.value), field.split("[")[0])


def test_calls_are_refused_by_name():
    """Arguments of the engine and the launcher that are not dataclass fields."""
    with pytest.raises(ValueError, match=r"^module=Module: has no parameters"):
        ZeroEngine(nn.Module(), ZeroConfig())  # was a bare StopIteration
    with pytest.raises(ValueError, match=r"^module=int"):
        ZeroEngine(3, ZeroConfig())
    with pytest.raises(ValueError, match=r"^groups\[0\]=None"):
        ZeroConfig(groups=(None,))  # was an error at the first step
    with pytest.raises(ValueError, match=r"^timeout_s=inf"):
        spawn(print, 1, timeout_s=INF)  # was an OverflowError
    with pytest.raises(ValueError, match=r"^timeout_s=nan"):
        WorkerPool(1, timeout_s=NAN)
    with pytest.raises(ValueError, match=r"^keep_steps=0"):
        CommCounter(keep_steps=0)


STALE = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env, named",
    [
        (STALE, "WORLD_SIZE=2"),  # left in a shell: would wait for a peer that never comes
        ({**STALE, "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
        ({**STALE, "RANK": "2", "LOCAL_RANK": "0"}, "RANK='2'"),
        ({**STALE, "MASTER_PORT": "70000", "LOCAL_RANK": "0"}, "MASTER_PORT='70000'"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT not set"),
    ],
)
def test_launcher_variables_are_checked(env, named):
    with pytest.raises(ValueError) as exc:
        check_launch_env(env)
    assert named in str(exc.value) and "\n" not in str(exc.value)


def test_torchrun_variables_pass():
    check_launch_env({**STALE, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"})
    check_launch_env({**STALE, "WORLD_SIZE": "1", "RANK": "0"})  # alone: nobody to wait for


# -- the command lines ---------------------------------------------------------------------------


def _mains():
    from measure.bench import main as bench
    from measure.simulate import main as simulate
    from paper_figures.__main__ import main as figures
    from verify.__main__ import main as verify
    from verify.demo import main as demo
    from zero.digits import main as digits
    from zero.train import main as train

    return {
        "zero.train": train,
        "zero.digits": digits,
        "verify": verify,
        "verify.demo": demo,
        "measure.simulate": simulate,
        "measure.bench": bench,
        "paper_figures": figures,
    }


def _cli_rows():
    rows = []

    def bad(prog, field, *argv):
        rows.append(pytest.param(prog, list(argv), field, id=f"{prog} {' '.join(argv)}"))

    t = "zero.train"
    for v in ("inf", "nan", "-1", "0"):
        bad(t, "lr", "--lr", v)
    bad(t, "lr", "--lr", "fast")
    bad(t, "weight_decay", "--weight-decay", "inf")
    for v in ("inf", "nan", "0", "-5"):
        bad(t, "timeout_s", "--timeout", v)
    bad(t, "val_fraction", "--val-fraction", "nan")
    bad(t, "val_fraction", "--val-fraction", "0.99", "--data", "{text}")
    bad(t, "steps", "--steps", "0")
    bad(t, "steps", "--steps", "1e3")
    bad(t, "nproc", "--nproc", "0")
    bad(t, "micro_batches", "--micro-batches", "0")
    bad(t, "eval_every", "--eval-every", "-1")
    bad(t, "ckpt_every", "--ckpt-every", "-1")
    bad(t, "log_every", "--log-every", "0")
    bad(t, "seed", "--seed", "-1")
    for v in ("inf", "nan", "0", "-1"):
        bad(t, "clip_norm", "--clip-norm", v)
    for v in (str(2**40), "100", "0"):
        bad(t, "chunk", "--chunk", v)
    bad(t, "bucket_elements", "--bucket-elements", "0")
    bad(t, "persist_below", "--persist-below", "-1")
    bad(t, "reduce_dtype", "--reduce-dtype", "bf16")
    bad(t, "offload_activations", "--offload-activations")
    bad(t, "stage", "--stage", "5")
    bad(t, "model", "--model", "huge")
    bad(t, "precision", "--precision", "fp8")
    bad(t, "optimizer", "--optimizer", "lion")
    bad(t, "out", "--out", "{file}/sub")  # was reported after the training had run
    bad(t, "data", "--data", "{missing}")
    d = "zero.digits"
    bad(d, "lr", "--lr", "inf")
    bad(d, "timeout_s", "--timeout", "inf")
    bad(d, "test_fraction", "--test-fraction", "1")
    bad(d, "steps", "--steps", "0")
    bad(d, "out", "--out", "{file}/sub")
    v = "verify"
    bad(v, "world_sizes", "--quick", "--world-sizes", "7", "--list")  # was "0/0 cells", exit 1
    bad(v, "world_sizes", "--world-sizes", "0", "--list")
    bad(v, "timeout", "--timeout", "inf", "--list")
    bad(v, "timeout", "--timeout", "0", "--list")
    bad(v, "steps", "--steps", "0", "--list")
    bad(v, "stages", "--stages", "5", "--list")
    bad(v, "json", "--json", "{file}/v.json", "--list")
    bad(v, "baseline", "--baseline", "{missing}", "--list")
    bad("verify.demo", "world_size", "--world-size", "0")
    bad("verify.demo", "steps", "--steps", "0")
    s = "measure.simulate"
    bad(s, "steps", "--steps", "0")
    bad(s, "params", "--params", "1e15")  # was minutes building a million-layer model
    bad(s, "params", "--params", "inf")
    bad(s, "params", "--params", "-1")
    bad(s, "world_size", "--world-size", "0")
    bad(s, "rank", "--rank", "64")
    bad(s, "stage", "--stage", "4")
    bad(s, "device", "--device", "tpu")
    bad(s, "shape", "--shape", '{"n_layer": 0, "n_embd": 8, "n_head": 1}')
    bad(s, "json", "--json", "{file}/r.json", "--params", "1e6", "--world-size", "1")
    b = "measure.bench"
    bad(b, "lr", "--lr", "inf")
    bad(b, "timeout_s", "--timeout", "inf")
    bad(b, "quiet_wait_s", "--quiet-wait-s", "nan")
    bad(b, "world_sizes", "--world-sizes", "0")
    bad(b, "systems", "--systems", "megatron")
    bad(b, "json", "--json", "{file}/b.json")
    bad(b, "from_json", "--from-json", "{missing}")
    bad("paper_figures", "out", "--out", "{file}/sub")
    bad("paper_figures", "profile", "--profile", "huge")
    return rows


CLI = _cli_rows()


@pytest.fixture
def paths(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("not a folder")
    text = tmp_path / "small.txt"  # three 64 KiB pieces, all held out at --val-fraction 0.99
    text.write_bytes(b"print('hello')\n" * 13_000)
    return {"file": str(file), "missing": str(tmp_path / "missing"), "text": str(text)}


@pytest.mark.parametrize("prog, argv, field", CLI)
def test_a_bad_option_is_one_line_and_exit_status_2(prog, argv, field, paths, capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, path in paths.items():
        argv = [a.replace("{" + key + "}", path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        cli.run(_mains()[prog], f"python -m {prog}", argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    last = err.splitlines()[-1]  # argparse prints its usage first, then the one error line
    assert last.startswith(f"python -m {prog}: error: "), err
    _one_line_naming(last, field)


def test_stale_launcher_variables_are_refused_before_waiting(tmp_path, capsys, monkeypatch):
    """RANK, WORLD_SIZE and MASTER_* left in a shell made zero.train wait for a peer until the
    timeout; now it is one line naming them, exit status 2."""
    from zero.train import main

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for key, value in STALE.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        cli.run(main, "python -m zero.train", ["--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err, err
    assert "WORLD_SIZE=2" in err and "LOCAL_RANK" in err, err


def test_survey_size():
    """The survey's size, for the report (STATUS.md): every row above is a clear error."""
    assert len(API) >= 150 and len(CLI) >= 60, (len(API), len(CLI))


def test_an_error_elsewhere_keeps_its_traceback():
    """Only bad input (ValueError) is shortened: a bug keeps its traceback."""

    def boom(argv):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        cli.run(boom, "prog", [])
    with pytest.raises(SystemExit) as exc:
        cli.run(lambda argv: 1, "prog", [])
    assert exc.value.code == 1


ENTRY_POINTS = {
    "zero.train": "zero/train.py",
    "zero.digits": "zero/digits.py",
    "zero.checkpoint": "zero/checkpoint/__main__.py",
    "verify": "verify/__main__.py",
    "verify.demo": "verify/demo.py",
    "measure.simulate": "measure/simulate.py",
    "measure.bench": "measure/bench.py",
    "measure.fragmentation": "measure/fragmentation.py",
    "paper_figures": "paper_figures/__main__.py",
}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_runs_through_cli_run(module):
    """Each `python -m MODULE` hands its main to zero.cli.run (read from the source: starting
    nine interpreters would cost the unit tier half a minute; one is started below)."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / ENTRY_POINTS[module]).read_text()
    assert f'cli.run(main, "python -m {module}"' in source, module


def test_an_entry_point_exits_2_with_one_line():
    """`python -m zero.train --lr inf` itself: exit status 2, one line, no traceback (it was a
    traceback blaming a non-finite gradient, after the run had started)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-m", "zero.train", "--lr", "inf"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    err = done.stderr.strip()
    assert done.returncode == 2 and "Traceback" not in err, (done.returncode, err)
    assert err.splitlines()[-1].startswith("python -m zero.train: error: argument --lr"), err
