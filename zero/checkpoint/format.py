"""The on-disk format: names, the manifest, durable writes, verified reads, rank agreement.

Legend: N1 the world size a checkpoint was saved at; L1 its shard length; a unit's padded
buffer has N·L elements. On disk, ROOT holds step directories and one pointer:
    ROOT/latest                       name of the newest committed step directory
    ROOT/step-00000012/manifest.json  what is where and every file's sha256: the commit record
    ROOT/step-00000012/u0003-r0001.bin  rank 1's shard of unit 3 at N1: the padded buffer's
                                      elements [L1, 2·L1) of the fp32 master, then of each
                                      optimizer state, raw little-endian
    ROOT/step-00000012/r0001.bin      rank 1's RNG state (rank 0's file also holds the buffers)
    ROOT/step-00000012/f0000-r0001.bin  rank 1's shard of frozen buffer 0 (zero/build.py) at N1:
                                      [L1, 2·L1) of the padded buffer, in the compute dtype
    ROOT/step-00000012/owner.json     the run that made it (format 2; [Note: run identity])
Every rank writes the same thing at every stage: its slice r of each unit, taken from the whole
master where the stage keeps it whole (stage 0, persistent stage-3 units). The working copy is
not saved: it is the master rounded to the compute dtype, which is how the engine makes it.
Frozen parameters have no master: their values are saved as held (the compute dtype), each
rank its slice r; the manifest lists them under "frozen_units" and marks them in "params"
("frozen": true, no group, no step count). Format version 2 (code that reads only 1 refuses
it); a model-parallel engine's checkpoint is format 3, N_m such checkpoints of its slices in one
step directory under one manifest ([Note: MP checkpoint layout] in zero/checkpoint/mpformat.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..ranks.watchdog import broadcast_object, gather_objects
from .mpformat import validate_mp, views
from .validate import Invalid, check_gaps, validate_manifest

FORMAT = "zero-checkpoint"
FORMAT_VERSION = 3
"""1: the first format. 2 adds each trainable parameter's own optimizer step count
(params[i]["step"], reference/step.py's [Note: unused parameters]), frozen parameters (see the
module docstring), run_id in the manifest and owner.json in a step directory. All additive: a
version-1 checkpoint loads with every count equal to t (what the engine that wrote it did), has
no frozen parameters, and is never pruned (it has no run_id). 3 adds the "mp" section of a
model-parallel engine's checkpoint (zero/checkpoint/mpformat.py); a plain engine writes 2."""
MANIFEST = "manifest.json"
LATEST = "latest"
OWNER = "owner.json"
STEP_DIR = re.compile(r"step-\d{8,}(-\d+)?")
POINTER_LIMIT = 4096
"""The most bytes `latest` may hold (one step directory's name)."""


def notify_written(path: Path) -> None:
    """Fault injection for tests: zero.checkpoint._after_write (set on the package, None
    outside tests) is called with each path right after it is durably written (shard files,
    the manifest) and with ROOT/latest after the switch."""
    hook = sys.modules[__package__]._after_write
    if hook is not None:
        hook(path)


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete, corrupt, of a newer format, or a rank failed."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What load() restored."""

    directory: Path  # the step directory read
    data_step: int  # the data position: the next step to run (train_steps' start_step)
    t: int  # optimizer steps taken
    steps: dict  # parameter name -> its own optimizer steps (t for every one before version 2)
    world_size: int  # N1 (N_d, the data-parallel degree, for a model-parallel checkpoint)
    stage: int  # the stage it was saved at
    extra: object  # the JSON value passed to save(extra=...)
    mp: int = 1  # N_m, the model-parallel degree it was saved at (1: a plain engine)


# -- small I/O helpers ---------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(f, chunk) -> None:
    """One chunk into an open file. A function of its own so that a test can make it fail as a
    full disk would (tests/distributed/test_checkpoint_safety.py)."""
    f.write(chunk)


def _write_durably(path: Path, chunks) -> tuple[str, int]:
    """Write chunks (buffers) to path via a temp file, fsync, rename; returns (sha256, bytes).

    The temp file is made by mkstemp in the target directory: a random name, created
    exclusively (O_CREAT | O_EXCL | O_NOFOLLOW), so a planted file or link is never written
    through; os.replace then swaps the name itself (a link at `path` is replaced, not followed).
    On any failure the temp file is removed: a failed write leaves nothing behind.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes 0600; others may read checkpoints
            for chunk in chunks:
                _write_all(f, chunk)
                digest.update(chunk)
                size += memoryview(chunk).nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            # a full disk (ENOSPC, EFBIG) says only "No space left on device": name the file,
            # so that the error tells which file system is full
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    return digest.hexdigest(), size


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path, *, size: int | None = None, limit: int | None = None) -> bytearray:
    """The bytes of a regular file, exactly `size` of them (a file of another size is refused
    before any byte is read) or at most `limit`. Never through a symbolic link, never blocking
    on a FIFO or a device: opened O_NOFOLLOW | O_NONBLOCK, then fstat'ed. FileNotFoundError
    passes through; anything else is a CheckpointError naming the file."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(
                f"{path}: a symbolic link; only regular files inside the checkpoint are read"
            ) from None
        raise CheckpointError(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{path}: {_kind(st.st_mode)}, not a regular file; only regular files inside "
                "the checkpoint are read"
            )
        if size is not None and st.st_size != size:
            raise CheckpointError(
                f"{path}: {st.st_size} bytes on disk, the manifest records {size} bytes"
            )
        if limit is not None and st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than the {limit} allowed")
        n = st.st_size if size is None else size
        data = bytearray(n)
        view, got = memoryview(data), 0
        while got < n:
            k = os.readv(fd, [view[got:]])
            if not k:
                raise CheckpointError(f"{path}: ended after {got} of {n} bytes")
            got += k
    finally:
        os.close(fd)
    return data


def _raw(t: torch.Tensor):
    """A tensor's bytes as a NumPy buffer (no copy on CPU), whatever its dtype."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _tensor_file(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """tensors written back to back; returns the file's manifest entry."""
    entries, offset, chunks = {}, 0, []
    for key, t in tensors:
        buf = _raw(t)
        entries[key] = [offset, t.numel(), str(t.dtype).removeprefix("torch."), list(t.shape)]
        offset += buf.nbytes
        chunks.append(buf)
    sha, size = _write_durably(path, chunks)
    notify_written(path)
    return {"sha256": sha, "bytes": size, "entries": entries}


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# -- collectives among ranks (control only, outside the engine's traffic counter) -------------


def scope(engine) -> tuple[object, int, int]:
    """(group, size, rank) of the ranks that save or load one checkpoint together: the engine's
    group, or for a model-parallel engine the whole world, which is its mesh, every (d, m) at
    rank d·N_m + m (zero/checkpoint/mpjoin.py checks it): rank 0 = (0, 0) commits."""
    if getattr(engine, "mp", None) is None:
        return engine.group, engine.world_size, engine.rank
    return dist.group.WORLD, dist.get_world_size(), dist.get_rank()


def _all_gather(engine, obj) -> list:
    group, size, _ = scope(engine)
    if size == 1:
        return [obj]
    return gather_objects(obj, group)  # a failure names whom to blame (zero/ranks/watchdog.py)


def _broadcast(engine, obj):
    group, size, _ = scope(engine)
    if size == 1:
        return obj
    return broadcast_object(obj, group)


def _agree(engine, error: BaseException | None, what: str, on_failure=None) -> None:
    """Every rank learns whether some rank failed, so that none is left waiting in a later
    collective: the failing rank re-raises its own error, the others name it. If any rank
    failed, on_failure() runs first on every rank (after the exchange, so every rank has stopped
    writing), and a second exchange makes every rank wait for it."""
    every = _all_gather(engine, None if error is None else f"{type(error).__name__}: {error}")
    if on_failure is not None and any(msg is not None for msg in every):
        on_failure()
        _all_gather(engine, None)  # the cleanup is done before any rank raises (and a
        # launcher, seeing one rank fail, kills the others)
    if error is not None:
        raise error
    for r, msg in enumerate(every):
        if msg is not None:
            raise CheckpointError(f"{what} failed on rank {r}: {msg}")


def _check_idle(engine, what: str) -> None:
    if engine.microstep != 0:
        raise RuntimeError(
            f"{what} after {engine.microstep} micro-steps of an unfinished step on rank "
            f"{engine.rank}: save and load only between steps"
        )
    if engine.fake:
        raise RuntimeError(f"{what} on a simulated rank (fake process group): values are void")


# -- reading -------------------------------------------------------------------------------------


def resolve(directory) -> Path:
    """The step directory to read: `directory` itself if it holds a manifest, else the one its
    `latest` pointer names, which must be a step directory inside it (a plain name such as
    step-00000012, a real directory, holding a manifest). Raises CheckpointError naming the
    directory and what is missing or wrong."""
    d = Path(directory)
    if os.path.lexists(d / MANIFEST):
        return d
    pointer = d / LATEST
    if not os.path.lexists(pointer):
        if not d.is_dir():
            raise CheckpointError(f"{d}: no such directory (no checkpoint there)")
        raise CheckpointError(
            f"{d}: neither a step directory (no {MANIFEST}) nor a checkpoint root (no {LATEST})"
        )
    try:
        text = read_regular(pointer, limit=POINTER_LIMIT)
    except FileNotFoundError:
        raise CheckpointError(f"{pointer}: vanished while being read") from None
    name = text.decode("utf-8", errors="replace").strip()
    if not STEP_DIR.fullmatch(name):
        raise CheckpointError(
            f"{pointer} names {name[:100]!r}, which is not a step directory inside {d} "
            "(expected a name such as step-00000012)"
        )
    step_dir = d / name
    try:
        mode = os.lstat(step_dir).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{pointer} names {step_dir}, which does not exist") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointError(
            f"{pointer} names {step_dir}, which is {_kind(mode)}, not a step directory"
        )
    if not os.path.lexists(step_dir / MANIFEST):
        raise CheckpointError(f"{pointer} names {step_dir}, which has no {MANIFEST}")
    return step_dir


def read_manifest(step_dir: Path) -> dict:
    """The manifest, checked: a regular file, our format, a version we read, its own checksum,
    and consistent with itself (zero/checkpoint/validate.py), so that nothing it describes is
    read out of bounds or with a wrong shape, dtype or optimizer state."""
    path = Path(step_dir) / MANIFEST
    try:
        m = json.loads(read_regular(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the save did not complete)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    version = m.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version!r} is newer than this code reads (up to "
            f"{FORMAT_VERSION}); load it with the version of zero that wrote it, or a newer one"
        )
    body = {k: v for k, v in m.items() if k != "checksum"}
    got = hashlib.sha256(_canonical(body)).hexdigest()
    if got != m.get("checksum"):
        raise CheckpointError(
            f"{path}: checksum mismatch (sha256 of its contents {got}, "
            f"recorded {m.get('checksum')})"
        )
    if m.get("byteorder") != sys.byteorder:
        raise CheckpointError(f"{path}: byteorder: saved on a {m.get('byteorder')}-endian machine")
    try:
        (validate_mp if "mp" in m else validate_manifest)(path, m)
    except Invalid as exc:
        raise CheckpointError(str(exc)) from None
    except (TypeError, KeyError, AttributeError, ValueError) as exc:  # a shape no check foresaw
        raise CheckpointError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None
    return m


def saved_steps(m: dict) -> dict[str, int]:
    """Each parameter's optimizer step count t_p from a manifest; before format version 2
    every parameter had taken all t steps (the slices of a model-parallel checkpoint agree on
    them: zero/checkpoint/mpformat.py checks it)."""
    params = views(m)[0]["params"]
    return {p["name"]: int(p.get("step", m["t"])) for p in params if not p.get("frozen")}


def read_manifest_quietly(step_dir: Path) -> dict | None:
    """The manifest if it reads and validates, else None (for pruning and numbering, which
    leave alone whatever they cannot read)."""
    try:
        return read_manifest(step_dir)
    except (CheckpointError, OSError):
        return None


class _Reader:
    """The files of one step directory: each verified against its sha256 on first read, and
    ranges of a unit's saved padded buffer sliced out of them."""

    def __init__(self, step_dir: Path, manifest: dict):
        self.dir, self.m, self.cache = Path(step_dir), manifest, {}

    def file(self, name: str) -> bytearray:
        if name not in self.cache:
            info = self.m["files"].get(name)
            path = self.dir / name
            if info is None:
                raise CheckpointError(f"{path}: not listed in {self.dir / MANIFEST}")
            try:  # a regular file of exactly the recorded size, or nothing is read
                data = read_regular(path, size=info["bytes"])
            except FileNotFoundError:
                raise CheckpointError(
                    f"missing shard file {path} (the manifest lists it: {info['bytes']} bytes)"
                ) from None
            got = hashlib.sha256(data).hexdigest()
            if len(data) != info["bytes"] or got != info["sha256"]:
                raise CheckpointError(
                    f"checksum mismatch in {path}: sha256 {got} ({len(data)} bytes), the "
                    f"manifest records {info['sha256']} ({info['bytes']} bytes)"
                )
            self.cache[name] = data
        return self.cache[name]

    def tensor(self, name: str, key: str) -> torch.Tensor:
        data = self.file(name)
        entry = self.m["files"][name]["entries"].get(key)
        if entry is None:
            raise CheckpointError(f"{self.dir / MANIFEST}: files[{name!r}] has no entry {key!r}")
        offset, numel, dtype, shape = entry
        dt = getattr(torch, dtype)
        if numel == 0:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(data, dtype=dt, count=numel, offset=offset).view(shape)

    def range(self, unit: int, key: str, start: int, stop: int, frozen=False) -> torch.Tensor:
        """Elements [start, stop) of a saved unit's padded buffer of state `key`, in fp32 (a
        frozen buffer, frozen=True, is stored in the compute dtype: the upcast is exact)."""
        spec = self.m["frozen_units" if frozen else "units"][unit]
        L = spec["shard_numel"]
        out = torch.zeros(stop - start)
        pos = start
        while pos < stop:
            k, end = pos // L, min(stop, (pos // L + 1) * L)
            name = spec["files"][k]  # slots lie inside the layout, so k < N1 always
            buf = self.file(name)
            offset, _, dtype, _ = self.m["files"][name]["entries"][key]
            dt = getattr(torch, dtype)
            at = offset + dt.itemsize * (pos - k * L)
            out[pos - start : end - start] = torch.frombuffer(
                buf, dtype=dt, count=end - pos, offset=at
            ).float()
            pos = end
        return out

    def drop(self) -> None:
        self.cache.clear()


def verify(directory) -> dict:
    """Check a checkpoint without loading it: the manifest, every file against its sha256, and
    zeros outside every parameter (validate.py's check_gaps). Returns the manifest; raises
    CheckpointError naming the first bad file or field."""
    step_dir = resolve(directory)
    m = read_manifest(step_dir)
    done: set[str] = set()
    for view in views(m):  # each slice of a model-parallel checkpoint (zero/checkpoint/mpformat.py)
        reader = _Reader(step_dir, view)
        for u, spec in enumerate(view["units"]):  # a unit's files at a time: checksums, gaps
            for name in spec["files"]:  # every file, not only those check_gaps happens to read
                reader.file(name)
            try:
                check_gaps(reader, u)
            except Invalid as exc:
                raise CheckpointError(str(exc)) from None
            done.update(spec["files"])
            reader.drop()
    check_files(step_dir, m, skip=done)
    return m


def check_files(step_dir, m: dict, *, skip=()) -> None:
    """Read every file the manifest lists but those in `skip` (already checked), each against
    its size and sha256, one at a time: the RNG and buffer files (r*.bin) and frozen shards
    included, which a reader of the parameters alone never opens. Raises CheckpointError naming
    the first bad file."""
    reader = _Reader(step_dir, m)
    for name in sorted(set(m["files"]) - set(skip)):
        reader.file(name)
        reader.drop()
