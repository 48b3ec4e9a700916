"""A manifest checked against itself before anything it describes is read.

Legend: N1 the world size at save (the manifest's world_size), L1 a unit's shard length. The
checksum only proves that nobody changed a manifest by accident; an edited and re-checksummed
one must not make a reader go out of bounds, use an unknown dtype, or hand out a wrong model.
So every record is checked for its type and range, and the records against each other: each
file entry lies inside its file and its shape has its numel; each unit's layout is recomputed
from its parameters' shapes (reference/layout.py) and must give the recorded offsets and sizes;
each unit's optimizer states are those the optimizer kind keeps for its parameters' groups.
Every error names the manifest and the field (an Invalid, which format.py's read_manifest
raises as a CheckpointError). Fields this code does not know are left alone (a later format may
add some).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from reference.layout import unit_layout
from reference.optim import Hyper, state_names
from reference.precision import ScalerState

FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
"""A file a manifest may list: a plain name inside its step directory (no path, not hidden)."""

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
"""The dtypes a file entry may have, with their sizes in bytes."""
OPTIMIZER_STATES = ("momentum_buffer", "exp_avg", "exp_avg_sq")
"""Every per-element state some optimizer kind keeps (reference/optim.py's state_names)."""
OPTIMIZERS = ("sgd", "adam", "adamw")
HYPER_FIELDS = ("lr", "weight_decay", "momentum", "dampening", "nesterov", "betas", "eps")
"""The hyper-parameters every group records (format 1 on): consolidation reads each."""


class Invalid(Exception):
    """A manifest that contradicts itself; the message names the manifest and the field."""


class _Fields:
    """Type and range checks that raise naming the manifest and the field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, message: str):
        raise Invalid(f"{self.path}: {field}: {message}")

    def int(self, value, field: str, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            self.fail(field, f"{value!r} is not an integer >= {low}")
        return value

    def of(self, value, kind: type, field: str):
        if not isinstance(value, kind):
            self.fail(
                field, f"{type(value).__name__} {str(value)[:80]}, expected a {kind.__name__}"
            )
        return value

    def shape(self, value, field: str) -> tuple[int, ...]:
        self.of(value, list, field)
        return tuple(self.int(d, f"{field}[{i}]") for i, d in enumerate(value))


def _files(c: _Fields, files: dict) -> None:
    for name, info in c.of(files, dict, "files").items():
        f = f"files[{name!r}]"
        if not FILE_NAME.fullmatch(name):
            c.fail(f, "not a plain file name inside the step directory")
        c.of(info, dict, f)
        sha = c.of(info.get("sha256"), str, f"{f}.sha256")
        if len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha):
            c.fail(f"{f}.sha256", f"{sha[:80]!r} is not a sha256 hex digest")
        size = c.int(info.get("bytes"), f"{f}.bytes")
        spans = []
        for key, entry in c.of(info.get("entries"), dict, f"{f}.entries").items():
            e = f"{f}.entries[{key!r}]"
            if not isinstance(entry, list) or len(entry) != 4:
                c.fail(e, f"{str(entry)[:80]}, expected [offset, numel, dtype, shape]")
            offset, numel, dtype, shape = entry
            c.int(offset, f"{e} offset")
            c.int(numel, f"{e} numel")
            if dtype not in DTYPE_BYTES:
                c.fail(e, f"unknown dtype {str(dtype)[:40]!r} (known: {', '.join(DTYPE_BYTES)})")
            if math.prod(c.shape(shape, f"{e} shape")) != numel:
                c.fail(e, f"shape {shape} has {math.prod(shape)} elements, numel says {numel}")
            end = offset + numel * DTYPE_BYTES[dtype]
            if end > size:
                c.fail(e, f"bytes [{offset}, {end}) lie beyond the file's {size} bytes")
            spans.append((offset, end, key))
        pos = 0  # the writer packs entries back to back: no overlap, no gap, nothing after
        for offset, end, key in sorted(spans):
            if offset != pos:
                c.fail(f"{f}.entries[{key!r}]", f"starts at byte {offset}, expected {pos}")
            pos = end
        if pos != size:
            c.fail(f"{f}.bytes", f"{size}, but its entries end at byte {pos}")


def _layout(c: _Fields, m: dict, section: str, i: int, n: int, chunk: int) -> tuple[list, dict]:
    """A unit of `section` ("units" or "frozen_units"): its parameter names, each one of this
    unit in params (frozen exactly when the section is), and its layout recomputed from their
    shapes, which must give the recorded offsets and sizes. Returns (names, sizes)."""
    params = {p["name"]: p for p in m["params"]}
    frozen = section == "frozen_units"
    f = f"{section}[{i}]"
    u = c.of(m[section][i], dict, f)
    names = [c.of(x, str, f"{f}.params") for x in c.of(u.get("params"), list, f"{f}.params")]
    for x in names:
        if x not in params or params[x]["unit"] != i or bool(params[x].get("frozen")) != frozen:
            c.fail(f"{f}.params", f"{x!r} is not a parameter of this unit in params")
    lay = unit_layout([(x, tuple(params[x]["shape"])) for x in names], chunk=chunk)
    for s in lay.slots:
        if params[s.name]["offset"] != s.offset:
            c.fail(
                f"params[{list(params).index(s.name)}] ({s.name!r})",
                f"offset {params[s.name]['offset']}, but the unit's parameters' shapes lay "
                f"it out at {s.offset}",
            )
    want = {
        "layout_numel": lay.layout_numel,
        "shard_numel": lay.shard_numel(n),
        "padded_numel": lay.padded_numel(n),
    }
    for key, value in want.items():
        if u.get(key) != value:
            c.fail(
                f"{f}.{key}",
                f"{u.get(key)!r}, but its parameters' layout at N = {n} gives {value}",
            )
    return names, want


def _frozen_units(c: _Fields, m: dict, n: int, chunk: int) -> None:
    """Frozen buffers (format 2): each rank's file holds its shard, in the unit's dtype."""
    files = m["files"]
    for j, u in enumerate(c.of(m.get("frozen_units", []), list, "frozen_units")):
        f = f"frozen_units[{j}]"
        _, want = _layout(c, m, "frozen_units", j, n, chunk)
        dtype = u.get("dtype")
        if dtype not in DTYPE_BYTES:
            c.fail(f"{f}.dtype", f"unknown dtype {str(dtype)[:40]!r}")
        unit_files = c.of(u.get("files"), list, f"{f}.files")
        if len(unit_files) != n:
            c.fail(f"{f}.files", f"{len(unit_files)} files, world_size is {n}")
        for name in unit_files:
            entry = files.get(name, {}).get("entries", {}).get("frozen")
            if entry is None or entry[1:3] != [want["shard_numel"], dtype]:
                c.fail(
                    f"files[{str(name)[:80]!r}].entries['frozen']",
                    f"{entry}, expected {want['shard_numel']} {dtype} elements "
                    f"(frozen unit {j}'s shard)",
                )


def _units(c: _Fields, m: dict, n: int, hypers: list[Hyper], kind: str, chunk: int) -> None:
    files = m["files"]
    params = {p["name"]: p for p in m["params"]}
    for i, u in enumerate(c.of(m.get("units"), list, "units")):
        f = f"units[{i}]"
        names, want = _layout(c, m, "units", i, n, chunk)
        states = [c.of(x, str, f"{f}.states") for x in c.of(u.get("states"), list, f"{f}.states")]
        kept = {x for p in names for x in state_names(kind, hypers[params[p]["group"]])}
        known = {x for x in states if x in OPTIMIZER_STATES}
        if "master" not in states or known != kept or len(set(states)) != len(states):
            c.fail(
                f"{f}.states",
                f"{states}, but optimizer {kind!r} keeps {['master', *sorted(kept)]} for the "
                "groups of this unit's parameters",
            )
        unit_files = c.of(u.get("files"), list, f"{f}.files")
        if len(unit_files) != n:
            c.fail(f"{f}.files", f"{len(unit_files)} files, world_size is {n}")
        for name in unit_files:
            if name not in files:
                c.fail(f"{f}.files", f"{str(name)[:80]!r} is not listed in files")
            for x in states:
                entry = files[name]["entries"].get(x)
                if entry is None or entry[1:3] != [want["shard_numel"], "float32"]:
                    c.fail(
                        f"files[{name!r}].entries[{x!r}]",
                        f"{entry}, expected {want['shard_numel']} float32 elements "
                        f"(unit {i}'s shard)",
                    )
    listed = {x for key in ("units", "frozen_units") for u in m.get(key, []) for x in u["params"]}
    for i, p in enumerate(m["params"]):
        if p["name"] not in listed:
            key = "frozen_units" if p.get("frozen") else "units"
            c.fail(f"params[{i}].unit", f"{p['name']!r} is not in {key}[{p['unit']}].params")


def _params(c: _Fields, m: dict, groups: int) -> None:
    seen = set()
    units = c.of(m.get("units"), list, "units")
    for i, p in enumerate(c.of(m.get("params"), list, "params")):
        f = f"params[{i}]"
        c.of(p, dict, f)
        name = c.of(p.get("name"), str, f"{f}.name")
        if name in seen:
            c.fail(f"{f}.name", f"{name!r} appears twice")
        seen.add(name)
        c.shape(p.get("shape"), f"{f}.shape")
        if p.get("dtype") not in DTYPE_BYTES:
            c.fail(f"{f}.dtype", f"unknown dtype {str(p.get('dtype'))[:40]!r}")
        frozen = p.get("frozen", False)
        if frozen is not True and frozen is not False:
            c.fail(f"{f}.frozen", f"{frozen!r}, expected true or false")
        if frozen:  # format 2: no group, no step count, a unit of frozen_units
            if p.get("group") is not None or "step" in p:
                c.fail(f, "a frozen parameter has no group and no step count")
            count = len(c.of(m.get("frozen_units", []), list, "frozen_units"))
        else:
            if p.get("group") not in range(groups) or isinstance(p.get("group"), bool):
                c.fail(f"{f}.group", f"{p.get('group')!r}, expected 0..{groups - 1}")
            if "step" in p and c.int(p["step"], f"{f}.step") > m["t"]:
                c.fail(f"{f}.step", f"{p['step']}, more optimizer steps than t = {m['t']}")
            count = len(units)
        if p.get("unit") not in range(count) or isinstance(p.get("unit"), bool):
            c.fail(f"{f}.unit", f"{p.get('unit')!r}, expected 0..{count - 1}")
        c.int(p.get("offset"), f"{f}.offset")
        for a in c.of(p.get("aliases", []), list, f"{f}.aliases"):
            c.of(a, str, f"{f}.aliases")


def validate_manifest(path: Path, m: dict) -> None:
    """Raise Invalid naming `path` and the field if manifest `m` (its checksum already checked)
    contradicts itself; see the module docstring for what is checked."""
    c = _Fields(Path(path))
    n = c.int(m.get("world_size"), "world_size", 1)
    shards = c.int(m.get("shard_group_size", n), "shard_group_size", 1)  # HSDP's G
    if n % shards:  # [Note: HSDP checkpoints] in commit.py
        c.fail("shard_group_size", f"{shards}, expected a divisor of world_size {n}")
    if m.get("stage") not in (0, 1, 2, 3) or isinstance(m.get("stage"), bool):
        c.fail("stage", f"{m.get('stage')!r}, expected 0, 1, 2 or 3")
    for key in ("t", "data_step", "sequence"):
        c.int(m.get(key), key)
    if "run_id" in m:
        c.of(m["run_id"], str, "run_id")
    cfg = c.of(m.get("config"), dict, "config")
    kind = cfg.get("optimizer")
    if kind not in OPTIMIZERS:
        c.fail("config.optimizer", f"{str(kind)[:40]!r}, expected one of {OPTIMIZERS}")
    chunk = c.int(cfg.get("chunk"), "config.chunk", 1)
    if chunk < 128 or chunk & (chunk - 1):
        c.fail("config.chunk", f"{chunk}, expected a power of two >= 128")
    hypers = []
    for i, g in enumerate(c.of(cfg.get("groups"), list, "config.groups")):
        g = dict(c.of(g, dict, f"config.groups[{i}]"))
        try:
            if "betas" in g:  # a list in JSON
                g["betas"] = tuple(g["betas"])
            hypers.append(Hyper(**g))
            missing = [k for k in HYPER_FIELDS if k not in g]
            if missing:
                raise ValueError(f"missing {missing}")
            for key, v in g.items():
                if key != "betas" and isinstance(v, bool) != (key == "nesterov"):
                    raise TypeError(f"{key}={v!r}")
                if key != "betas" and not isinstance(v, (int, float)):
                    raise TypeError(f"{key}={str(v)[:40]}")
        except (TypeError, ValueError) as exc:
            c.fail(f"config.groups[{i}]", f"not a parameter group's hyper-parameters ({exc})")
    if not hypers:
        c.fail("config.groups", "empty: at least one parameter group")
    if m.get("scaler") is not None:
        try:
            ScalerState(**c.of(m["scaler"], dict, "scaler"))
        except TypeError as exc:
            c.fail("scaler", f"not a loss scaler's state ({exc})")
    _files(c, m.get("files"))
    _params(c, m, len(hypers))
    _units(c, m, shards, hypers, kind, chunk)  # the units' shards: those of a world of G
    _frozen_units(c, m, shards, chunk)
    rng = c.of(c.of(m.get("rng"), dict, "rng").get("files"), list, "rng.files")
    if len(rng) != n or any(name not in m["files"] for name in rng):
        c.fail("rng.files", f"{str(rng)[:120]}: expected {n} files listed in files")
    aliases = {p["name"]: p.get("aliases", [p["name"]]) for p in m["params"]}
    buffers = m["files"][rng[0]]["entries"]
    for i, pair in enumerate(c.of(m.get("state_dict_keys"), list, "state_dict_keys")):
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(isinstance(x, str) for x in pair)
        ):
            c.fail(f"state_dict_keys[{i}]", f"{str(pair)[:80]}, expected [key, source]")
        key, src = pair
        if src not in aliases and not (src.startswith("buffer:") and src in buffers):
            c.fail(
                f"state_dict_keys[{i}]",
                f"source {src[:80]!r} is neither a parameter in params nor a buffer in {rng[0]}",
            )
        if key not in aliases.get(src, []) and src != f"buffer:{key}":
            c.fail(f"state_dict_keys[{i}]", f"key {key[:80]!r} is not a name of {src[:80]!r}")


def check_gaps(reader, unit: int) -> None:
    """Every element of unit `unit`'s saved buffers outside its parameters' slots is zero, as
    every optimizer keeps it (docs/checkpoints.md). This is what reveals a parameter's shape
    edited within its alignment (a bias of 48 elements recorded as 1 still fills 128)."""
    m, c = reader.m, _Fields(Path(reader.dir) / "manifest.json")
    spec = m["units"][unit]
    params = {p["name"]: p for p in m["params"]}
    slots = sorted(
        (params[x]["offset"], params[x]["offset"] + math.prod(params[x]["shape"]))
        for x in spec["params"]
    )
    gaps, pos = [], 0
    for lo, hi in slots:
        if lo > pos:
            gaps.append((pos, lo))
        pos = max(pos, hi)
    gaps.append((pos, spec["padded_numel"]))
    for key in spec["states"]:
        for lo, hi in gaps:
            if lo < hi and reader.range(unit, key, lo, hi).count_nonzero():
                c.fail(
                    f"units[{unit}]",
                    f"state {key!r} is not zero in [{lo}, {hi}), outside every parameter: the "
                    "recorded shapes do not describe the saved values",
                )
