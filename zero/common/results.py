"""The one results format for everything measured (docs/design.md §4), and atomic JSON files.

A record is a plain dict, so that any tool reads it:

    {"schema": 1, "kind": "...", "config": {...}, "result": {...}, "provenance": {...}}

- ``kind`` names what was computed or measured (e.g. ``"memory.analytic"``), so that a file can hold
  analytic and measured records side by side and a figure can tell them apart.
- ``config`` is the full configuration the result depends on (stage, N, M, precision, optimizer,
  mode, ...); :func:`config_key` turns it into a canonical string to key records by.
- ``provenance`` says where the number came from: git commit, torch and NumPy versions, device,
  date (:func:`provenance`).

Reports and figures are drawn from these records, never from numbers typed into code.

Legend: Ψ = num_params, N_d = world_size, K = the optimizer-state multiplier (as in ``config``).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
"""Bumped when a record's layout changes incompatibly."""

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None  # no git, or not a checkout (an installed package)
    return done.stdout if done.returncode == 0 else None


def _cpu_model() -> str:
    # platform.processor() is empty on most Linux systems, where the model is in /proc/cpuinfo.
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


# [Note: CPU kernels and digests] The reference fixes every operation of a step once the micro-batch
# gradients are given, but those gradients come from torch's forward and backward, whose CPU kernels
# are picked at run time by instruction set: ATen's vectorized kernels (capped by
# ATEN_CPU_CAPABILITY) and oneDNN's matmuls (capped by ONEDNN_MAX_CPU_ISA). A GPT's gradients on an
# AVX-512 machine differ in their last bits from an AVX2 machine's, so two runs' end-state digests
# are comparable only under the same kernels. Both sides of a verify cell run on one machine, so the
# engine-against-reference check never depends on it; a digest baseline carried between machines
# does.
ISA_LADDER = ("DEFAULT", "AVX2", "AVX512", "AVX512_BF16", "AMX")
"""The instruction sets the kernel record tells apart, weakest first."""

_ONEDNN_ISA = {"SSE41": "DEFAULT", "AVX": "DEFAULT", "AVX2": "AVX2", "AVX512_CORE": "AVX512",
               "AVX512_CORE_VNNI": "AVX512", "AVX512_CORE_BF16": "AVX512_BF16",
               "AVX512_CORE_AMX": "AMX"}  # fmt: skip
"""ONEDNN_MAX_CPU_ISA values (the ones that matter here) on the ladder."""

ONEDNN_CAP = {v: k for k, v in reversed(_ONEDNN_ISA.items())}
"""The ONEDNN_MAX_CPU_ISA value that caps oneDNN at a rung of the ladder."""


def _cpu_isa() -> str:
    """The highest rung this CPU offers, from its flags (DEFAULT where they cannot be read)."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512_BF16"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512"
    return "AVX2" if "avx2" in flags else "DEFAULT"


def cpu_kernels() -> dict[str, str] | None:
    """The CPU kernels torch computes gradients with ([Note: CPU kernels and digests]).

    ``aten``: torch's own dispatch (``torch.backends.cpu.get_cpu_capability()``); ``onednn``: the
    CPU's best rung capped by ONEDNN_MAX_CPU_ISA. None without torch.
    """
    try:
        import torch
    except ImportError:
        return None
    best = _cpu_isa()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    limit = _ONEDNN_ISA.get(cap, "DEFAULT" if cap not in ("", "ALL") else best)
    onednn = min(best, limit, key=ISA_LADDER.index)
    return {"aten": torch.backends.cpu.get_cpu_capability(), "onednn": onednn}


def kernel_caps(kernels: dict[str, str]) -> str:
    """The environment that makes torch use `kernels` on a stronger CPU (a shell prefix)."""
    onednn = ONEDNN_CAP.get(kernels.get("onednn", ""), "DEFAULT")
    return (
        f"ATEN_CPU_CAPABILITY={kernels.get('aten', 'default').lower()} ONEDNN_MAX_CPU_ISA={onednn}"
    )


@functools.lru_cache(maxsize=1)
def _static_provenance() -> dict[str, Any]:
    """Provenance that does not change while a process runs (cached: git and torch are slow)."""
    # Only this project's own checkout counts: an installed copy may sit inside some other
    # repository (a virtual environment in a user's project), whose commit says nothing about us.
    toplevel = _git("rev-parse", "--show-toplevel")
    ours = toplevel is not None and Path(toplevel.strip()).resolve() == _REPO_ROOT
    commit = _git("rev-parse", "HEAD") if ours else None
    # Untracked files count: a new, uncommitted module changes what ran.
    status = _git("status", "--porcelain") if ours else None
    try:
        import torch  # lazily: zero.common.results must be usable without torch
    except ImportError:
        torch = None
    try:
        import numpy
    except ImportError:
        numpy = None
    gpu = None
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {
        "git_commit": commit.strip() if commit else "unknown",
        # None when git cannot tell (no git, no commits yet, not a checkout).
        "git_dirty": (status.strip() != "") if (commit and status is not None) else None,
        "torch": torch.__version__ if torch is not None else None,
        "numpy": numpy.__version__ if numpy is not None else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_kernels": cpu_kernels(),
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if gpu is not None else 0,
    }


def provenance() -> dict[str, Any]:
    """Where a result came from: git commit and dirtiness, versions, device, UTC date (ISO 8601).

    ``git_commit`` is ``"unknown"`` outside a git checkout or before the first commit; torch and
    NumPy versions are None where they are not installed; ``gpu`` is None without CUDA.
    """
    now = datetime.datetime.now(datetime.timezone.utc)
    return {**_static_provenance(), "date_utc": now.isoformat(timespec="seconds")}


_provenance = provenance  # make_record's keyword of the same name shadows it


def config_key(config: dict[str, Any]) -> str:
    """A canonical string for a configuration: equal configs give equal keys."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)


def make_record(
    *,
    config: dict[str, Any],
    result: dict[str, Any],
    kind: str,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One result record. ``provenance`` defaults to :func:`provenance` now.

    Pass one provenance dict to many records made together, to stamp them with the same date.
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind={kind!r} is not allowed: expected a non-empty string")
    for name, value in (("config", config), ("result", result)):
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r} is not allowed: expected a dict")
    return {
        "schema": SCHEMA_VERSION,
        "kind": kind,
        "config": dict(config),
        "result": dict(result),
        "provenance": dict(provenance if provenance is not None else _provenance()),
    }


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is; some platforms (Windows) cannot
    # open a directory, and there os.replace is as durable as it gets.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically, creating parent directories.

    The data goes to a temporary file in the same directory, which is flushed and fsynced, then
    renamed over ``path`` with ``os.replace``, and the directory is fsynced. A crash at any point
    leaves either the old file or the new one, never half of one.
    """
    path = Path(path)
    blob = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    """Write ``payload`` as JSON to ``path`` atomically (:func:`write_atomic`).

    The text is serialised before anything is written, so an unserialisable payload leaves no file.
    NaN and infinities are rejected: standard JSON has none and other readers (jq, browsers) refuse
    them; store such results as strings."""
    text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n"
    return write_atomic(path, text)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file written by :func:`write_json` (or anything else)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
