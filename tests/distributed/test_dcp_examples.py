"""The two example scripts a user runs (examples/engine_continue.py, examples/fsdp2_continue.py),
run as docs/checkpoints.md shows them, each under `torchrun --standalone --nproc-per-node 2`:
the engine trains and saves a DCP checkpoint; plain FSDP2 loads it, steps, saves; the engine
loads FSDP2's checkpoint, steps, saves. Every state passed along is compared bit for bit: each
script's --digest (sha256 of every parameter's and optimizer state's fp32 bytes, by DCP key,
gathered in the script) against the other's and against the checkpoint folder read here,
in this process, with plain torch.distributed.checkpoint.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

pytestmark = pytest.mark.timeout(300)


def script(name: str):
    """An example script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun(name: str, *args: str) -> str:
    """`torchrun --standalone --nproc-per-node 2 examples/<name>.py *args` from the repository
    root, without launcher variables inherited from the test's environment; its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", f"examples/{name}.py", *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def folder_digest(folder: Path, keys) -> dict[str, str]:
    """sha256 of each key's fp32 bytes, read from a DCP folder in this process (no group)."""
    md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():  # DCP notes that it loads in one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    return {k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest() for k, v in sd.items()}


def step_counts(folder: Path, keys) -> set[float]:
    md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    sd = {k: torch.empty(()) for k in keys if k.endswith(".step")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    assert all(tuple(md[k].size) == () for k in sd)
    return {float(v) for v in sd.values()}


@pytest.mark.dist
def test_fsdp2_continues_the_engines_checkpoint_and_the_engine_continues_fsdp2s(tmp_path):
    """engine_continue.py (N = 2, stage 3) takes steps 0-1 and saves; fsdp2_continue.py loads
    that with exactly the engine's gathered bits (every parameter, exp_avg, exp_avg_sq, step
    count), takes step 2 and saves; engine_continue.py loads FSDP2's checkpoint with exactly
    FSDP2's bits, takes steps 3-4 and saves. Each digest also equals the folder's own, and the
    FSDP2 step changes every tensor's digest (so equal digests are no accident)."""
    engine, fsdp2 = script("engine_continue"), script("fsdp2_continue")
    model = engine.make_model()
    shapes = {k: p.shape for k, p in model.named_parameters()}
    assert shapes == {k: p.shape for k, p in fsdp2.make_model().named_parameters()}
    keys = set(shapes) | {f"state.{k}.{x}" for k in shapes for x in ("exp_avg", "exp_avg_sq")}
    keys |= {f"state.{k}.step" for k in shapes}

    a, b, c = tmp_path / "engine-2", tmp_path / "fsdp2-3", tmp_path / "engine-5"
    d = [tmp_path / f"digest{i}.json" for i in range(3)]
    out = torchrun("engine_continue", "--save", str(a), "--steps", "2", "--digest", str(d[0]))
    assert f"saved {a}: step 2" in out
    out = torchrun("fsdp2_continue", "--load", str(a), "--save", str(b), "--digest", str(d[1]))
    assert f"loaded {a}: step 2" in out and f"saved {b}: step 3" in out
    out = torchrun("engine_continue", "--load", str(b), "--save", str(c), "--digest", str(d[2]))
    assert f"loaded {b}: step 3, next data step 3" in out and f"saved {c}: step 5" in out
    ours, theirs, back = (json.loads(p.read_text()) for p in d)

    assert set(ours["saved"]) == keys  # every parameter once, every state
    assert ours["saved"] == folder_digest(a, keys)  # the engine wrote its gathered state
    assert theirs["loaded"] == ours["saved"]  # FSDP2 loaded it bit for bit
    assert all(theirs["loaded"][k] != theirs["saved"][k] for k in keys)  # the step moved all
    assert theirs["saved"] == folder_digest(b, keys)
    assert back["loaded"] == theirs["saved"]  # the engine loaded FSDP2's bit for bit
    assert back["saved"] == folder_digest(c, keys)
    assert [step_counts(f, keys) for f in (a, b, c)] == [{2.0}, {3.0}, {5.0}]
