"""Bad input is refused at the door (docs/design.md §5, "Bad input"): every configuration field
and every command-line option, given a value that is non-finite, negative, zero, huge, of the
wrong type or a path that cannot be used, gives one line that names the field, before any work
starts: a ValueError in the API, exit status 2 and no traceback on the command line.

The survey itself, one row per bad value tried, is verify/refusals/bad_inputs.py (the fault suite,
python -m verify.faults, runs the same rows). `test_survey_size` states how many there are, so
that a row removed shows up in review."""

import math

import pytest
from torch import nn

from verify.refusals import bad_inputs
from zero.collectives import CommCounter
from zero.common import cli
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.ranks.launch import check_launch_env
from zero.ranks.local import WorkerPool, spawn

INF, NAN = math.inf, math.nan


API = [
    pytest.param(make, field, v, id=f"{make.__name__}.{field}={v!r}")
    for make, field, v in bad_inputs.api_rows()
]


def _one_line_naming(text: str, field: str) -> None:
    assert bad_inputs.one_line_naming(text, field), (field, text)


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
    with pytest.raises(ValueError, match=r"^deadline_s=-1"):
        spawn(print, 1, timeout_s=5, deadline_s=-1)
    with pytest.raises(ValueError, match=r"^partition_activations=True: P_a needs"):
        ZeroEngine(
            nn.Linear(2, 2), ZeroConfig(activation_checkpointing=True, partition_activations=True)
        )
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
    from measure.fake_rank import main as simulate
    from measure.largest import main as largest
    from paper_figures.__main__ import main as figures
    from verify.__main__ import main as verify
    from verify.demo import main as demo
    from zero.workloads.digits import main as digits
    from zero.workloads.train import main as train

    return {
        "zero.workloads.train": train,
        "zero.workloads.digits": digits,
        "verify": verify,
        "verify.demo": demo,
        "measure.fake_rank": simulate,
        "measure.bench": bench,
        "measure.largest": largest,
        "paper_figures": figures,
    }


CLI = [
    pytest.param(prog, argv, field, id=f"{prog} {' '.join(argv)}")
    for prog, argv, field in bad_inputs.cli_rows()
]


@pytest.fixture
def paths(tmp_path):
    return bad_inputs.paths(tmp_path)


@pytest.mark.parametrize("prog, argv, field", CLI)
def test_a_bad_option_is_one_line_and_exit_status_2(prog, argv, field, paths, capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    argv = bad_inputs.fill(argv, paths)
    with pytest.raises(SystemExit) as exc:
        cli.run(_mains()[prog], f"python -m {prog}", argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    last = err.splitlines()[-1]  # argparse prints its usage first, then the one error line
    assert last.startswith(f"python -m {prog}: error: "), err
    _one_line_naming(last, field)


def test_stale_launcher_variables_are_refused_before_waiting(tmp_path, capsys, monkeypatch):
    """RANK, WORLD_SIZE and MASTER_* left in a shell made zero.workloads.train wait for a peer until
    the timeout; now it is one line naming them, exit status 2."""
    from zero.workloads.train import main

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for key, value in STALE.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        cli.run(main, "python -m zero.workloads.train", ["--out", str(tmp_path)])
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
    "zero.workloads.train": "zero/workloads/train.py",
    "zero.workloads.digits": "zero/workloads/digits.py",
    "zero.checkpoint": "zero/checkpoint/__main__.py",
    "verify": "verify/__main__.py",
    "verify.demo": "verify/demo.py",
    "measure.fake_rank": "measure/fake_rank.py",
    "measure.bench": "measure/bench.py",
    "measure.fragmentation": "measure/fragmentation.py",
    "measure.largest": "measure/largest.py",
    "paper_figures": "paper_figures/__main__.py",
}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_runs_through_cli_run(module):
    """Each `python -m MODULE` hands its main to zero.common.cli.run (read from the source: starting
    nine interpreters would cost the unit tier half a minute; one is started below)."""
    import re
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / ENTRY_POINTS[module]).read_text()
    # main itself, or a wrapper of it (zero.workloads.train's cli_main: a fault mid-run is one
    # line and exit status 1); the program's name as a string, or a module constant holding it
    prog = f'"python -m {re.escape(module)}"'
    names = [prog] + re.findall(rf"^([A-Z_]+) = {prog}$", source, re.M)
    assert re.search(rf"cli\.run\((main|cli_main), ({'|'.join(names)})", source), module


def test_an_entry_point_exits_2_with_one_line():
    """`python -m zero.workloads.train --lr inf` itself: exit status 2, one line, no traceback (it
    was a traceback blaming a non-finite gradient, after the run had started)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-m", "zero.workloads.train", "--lr", "inf"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    err = done.stderr.strip()
    assert done.returncode == 2 and "Traceback" not in err, (done.returncode, err)
    assert err.splitlines()[-1].startswith(
        "python -m zero.workloads.train: error: argument --lr"
    ), err
