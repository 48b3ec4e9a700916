"""measure/largest.py without training: the ladder's shapes whose estimate fits the host budget
are tried largest first, and a shape that fails (killed for memory, an error) is recorded and the
next smaller one tried; the parameter count matches the GPT's own. Its command line refuses every
bad option with one line and exit status 2 before any work (a measurement started here raises),
and a tier whose every shape failed exits 1 with one line, its --json report written."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import measure.largest as L
from zero.common import cli
from zero.workloads.models import GPT, GPTConfig


def test_params_of_counts_the_gpt():
    for layers, width in ((2, 256), (3, 512)):
        cfg = GPTConfig(vocab_size=L.VOCAB, block_size=L.BLOCK, n_layer=layers,
                        n_head=width // 128, n_embd=width)  # fmt: skip
        model = GPT(cfg, device="meta")
        assert L.params_of(layers, width) == sum(p.numel() for p in model.parameters())


def test_the_search_tries_the_largest_fitting_shape_first_and_steps_down(monkeypatch):
    tried = []

    def attempt(layers, width, tier, args):
        tried.append((layers, width))
        if len(tried) == 1:
            return {"layers": layers, "width": width, "failed": "killed", "returncode": -9}
        return {"layers": layers, "width": width, "params": L.params_of(layers, width)}

    monkeypatch.setattr(L, "attempt", attempt)
    args = SimpleNamespace(host_gib=20.0)
    budget = 20 * (1 << 30)
    fits = [s for s in L.LADDER if L.params_of(*s) * L.BYTES_PER_PARAM["memory"] <= budget]
    records = L.search("memory", args)
    assert tried == [fits[-1], fits[-2]]  # the largest that fits failed; the next one trained
    assert "failed" in records[0] and "failed" not in records[1]
    beyond = L.LADDER[len(fits)]  # the first shape over the budget is never tried
    assert L.params_of(*beyond) * L.BYTES_PER_PARAM["memory"] > budget


# -- the command line: checked before any work --------------------------------------------------

PROG = "python -m measure.largest"


class Started(AssertionError):
    """Work started (a probe, a process, a training) where the input should have been refused."""


@pytest.fixture
def no_work(monkeypatch):
    """Every way a measurement starts raises Started: the probe, a child process, a training."""

    def refuse(*args, **kwargs):
        raise Started(args)

    for name in ("attempt", "disk_bandwidth", "run_one", "search"):
        monkeypatch.setattr(L, name, refuse)
    monkeypatch.setattr(L.subprocess, "run", refuse)
    monkeypatch.setattr(L.subprocess, "Popen", refuse)


def _run(argv, capsys) -> tuple[int, str]:
    """`python -m measure.largest *argv` in this process: (exit status, stderr)."""
    with pytest.raises(SystemExit) as exc:
        cli.run(L.main, PROG, [str(a) for a in argv])
    return exc.value.code, capsys.readouterr().err


def _read_only_dir(tmp_path: Path) -> str:
    """A folder nobody may write in: a 0o555 one, or where root writes through modes, sysfs
    (which takes no files)."""
    ro = tmp_path / "read_only"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        tempfile.TemporaryFile(dir=ro).close()
    except OSError:
        return str(ro)
    return "/sys/zero-largest"


SHAPE = ["--shape", "2", "256"]
BAD = [
    # (argv, field): each after a good --dir and --json (which a row may replace)
    (["--host-gib", "0"], "host_gib"),
    (["--host-gib", "-5"], "host_gib"),
    (["--host-gib", "nan"], "host_gib"),
    (["--host-gib", "inf"], "host_gib"),  # walked the whole ladder
    (["--host-gib", "1"], "host_gib"),  # below the smallest shape in tier 'none': did nothing
    (["--host-gib", "0.5", "--tiers", "disk"], "host_gib"),
    (["--host-gib", "20", "--tiers", "disk", "disk"], "tiers"),
    ([], "host_gib"),  # neither a budget nor a shape
    (["--shape", "0", "128"], "shape"),
    (["--shape", "2", "100"], "shape"),  # not a whole number of 128-wide heads
    (["--shape", "2", "-128"], "shape"),
    (["--shape", "2", "0"], "shape"),
    ([*SHAPE, "--steps", "0"], "steps"),
    ([*SHAPE, "--steps", "-1"], "steps"),
    ([*SHAPE, "--probe-gib", "nan"], "probe_gib"),
    ([*SHAPE, "--probe-gib", "inf"], "probe_gib"),
    ([*SHAPE, "--probe-gib", "0"], "probe_gib"),
    ([*SHAPE, "--probe-gib", "-1"], "probe_gib"),
    ([*SHAPE, "--probe-gib", "1e300"], "dir"),  # no room for it (its bytes overflow a float)
    ([*SHAPE, "--dir", "{read_only}"], "dir"),
    ([*SHAPE, "--dir", "{file}/sub"], "dir"),
    ([*SHAPE, "--dir", "{file}"], "dir"),
    ([*SHAPE, "--json", "{read_only}/r.json"], "json"),
    ([*SHAPE, "--json", "{file}/r.json"], "json"),
    ([*SHAPE, "--json", "{tmp}"], "json"),  # a folder
]


def _fill(argv, tmp_path, read_only):
    file = tmp_path / "a_file"
    file.write_text("not a folder")
    where = {"{read_only}": read_only, "{file}": str(file), "{tmp}": str(tmp_path)}
    for key, value in where.items():
        argv = [a.replace(key, value) for a in argv]
    return argv


@pytest.mark.parametrize("argv, field", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_a_bad_option_is_one_line_and_exit_status_2_before_any_work(
    argv, field, tmp_path, capsys, no_work
):
    work, out = tmp_path / "work", tmp_path / "out" / "r.json"
    argv = ["--dir", work, "--json", out, *_fill(argv, tmp_path, _read_only_dir(tmp_path))]
    code, err = _run(argv, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"{PROG}: error: {field}="), err
    assert not work.exists() and not out.exists()  # nothing made under --dir, no report


def test_cuda_without_a_cuda_device_is_refused_up_front(tmp_path, capsys, no_work, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _run([*SHAPE, "--device", "cuda", "--dir", tmp_path / "work"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{PROG}: error: device='cuda': ") and "no CUDA device" in err, err
    assert not (tmp_path / "work").exists()


def test_a_dir_without_room_for_the_probe_is_refused_with_the_bytes(
    tmp_path, capsys, no_work, monkeypatch
):
    real = os.statvfs

    def full(path):
        st = real(path)
        return SimpleNamespace(f_bavail=10, f_frsize=st.f_frsize, f_bsize=st.f_bsize)

    monkeypatch.setattr(L.os, "statvfs", full)
    code, err = _run([*SHAPE, "--dir", tmp_path, "--probe-gib", "0.5"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{PROG}: error: dir={str(tmp_path)!r}: "), err
    free = 10 * real(tmp_path).f_frsize
    assert f"{free} bytes free" in err and f"writes {1 << 29}" in err, err
    assert list(tmp_path.iterdir()) == []


def test_without_the_disk_tier_dir_and_its_room_are_not_checked(tmp_path, capsys, monkeypatch):
    """--dir is the disk tier's (and its probe's): the other tiers neither use nor check it."""
    attempt, tried = _fake_attempt({(2, 256): None})
    monkeypatch.setattr(L, "attempt", attempt)
    monkeypatch.setattr(L, "disk_bandwidth", lambda *a: pytest.fail("probed without the tier"))
    argv = [*SHAPE, "--tiers", "memory", "--dir", tmp_path / "f" / "x", "--probe-gib", "1e9"]
    (tmp_path / "f").write_text("a file")
    code, err = _run(argv, capsys)
    assert code == 0 and tried == [(2, 256, "memory")], err


def test_every_option_has_help():
    """From the parser itself: every option shown in --help has a help text of its own."""
    actions = [a for a in L.parser()._actions if a.option_strings]
    shown = [a for a in actions if a.help is not argparse.SUPPRESS]
    assert {a.dest for a in actions} - {a.dest for a in shown} == {"one"}  # the child's own
    assert len(shown) >= 10
    for a in shown:
        assert isinstance(a.help, str) and a.help.strip(), a.option_strings
    text = L.parser().format_help()
    assert all(a.option_strings[-1] in text for a in shown)


def _fake_attempt(results):
    """An attempt that answers from `results`: {(layers, width): None (trains) or why it fails}."""
    tried = []

    def attempt(layers, width, tier, args):
        tried.append((layers, width, tier))
        why = results.get((layers, width), "no such shape in the test")
        if why is None:
            return {"layers": layers, "width": width, "tier": tier, "params": 1}
        return {"layers": layers, "width": width, "tier": tier, "failed": why, "returncode": 1}

    return attempt, tried


def test_a_failed_shape_exits_1_with_one_line_and_the_report_written(tmp_path, capsys, monkeypatch):
    attempt, tried = _fake_attempt({(2, 256): "RuntimeError: out of memory"})
    monkeypatch.setattr(L, "attempt", attempt)
    out = tmp_path / "missing" / "r.json"  # a folder made for it
    code, err = _run([*SHAPE, "--tiers", "memory", "--json", out], capsys)
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{PROG}: error: ") and "tier 'memory'" in err, err
    assert "shape 2x256" in err and "RuntimeError: out of memory" in err, err
    report = json.loads(out.read_text())
    why = "RuntimeError: out of memory"
    assert report["memory"] == [
        {"layers": 2, "width": 256, "tier": "memory", "failed": why, "returncode": 1}
    ]


def test_a_search_whose_every_shape_failed_exits_1(tmp_path, capsys, monkeypatch):
    attempt, tried = _fake_attempt({})
    monkeypatch.setattr(L, "attempt", attempt)
    monkeypatch.setattr(L, "disk_bandwidth", lambda d, g: {"bytes": 0})
    out = tmp_path / "r.json"
    code, err = _run(["--host-gib", "3", "--tiers", "none", "disk", "--dir", tmp_path,
                      "--json", out], capsys)  # fmt: skip
    assert code == 1, err
    (line,) = err.strip().splitlines()
    smallest = "x".join(map(str, L.LADDER[0]))
    assert f"the smallest {smallest}" in line and "tier 'none'" in line and "tier 'disk'" in line
    report = json.loads(out.read_text())
    assert [(r["layers"], r["width"]) for r in report["none"]][-1] == L.LADDER[0]
    assert len(report["disk"]) == len(tried) - len(report["none"]) > 1
    assert report["disk_bandwidth"] == {"bytes": 0}  # the probe beside the disk tier's records


def test_a_search_that_trains_exits_0(tmp_path, capsys, monkeypatch):
    attempt, tried = _fake_attempt({s: None for s in L.LADDER})
    monkeypatch.setattr(L, "attempt", attempt)
    out = tmp_path / "r.json"
    code, err = _run(["--host-gib", "3", "--tiers", "memory", "--json", out], capsys)
    assert code == 0 and err == "", err
    assert len(tried) == 1 and "failed" not in json.loads(out.read_text())["memory"][0]


def test_a_child_killed_for_memory_is_named(monkeypatch):
    """attempt's record of a child that died by SIGKILL with nothing on stderr (the OOM killer)."""
    done = subprocess.CompletedProcess([], returncode=-9, stdout="", stderr="")
    monkeypatch.setattr(L.subprocess, "run", lambda *a, **k: done)
    args = SimpleNamespace(steps=1, device="cpu", dir=".", reduce_dtype=None)
    rec = L.attempt(2, 256, "memory", args)
    assert rec["returncode"] == -9 and rec["failed"] == "killed by SIGKILL (out of memory?)"
