"""The survey of bad input (docs/design.md §5, "Bad input"): one row per bad value tried, for
every configuration field and every command-line option, shared by the unit tests
(tests/unit/test_bad_input.py) and the fault suite (verify/faults/inputs.py).

Each is refused at the door: a ValueError naming the field in the API; exit status 2 and one
line naming the option, with no traceback, on the command line. The rows are data (no test
framework here): callers build their own parameters from them.
"""

from __future__ import annotations

import math
from pathlib import Path

from measure.bench import BenchConfig
from measure.fake_rank import SimulateConfig
from reference.optim import Hyper
from reference.precision import ScalerConfig
from zero import build
from zero.config import ZeroConfig
from zero.workloads.digits import DigitsConfig
from zero.workloads.train import TrainConfig

INF, NAN = math.inf, math.nan


class GroupOf:
    """A group_of for the rows: returns `value`, or raises it when it is an exception; shown
    by what it does (a row's id)."""

    def __init__(self, value):
        self.value = value

    def __call__(self, name, param):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value

    def __repr__(self) -> str:
        what = "raises" if isinstance(self.value, BaseException) else "returns"
        return f"GroupOf({what} {self.value!r})"


def group_index(*, group_of) -> dict:
    """What ZeroEngine does with config.group_of on construction, before it allocates anything
    (zero.build.group_index), for a two-layer model: no process group needed."""
    from torch import nn

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    named = [("", list(model.named_parameters()))]
    return build.group_index(ZeroConfig(group_of=group_of, groups=(Hyper(), Hyper())), named)


def api_rows() -> list[tuple]:
    """(make, field, value): `make(**{field: value})` must raise a ValueError naming field."""
    rows = []

    def bad(make, field, *values):
        for v in values:
            rows.append((make, field, v))

    for part in (_optimizer_fields, _zero_fields, _command_fields):
        part(bad)
    return rows


def _optimizer_fields(bad) -> None:
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


def _zero_fields(bad) -> None:
    bad(ZeroConfig, "stage", 4, -1, True, "2", 2.0)  # 2.0 was accepted (2.0 in (0, 1, 2, 3))
    bad(ZeroConfig, "precision", "fp8", None)
    bad(ZeroConfig, "reduce_dtype", "fp64")
    bad(ZeroConfig, "optimizer", "lion")
    bad(ZeroConfig, "groups", (None,), (), "adam", (Hyper(), 3), [Hyper()])
    bad(ZeroConfig, "group_of", 3)
    # was a bare TypeError ('<=' between int and str), and the function's own ZeroDivisionError
    bad(group_index, "group_of", GroupOf("0"), GroupOf(2), GroupOf(True), GroupOf(1.0))
    bad(group_index, "group_of", GroupOf(ZeroDivisionError("division by zero")))
    bad(ZeroConfig, "micro_batches", 0, -2, 1.5)
    bad(ZeroConfig, "ranks_per_node", 0, -1, True, 2.0, "2")
    bad(ZeroConfig, "hpz", 1, True, "yes")  # True: refused without stage 3
    bad(ZeroConfig, "qwz_bits", 2, True, 8.0, "8", 8)  # 8: refused without stage 3
    bad(ZeroConfig, "qgz_bits", 16, 4.0, 4)  # 4: refused without stage 3
    bad(ZeroConfig, "quant_block", 0, True, 2.5)
    bad(ZeroConfig, "shard_group_size", 0, True, 2.0, "2", 2)  # 2: refused at stage 0
    bad(ZeroConfig, "clip_norm", INF, NAN, 0.0, -1.0)
    bad(ZeroConfig, "scaler", None)
    bad(ZeroConfig, "nonfinite", "ignore")
    bad(ZeroConfig, "units", "everything", ("a", "a"), ("",), ["a"], (1,), 3, None)
    bad(ZeroConfig, "persist_below", -1, 1.5)
    bad(ZeroConfig, "chunk", 2**40, 100, 0, 64, True)
    bad(ZeroConfig, "bucket_elements", 0, True, 2.5)
    for f in ("deterministic", "overlap", "activation_checkpointing", "offload_optimizer"):
        bad(ZeroConfig, f, "yes", None)
    bad(ZeroConfig, "contiguous_memory", 1)
    bad(ZeroConfig, "broadcast_buffers", None)
    bad(ZeroConfig, "release_grads", "yes")
    bad(ZeroConfig, "watchdog", True, "every", None)
    bad(ZeroConfig, "partition_activations", "yes")


def _command_fields(bad) -> None:
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
    bad(SimulateConfig, "device", "tpu", "cudax", "cuda:99")  # no machine here has 100 GPUs
    # a list was an AttributeError, a key the rank sets or an unknown one a TypeError, all after
    # the process group and the model were built
    bad(SimulateConfig, "options", [1, 2], "x", {"stage": 2}, {"bogus": True}, {"chunk": 3})
    p_a = {"partition_activations": True, "activation_checkpointing": True}  # needs mp > 1
    bad(SimulateConfig, "options", p_a, {"bucket_elements": 8, "chunk": 128})  # 8 < N = 64
    bad(SimulateConfig, "shape", {"n_layer": 0, "n_embd": 64, "n_head": 1}, {"layers": 2})
    bad(BenchConfig, "lr", INF, NAN, 0.0)
    bad(BenchConfig, "weight_decay", INF, -1.0)
    bad(BenchConfig, "quiet_cores", NAN, -1.0)
    bad(BenchConfig, "quiet_wait_s", INF, -1.0)
    bad(BenchConfig, "timeout_s", INF, 0.0)
    bad(BenchConfig, "repeats", 0)
    bad(BenchConfig, "world_sizes", (0,), ())
    bad(BenchConfig, "watchdog", "sometimes", False)
    bad(BenchConfig, "malloc", "never", None)


def cli_rows() -> list[tuple]:
    """(prog, argv, field): `python -m prog *argv` must exit 2 with one line naming field;
    {file}, {missing} and {text} in argv are paths that `paths(tmp)` makes."""
    rows = []

    def bad(prog, field, *argv):
        rows.append((prog, list(argv), field))

    for part in (_training_options, _verify_options, _measure_options, _largest_options):
        part(bad)
    return rows


def _training_options(bad) -> None:
    t = "zero.workloads.train"
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
    d = "zero.workloads.digits"
    bad(d, "lr", "--lr", "inf")
    bad(d, "timeout_s", "--timeout", "inf")
    bad(d, "test_fraction", "--test-fraction", "1")
    bad(d, "steps", "--steps", "0")
    bad(d, "out", "--out", "{file}/sub")


def _verify_options(bad) -> None:
    v = "verify"
    bad(v, "world_sizes", "--quick", "--world-sizes", "7", "--list")  # was "0/0 cells", exit 1
    bad(v, "world_sizes", "--world-sizes", "0", "--list")
    bad(v, "timeout", "--timeout", "inf", "--list")
    bad(v, "timeout", "--timeout", "0", "--list")
    bad(v, "steps", "--steps", "0", "--list")
    bad(v, "stages", "--stages", "5", "--list")
    bad(v, "json", "--json", "{file}/v.json", "--list")
    bad(v, "baseline", "--baseline", "{missing}", "--list")
    bad(v, "backend", "--backend", "nccl", "--device", "cpu", "--list")  # NCCL is GPUs only
    bad(v, "device", "--device", "tpu", "--list")
    bad("verify.demo", "world_size", "--world-size", "0")
    bad("verify.demo", "steps", "--steps", "0")


def _measure_options(bad) -> None:
    s = "measure.fake_rank"
    bad(s, "steps", "--steps", "0")
    bad(s, "params", "--params", "1e15")  # was minutes building a million-layer model
    bad(s, "params", "--params", "inf")
    bad(s, "params", "--params", "-1")
    bad(s, "world_size", "--world-size", "0")
    bad(s, "rank", "--rank", "64")
    bad(s, "stage", "--stage", "4")
    bad(s, "device", "--device", "tpu")
    bad(s, "device", "--device", "cuda:99")  # was torch's traceback from its first CUDA call
    bad(s, "options", "--options", "[1, 2]")  # was an AttributeError after the model was built
    bad(s, "options", "--options", '{"stage": 2}')  # was a TypeError (stage given twice)
    bad(s, "options", "--options", '{"bogus": true}')  # was a TypeError
    bad(s, "options", "--options", '{"chunk": 3}')
    # the padding of N ranks: 2M parameters at N = 10^7 are padded to 1.2·10^11 elements (the
    # check counted 2M, and the rank then failed to allocate a gathered unit of 4·10^10)
    bad(s, "world_size", "--params", "2e6", "--vocab-size", "256", "--world-size", "10000000")
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
    bad(b, "from_json", "--from-json", "{binary}")  # was "'utf-8' codec ...", no file named
    bad(b, "from_json", "--from-json", "{text}")  # not JSON
    bad(b, "from_json", "--from-json", "{file}")  # not JSON either
    bad(b, "from_json", "--from-json", "{records}")  # JSON without step-time records
    bad("paper_figures", "out", "--out", "{file}/sub")
    bad("paper_figures", "profile", "--profile", "huge")


def _largest_options(bad) -> None:
    # one small model, its files in the row's own folder, a small probe: only the option is bad
    # (were it accepted, the run would stay small and leave the working directory alone)
    g, one = "measure.largest", ("--shape", "1", "128", "--dir", "{folder}", "--probe-gib", "0.001")
    for v in ("0", "-5", "nan", "inf"):
        bad(g, "host_gib", "--host-gib", v)
    for layers, width in (("0", "128"), ("2", "100"), ("2", "-128")):
        bad(g, "shape", "--shape", layers, width)
    for v in ("0", "-1"):
        bad(g, "steps", *one, "--steps", v)
    bad(g, "probe_gib", *one, "--probe-gib", "nan")
    bad(g, "json", *one, "--json", "/proc/no-such-folder/r.json")  # a missing parent, read-only
    bad(g, "json", *one, "--json", "{file}/r.json")  # its parent is a file
    bad(g, "json", *one, "--json", "{folder}")
    bad(g, "dir", *one, "--dir", "{file}")
    if not _has_cuda():  # where CUDA is, --device cuda is a good value
        bad(g, "device", *one, "--device", "cuda")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def one_line_naming(text: str, field: str) -> bool:
    """The refusal is one line, without a traceback, naming the field (as `field=`, `field[`,
    `field(` for a function's call, e.g. group_of('weight')='0', or its option `--field`)."""
    text = text.strip()
    names = (f"{field}=", f"{field}[", f"{field}(", f"--{field.replace('_', '-')}")
    return "\n" not in text and "Traceback" not in text and any(n in text for n in names)


def paths(tmp: Path) -> dict[str, str]:
    """The paths the command-line rows name: a file (so FILE/sub cannot be a folder), a missing
    path, a small text whose three 64 KiB pieces are all held out at --val-fraction 0.99, a
    binary file (not UTF-8), a JSON file whose records are not step-time records and a folder
    (where a file is expected)."""
    file = tmp / "a_file"
    file.write_text("not a folder")
    text = tmp / "small.txt"
    text.write_bytes(b"print('hello')\n" * 13_000)
    binary = tmp / "binary.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    records = tmp / "records.json"
    records.write_text('{"records": [{"config": {}, "result": {}}]}')
    return {
        "file": str(file),
        "missing": str(tmp / "missing"),
        "text": str(text),
        "binary": str(binary),
        "records": str(records),
        "folder": str(tmp),
    }


def fill(argv: list[str], where: dict[str, str]) -> list[str]:
    for key, path in where.items():
        argv = [a.replace("{" + key + "}", path) for a in argv]
    return argv
