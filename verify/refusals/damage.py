"""The refusals section's damaged checkpoints: one row per rule a reader must enforce.

verify/refusals/ranks.py saves two real checkpoints: "plain" (the MLP of verify.cells.cell with its
middle layer frozen, Adam in two groups, one step, N = 1: units[0] is the root unit of
layers.2, units[1] is layers.0, frozen_units[0] is layers.1) and "mp" (a tensor-parallel GPT of
two slices, N_d = 1). Each row copies one of them, damages the copy in one way, and reads it
with zero.checkpoint.verify (or consolidate); the read must raise a CheckpointError whose
message says the row's text: the manifest's field and what is wrong with it, or the file.
Manifest edits are re-checksummed (a deliberate edit, not an accident:
verify.checkpoints.resume._rechecksum; one row edits without, for the checksum itself), so each
reaches the
rule it targets in zero/checkpoint/validate.py, format.py, mpformat.py or mpjoin.py. A few rows
instead ask consolidate_to for an output path it cannot write (a ValueError naming `out`). The
texts are the rows' own statements of what a clear refusal says, written from the saved model's
known layout, never read from the library. verify/checkpoints/resume.py's damages (a flipped byte,
a short
shard, a symlink, a FIFO, three edits, `latest` outside the root) run on every resume row; these
run once per verify run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from zero.checkpoint import CheckpointError, consolidate, verify

from ..checkpoints.resume import _rechecksum
from .rows import Refusal

PLAIN, MP = "plain", "mp"  # as verify/refusals/ranks.py names them


def _step(root: Path) -> Path:
    return sorted(root.glob("step-*"))[-1]


def refused(source: Path, damage: Callable[[Path, Path], Path | None], read) -> Callable:
    """make() of a row: copy source's step directory into a fresh root, damage(root, step)
    (returns the path to read, or None: the root), then read it."""

    def make():
        with tempfile.TemporaryDirectory(prefix="zero-damaged-") as tmp:
            root, step = Path(tmp), _step(source)
            shutil.copytree(step, root / step.name, symlinks=True)
            (root / "latest").write_text(step.name)
            read(damage(root, root / step.name) or root)

    return make


def manifest(edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    """A damage: edit the manifest in place, then give it a valid checksum again."""

    def damage(root: Path, step: Path) -> None:
        f = step / "manifest.json"
        m = json.loads(f.read_text())
        edit(m)
        f.write_text(json.dumps(_rechecksum(m)))

    return damage


def setter(*path_and_value):
    """edit(m): m[k1][k2]...[kn] = value (path_and_value = (k1, ..., kn, value))."""
    *path, value = path_and_value

    def edit(m: dict) -> None:
        for k in path[:-1]:
            m = m[k]
        m[path[-1]] = value

    return edit


def _rename_file(old: str, new: str):
    def edit(m: dict) -> None:
        m["files"][new] = m["files"].pop(old)

    return edit


def _rename_entry(file: str, old: str, new: str):
    def edit(m: dict) -> None:
        entries = m["files"][file]["entries"]
        entries[new] = entries.pop(old)

    return edit


def _extra_param(m: dict) -> None:
    m["params"].append({**m["params"][5], "name": "layers.3.bias", "aliases": ["layers.3.bias"]})


U0, U1 = "files['u0000-r0000.bin']", "u0001-r0000.bin"
PLAIN_EDITS = [  # (what, edit, the text the refusal must say)
    ("world_size 0", setter("world_size", 0), "world_size: 0 is not an integer >= 1"),
    ("stage 5", setter("stage", 5), "stage: 5, expected 0, 1, 2 or 3"),
    ("config a list", setter("config", ["adam"]), "config: list ['adam'], expected a dict"),
    ("chunk 100", setter("config", "chunk", 100), "config.chunk: 100, expected a power of two"),
    ("a group without eps", lambda m: m["config"]["groups"][0].pop("eps"),
     "config.groups[0]: not a parameter group's hyper-parameters (missing ['eps'])"),
    ("no groups", setter("config", "groups", []),
     "config.groups: empty: at least one parameter group"),
    ("a scaler of unknown fields", setter("scaler", {"bogus": 1.0}),
     "scaler: not a loss scaler's state"),
    ("a file name with a path", _rename_file("u0000-r0000.bin", "../u0000-r0000.bin"),
     "files['../u0000-r0000.bin']: not a plain file name inside the step directory"),
    ("a sha256 that is no digest", setter("files", "u0000-r0000.bin", "sha256", "xyz"),
     f"{U0}.sha256: 'xyz' is not a sha256 hex digest"),
    ("an entry of two fields", setter("files", "u0000-r0000.bin", "entries", "master", [0, 384]),
     f"{U0}.entries['master']: [0, 384], expected [offset, numel, dtype, shape]"),
    ("an unknown dtype", setter("files", "u0000-r0000.bin", "entries", "master", 2, "float8"),
     f"{U0}.entries['master']: unknown dtype 'float8'"),
    ("a shape that is not its numel",
     setter("files", "u0000-r0000.bin", "entries", "master", 3, [383]),
     f"{U0}.entries['master']: shape [383] has 383 elements, numel says 384"),
    ("an entry beyond its file",
     setter("files", "u0000-r0000.bin", "entries", "exp_avg_sq", 0, 4000),
     f"{U0}.entries['exp_avg_sq']: bytes [4000, 5536) lie beyond the file's 4608 bytes"),
    ("a gap between entries", setter("files", "u0000-r0000.bin", "entries", "exp_avg", 0, 1540),
     f"{U0}.entries['exp_avg']: starts at byte 1540, expected 1536"),
    ("bytes after the entries", setter("files", "u0000-r0000.bin", "bytes", 4612),
     f"{U0}.bytes: 4612, but its entries end at byte 4608"),
    ("a parameter named twice", setter("params", 1, "name", "layers.0.weight"),
     "params[1].name: 'layers.0.weight' appears twice"),
    ("a parameter's unknown dtype", setter("params", 0, "dtype", "float8"),
     "params[0].dtype: unknown dtype 'float8'"),
    ("frozen a string", setter("params", 0, "frozen", "yes"),
     "params[0].frozen: 'yes', expected true or false"),
    ("a frozen parameter in a group", setter("params", 2, "group", 0),
     "params[2]: a frozen parameter has no group and no step count"),
    ("a group beyond the groups", setter("params", 0, "group", 5),
     "params[0].group: 5, expected 0..1"),
    ("more steps than t", setter("params", 0, "step", 7),
     "params[0].step: 7, more optimizer steps than t = 1"),
    ("a unit beyond the units", setter("params", 0, "unit", 9), "params[0].unit: 9, expected 0..1"),
    ("a unit listing another's parameter",
     setter("units", 0, "params", ["layers.2.weight", "layers.0.bias"]),
     "units[0].params: 'layers.0.bias' is not a parameter of this unit in params"),
    ("an offset off the layout", setter("params", 5, "offset", 320),
     "params[5] ('layers.2.bias'): offset 320, but the unit's parameters' shapes lay it out "
     "at 256"),
    ("a parameter in no unit", _extra_param,
     "params[6].unit: 'layers.3.bias' is not in units[0].params"),
    ("a frozen unit's unknown dtype", setter("frozen_units", 0, "dtype", "float8"),
     "frozen_units[0].dtype: unknown dtype 'float8'"),
    ("a frozen unit without files", setter("frozen_units", 0, "files", []),
     "frozen_units[0].files: 0 files, world_size is 1"),
    ("a frozen unit's dtype not its file's", setter("frozen_units", 0, "dtype", "bfloat16"),
     "files['f0000-r0000.bin'].entries['frozen']: [0, 2432, 'float32', [2432]], expected 2432 "
     "bfloat16 elements (frozen unit 0's shard)"),
    ("a frozen unit's file a list", setter("frozen_units", 0, "files", [["f0000-r0000.bin"]]),
     "malformed (TypeError: "),
    ("a unit without files", setter("units", 0, "files", []),
     "units[0].files: 0 files, world_size is 1"),
    ("a unit's file not listed", setter("units", 0, "files", ["absent.bin"]),
     "units[0].files: 'absent.bin' is not listed in files"),
    ("a unit's state not in its file", _rename_entry("u0000-r0000.bin", "exp_avg", "exp_avgx"),
     "files['u0000-r0000.bin'].entries['exp_avg']: None, expected 384 float32 elements "
     "(unit 0's shard)"),
    ("no RNG file", setter("rng", "files", []), "rng.files: []: expected 1 files listed in files"),
    ("a state-dict key of one field", setter("state_dict_keys", 0, ["a"]),
     "state_dict_keys[0]: ['a'], expected [key, source]"),
    ("a state-dict key of no source", setter("state_dict_keys", 0, ["layers.0.weight", "nope"]),
     "state_dict_keys[0]: source 'nope' is neither a parameter in params nor a buffer in "
     "r0000.bin"),
    ("a state-dict key not the source's", setter("state_dict_keys", 0, ["x", "layers.0.weight"]),
     "state_dict_keys[0]: key 'x' is not a name of 'layers.0.weight'"),
]  # fmt: skip
FORMAT_EDITS = [  # read_manifest's own checks, before validate.py's
    ("another format", setter("format", "other"), "manifest.json: not a zero-checkpoint manifest"),
    ("a newer format version", setter("format_version", 99),
     "manifest.json: format_version 99 is newer than this code reads"),
    ("another byte order", setter("byteorder", "big"),
     "manifest.json: byteorder: saved on a big-endian machine"),
]  # fmt: skip
GAP = "units[0]: state 'master' is not zero in [257, 384), outside every parameter"
"""A bias of 4 recorded as 1 (its slot still inside the layout): only the saved values show it."""


def _not_json(root: Path, step: Path) -> Path:
    """The step directory read directly (it holds a manifest), which is not JSON."""
    (step / "manifest.json").write_text("{")
    return step


def _pointer(text: str, make=None):
    """A damage: `latest` says `text`; make(root) first creates what it names."""

    def damage(root: Path, step: Path) -> None:
        if make is not None:
            make(root / "step-00000099")
        (root / "latest").write_text(text)

    return damage


def _gone(root: Path, step: Path) -> Path:
    return root / "absent"


def _empty(root: Path, step: Path) -> Path:
    (root / "empty").mkdir()
    return root / "empty"


def _no_shard(root: Path, step: Path) -> None:
    (step / U1).unlink()


def _socket(root: Path, step: Path) -> None:
    """The shard replaced by a UNIX socket: opening one fails (ENXIO); no read may block."""
    (step / U1).unlink()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(step / U1))


def _unchecksummed(root: Path, step: Path) -> None:
    """An edit without a new checksum: an accident (or a careless edit) the checksum catches."""
    f = step / "manifest.json"
    f.write_text(f.read_text().replace('"world_size": 1', '"world_size": 2', 1))


FILE_DAMAGES = [  # (what, damage, the text the refusal must say)
    ("a manifest edited, not re-checksummed", _unchecksummed,
     "manifest.json: checksum mismatch (sha256 of its contents"),
    ("no directory there", _gone, "absent: no such directory (no checkpoint there)"),
    ("an empty directory", _empty,
     "empty: neither a step directory (no manifest.json) nor a checkpoint root (no latest)"),
    ("latest naming a missing step", _pointer("step-00000099"),
     "step-00000099, which does not exist"),
    ("latest naming a file", _pointer("step-00000099", lambda p: p.write_text("x")),
     "step-00000099, which is not a regular file, not a step directory"),
    ("latest naming a step without manifest", _pointer("step-00000099", Path.mkdir),
     "step-00000099, which has no manifest.json"),
    ("latest longer than a pointer", _pointer("step-00000001" + " " * 5000),
     "latest: 5013 bytes, more than the 4096 allowed"),
    ("a manifest that is not JSON", _not_json, "manifest.json: not valid JSON"),
    ("a shard removed", _no_shard,
     f"{U1} (the manifest lists it: 10752 bytes)"),
    ("a shard replaced by a socket", _socket, f"{U1}: cannot be opened"),
]  # fmt: skip


def _consolidate_to(out: str):
    """read(root): consolidate_to(root, root / out), `out` a path relative to the root."""

    def read(root: Path):
        from zero.checkpoint import consolidate_to

        consolidate_to(root, f"{root}/{out}")

    return read


def _touch(name: str):
    def damage(root: Path, step: Path) -> None:
        (root / name).write_text("a file")

    return damage


def _nothing(root: Path, step: Path) -> None:
    return None


OUTS = [  # (what, damage, consolidate_to's out relative to the root, what its ValueError says)
    ("out a directory", _nothing, ".", "/.': is a directory; allowed is a file path in an"),
    ("out naming no file", _nothing, "model/", "/model/': names no file"),
    ("out in no folder", _nothing, "absent/model.pt", "/absent' does not exist"),
    ("out in a file", _touch("plain.txt"), "plain.txt/model.pt", "/plain.txt' is not a folder"),
]  # fmt: skip


def _params_of(m: dict, k: int) -> list:
    return m["mp"]["slices"][k]["params"]


def _swap_first(m: dict) -> None:
    p = _params_of(m, 1)
    p[0], p[1] = p[1], p[0]


def _replicated_differs(root: Path, step: Path) -> None:
    """Slice 1's master of a replicated parameter (wpe, unit 0 at offset 512) changed, its file
    and the manifest re-checksummed: each slice is valid alone, the two disagree."""
    f = step / "m0001-u0000-r0000.bin"
    m = json.loads((step / "manifest.json").read_text())
    at = m["files"][f.name]["entries"]["master"][0] + 4 * 512
    data = bytearray(f.read_bytes())
    data[at : at + 4] = struct.pack("<f", struct.unpack("<f", data[at : at + 4])[0] + 1.0)
    f.write_bytes(bytes(data))
    m["files"][f.name]["sha256"] = hashlib.sha256(data).hexdigest()
    (step / "manifest.json").write_text(json.dumps(_rechecksum(m)))


WTE = "mp.splits['transformer.wte.weight']"
MP_EDITS = [  # (what, edit, the text the refusal must say), on the two-slice checkpoint
    ("an mp section in format 2", setter("format_version", 2),
     "format_version: 2, but an 'mp' section needs >= 3"),
    ("more slices claimed", setter("mp", "size", 3), "mp.slices: 2 slices, mp.size is 3"),
    ("a slice's field at the top", lambda m: m.update(rng=m["mp"]["slices"][0]["rng"]),
     "rng: at the top of a model-parallel manifest; it belongs in mp.slices[m]"),
    ("a slice invalid alone", setter("mp", "slices", 1, "params", 0, "unit", 9),
     "mp.slices[1].params[0].unit: 9, expected 0..2"),
    ("a split missing", lambda m: m["mp"]["splits"].pop("transformer.wpe.weight"),
     "mp.splits: its parameters are not those of mp.slices[0].params"),
    ("an unknown split rule", setter("mp", "splits", "transformer.wte.weight", "rule", "diag"),
     f"{WTE}: rule 'diag', dim 0: expected one of"),
    ("a whole shape that cannot be cut", setter("mp", "splits", "transformer.wte.weight",
                                                "shape", []),
     f"{WTE}.shape: shape () cannot be cut in 2 by rule 'rows'"),
    ("slices listing parameters in another order", _swap_first,
     "mp.slices[1].params: not the parameters of mp.slices[0], in its order"),
    ("a whole shape not the slices'", setter("mp", "splits", "transformer.wte.weight", "shape",
                                            [128, 16]),
     "mp.slices[0].params[0].shape: [32, 16], but 'transformer.wte.weight' cut in 2 gives "
     "[64, 16]"),
    ("slices disagreeing on a step count", lambda m: _params_of(m, 1)[0].pop("step"),
     "mp.slices[1].params[0].step: None, slice 0 has 0"),
    ("a file of two slices", setter("mp", "slices", 1, "rng", "files", ["m0000-r0000.bin"]),
     "mp.slices[1]: file 'm0000-r0000.bin' is also slice 0's"),
]  # fmt: skip


def damage_rows(directory) -> list[Refusal]:
    """Every damage of the plain and the model-parallel checkpoint under `directory`."""
    plain, mp = Path(directory) / PLAIN, Path(directory) / MP

    def row(module, what, source, damage, says, read=verify, error=CheckpointError):
        return Refusal(f"{module}: {what}", module, refused(source, damage, read), error, says)

    rows = [row("checkpoint/validate", w, plain, manifest(e), s) for w, e, s in PLAIN_EDITS]
    shorter = manifest(setter("params", 5, "shape", [1]))
    rows += [
        row("checkpoint/validate", "a shape edited within its alignment", plain, shorter, GAP),
        row("checkpoint/consolidate", "a shape edited within its alignment", plain, shorter, GAP,
            consolidate),
    ]  # fmt: skip
    rows += [row("checkpoint/format", w, plain, manifest(e), s) for w, e, s in FORMAT_EDITS]
    rows += [row("checkpoint/consolidate", w, plain, d, s, _consolidate_to(out), ValueError)
             for w, d, out, s in OUTS]  # fmt: skip
    rows += [row("checkpoint/format", w, plain, d, s) for w, d, s in FILE_DAMAGES]
    rows += [row("checkpoint/mpformat", w, mp, manifest(e), s) for w, e, s in MP_EDITS]
    rows.append(
        row("checkpoint/mpjoin", "a replicated parameter differing between slices", mp,
            _replicated_differs, "replicated parameter 'transformer.wpe.weight' (master) "
            "differs between the MP slices", consolidate)
    )  # fmt: skip
    return rows
