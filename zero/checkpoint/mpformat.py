"""The manifest of a model-parallel checkpoint: its slices and their splits, checked together.

Legend (docs/design.md §6): N_d, N_m the mesh a checkpoint was saved at; m an MP index; a
*slice* is MP index m's part of every parameter; a parameter's *whole* shape is its shape in the
plain (N_m = 1) model.

[Note: MP checkpoint layout] A model-parallel engine saves at (N_d, N_m) as N_m checkpoints of
its slices in one step directory. Slice m's files carry the prefix m{m:04d}- (m0001-u0003-r0001.bin
is DP rank 1's shard of unit 3 of slice 1; m0001-r0000.bin holds that slice's RNG state and
buffers), so no two ranks of the N_d·N_m write one name. The one manifest (format version 3) has
the common records at its top (step, t, scaler, config, every file's sha256) and under "mp":
"size" N_m; "splits", per parameter its rule (zero/mp/gpt.py's SPLITS: "rows", "cols", "qkv", or
null for replicated), the dim it is cut along and its whole shape; and "slices", per m what a
plain manifest has at its top (params, units, frozen_units, state_dict_keys, rng) with
world_size = N_d. ``views(m)`` gives each slice as a plain manifest; a plain checkpoint is one
view with no splits, which is how plain and model-parallel checkpoints load into each other.
"""

from __future__ import annotations

from pathlib import Path

from .validate import Invalid, _Fields, validate_manifest

SLICE_KEYS = ("params", "units", "frozen_units", "state_dict_keys", "rng")
"""What a plain manifest has at its top and a model-parallel one per slice."""
RULES = {"rows": 0, "qkv": 0, "cols": 1, None: None}
"""A split rule (zero/mp/gpt.py's SPLITS values; None: replicated) -> the dim it cuts."""
MP_FORMAT_VERSION = 3
"""The first format version with model-parallel checkpoints (the "mp" section)."""


def views(m: dict) -> list[dict]:
    """Each slice of a manifest as a plain manifest, in m order ([m] for a plain one)."""
    if "mp" not in m:
        return [m]
    common = {k: v for k, v in m.items() if k != "mp"}
    return [common | s for s in m["mp"]["slices"]]


def splits(m: dict) -> dict:
    """Parameter name -> {"rule", "dim", "shape"} (whole); {} for a plain checkpoint."""
    return m["mp"]["splits"] if "mp" in m else {}


def whole_params(m: dict) -> list[dict]:
    """The params records of slice 0 with whole shapes: what the plain model has."""
    whole = splits(m)
    return [
        p | {"shape": whole[p["name"]]["shape"]} if p["name"] in whole else p
        for p in views(m)[0]["params"]
    ]


def slice_shape(whole, rule: str | None, n: int) -> tuple[int, ...]:
    """The shape of one of n slices of a parameter of shape `whole` cut by `rule`; ValueError if
    the cut is not exact (qkv cuts each third of dim 0 in n)."""
    whole = tuple(whole)
    if rule is None:
        return whole
    dim, pieces = RULES[rule], 3 * n if rule == "qkv" else n
    if len(whole) <= dim or whole[dim] % pieces:
        raise ValueError(f"shape {whole} cannot be cut in {n} by rule {rule!r}")
    return whole[:dim] + (whole[dim] // n,) + whole[dim + 1 :]


def whole_shape(part, rule: str | None, n: int) -> tuple[int, ...]:
    """The whole shape of a parameter whose n slices each have shape `part`."""
    part = tuple(part)
    if rule is None:
        return part
    dim = RULES[rule]
    return part[:dim] + (part[dim] * n,) + part[dim + 1 :]


def validate_mp(path: Path, m: dict) -> None:
    """Raise Invalid naming `path` and the field unless a model-parallel manifest is consistent:
    each slice a valid plain manifest (validate.py), the slices listing the same parameters in
    the same order with one group, step count and frozen flag, each slice's shape the whole
    shape cut by the parameter's rule, and no file shared by two slices."""
    c = _Fields(Path(path))
    if c.int(m.get("format_version"), "format_version") < MP_FORMAT_VERSION:
        c.fail("format_version", f"{m['format_version']}, but an 'mp' section needs >= 3")
    mp = c.of(m.get("mp"), dict, "mp")
    n = c.int(mp.get("size"), "mp.size", 1)
    slices = c.of(mp.get("slices"), list, "mp.slices")
    if len(slices) != n:
        c.fail("mp.slices", f"{len(slices)} slices, mp.size is {n}")
    for key in SLICE_KEYS:
        if key in m:
            c.fail(key, "at the top of a model-parallel manifest; it belongs in mp.slices[m]")
    for k, s in enumerate(slices):
        c.of(s, dict, f"mp.slices[{k}]")
    for k, view in enumerate(views(m)):
        try:
            validate_manifest(path, view)
        except Invalid as exc:  # the same message, the field placed in its slice
            raise Invalid(str(exc).replace(f"{path}: ", f"{path}: mp.slices[{k}].", 1)) from None
    first = slices[0]["params"]
    whole = c.of(mp.get("splits"), dict, "mp.splits")
    if sorted(whole) != sorted(p["name"] for p in first):
        c.fail("mp.splits", "its parameters are not those of mp.slices[0].params")
    want = {}
    for name, s in whole.items():
        f = f"mp.splits[{name!r}]"
        rule = c.of(s, dict, f).get("rule")
        if rule not in RULES or s.get("dim") != RULES[rule]:
            c.fail(f, f"rule {rule!r}, dim {s.get('dim')!r}: expected one of {RULES}")
        try:
            want[name] = slice_shape(c.shape(s.get("shape"), f"{f}.shape"), rule, n)
        except ValueError as exc:
            c.fail(f"{f}.shape", str(exc))
    owner: dict[str, int] = {}
    for k, s in enumerate(slices):
        if [p["name"] for p in s["params"]] != [p["name"] for p in first]:
            c.fail(f"mp.slices[{k}].params", "not the parameters of mp.slices[0], in its order")
        for i, (p, p0) in enumerate(zip(s["params"], first)):
            f = f"mp.slices[{k}].params[{i}]"
            if tuple(p["shape"]) != want[p["name"]]:
                c.fail(f"{f}.shape", f"{p['shape']}, but {p['name']!r} cut in {n} gives "
                       f"{list(want[p['name']])}")  # fmt: skip
            for key in ("group", "step", "frozen", "dtype"):
                if p.get(key) != p0.get(key):
                    c.fail(f"{f}.{key}", f"{p.get(key)!r}, slice 0 has {p0.get(key)!r}")
        listed = [
            x for key in ("units", "frozen_units") for u in s.get(key, []) for x in u["files"]
        ]
        for name in listed + s["rng"]["files"]:
            if owner.setdefault(name, k) != k:
                c.fail(f"mp.slices[{k}]", f"file {name!r} is also slice {owner[name]}'s")
