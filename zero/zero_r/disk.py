"""ZeRO-Infinity's disk tier: the fp32 master and the optimizer states in files, not host memory.

Legend: Ψ parameters, N ranks, K the optimizer-state multiplier (docs/design.md §2), "extent" the
elements of a unit's padded flat buffer whose update this rank owns (zero/zero_r/offload.py).

With ZeroConfig.offload_dir the host side of ZeRO-Offload keeps everything but the master and
the optimizer states where it was (the reduced gradient of the extent and the compute-dtype
staging stay in host memory); each unit's master and each of its states is one file of
4·extent bytes under a directory of this engine's own, memory-mapped, so that every tensor the
update, the checkpoints and verification read is an ordinary float32 tensor and no code path
changes: the bits are those of host offload by construction. Per step and unit, around its
update (`streamed`):
    before   the unit's files are checked (present, their size) and the next unit's are asked
             to be read ahead (madvise WILLNEED: the kernel reads while this unit updates)
    after    a writer thread writes the unit's pages back (fsync), drops them from the page
             cache (posix_fadvise DONTNEED) and from this process's mapping (madvise DONTNEED)
so that host memory holds the pages of the unit being updated, the one being read ahead and
the ones being written back: a few units, not (K+1)·4Ψ/N bytes. Disk bytes per step and rank
(kind 'disk' in the engine's CommCounter, one record per unit and way): read and write
(K+1)·4 bytes per extent element, the analytic traffic `python -m measure.largest` sets beside
the process's own I/O counters and the disk's measured bandwidth.

Files are allocated in full at construction (posix_fallocate), so a full disk is an error there
and never a fault in the middle of a step: before the first file, this rank's bytes (disk_bytes)
are compared with the free bytes of offload_dir, and a shortfall is refused (ValueError: one line
naming offload_dir, the bytes needed and the bytes free) with nothing written; an allocation that
fails all the same (another process took the space, a quota, a file size limit) is refused in
one line naming offload_dir and the bytes needed, and the rank's folder is removed. A state file
removed or resized from outside is refused by name before its unit's next update. The folder
holds its owner's record (owner.json, zero/common/owner.py) and goes with the engine, or with the
process on every exit it runs itself ([Note: a folder's last exit]); the folders of processes
killed outright are removed by the next engine made over the same offload_dir ([Note: stale
state folders]). docs/zero_r.md, "Tiers", has the bytes per parameter of each tier.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from reference.optim import state_names

from ..common import owner
from ..unit import FlatUnit
from .offload import HostOffload

PREFIX = "zero-states-"
"""Each engine's folder in offload_dir: PREFIX + pid + a random part (tempfile.mkdtemp)."""
OWNER = "owner.json"
"""Its owner's record (zero/common/owner.py identity(), and `started`), written before any file."""
UNKNOWN_AFTER_S = 600.0
"""A folder without a record this old is named at start (a process killed while making it, or
another program's); younger, it may be one a concurrent rank is making: not even named."""
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""An allocation refused for want of room: the disk, a quota, a file size limit."""


def check_offload_dir(path, offload_optimizer) -> None:
    """ZeroConfig.offload_dir: a path to an existing, writable directory, with
    offload_optimizer=True (the disk tier holds the offloaded states)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"offload_dir={path!r}: must be None or a directory path")
    if offload_optimizer is not True:
        raise ValueError(
            f"offload_dir={str(path)!r}: the disk tier holds the offloaded optimizer states; "
            "allowed with offload_optimizer=True"
        )
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"offload_dir={str(path)!r}: not an existing, writable directory")


def disk_bytes(config, parts, stages) -> int:
    """Bytes of this rank's state files: for each unit, (1 + the optimizer states its parameter
    groups keep) x 4 x its extent (stages[i] is unit i's stage class, whose extent is known from
    the partition), the files DiskOffload._states makes."""
    total = 0
    for part, stage in zip(parts, stages, strict=True):
        extent = stage.extent(part)
        names = {
            x for g in set(part.groups) for x in state_names(config.optimizer, config.groups[g])
        }
        total += (1 + len(names)) * 4 * (extent.stop - extent.start)
    return total


def _size(n: int) -> str:
    return f"{n:,} bytes" + (f" ({n / 1e9:.1f} GB)" if n >= 10**8 else "")


def check_space(directory: Path, needed: int) -> None:
    """Refuse (ValueError) an offload_dir with fewer free bytes than `needed`, before any file."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return  # no answer: the allocation will tell
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise ValueError(
            f"offload_dir={str(directory)!r}: this rank's master and optimizer states need "
            f"{_size(needed)} there and {_size(free)} are free; give a folder on a disk with "
            "room for them, or free space (nothing was written)"
        )


# [Note: stale state folders] A process killed outright (SIGKILL, an OOM kill, a killed job)
# leaves its folder (30 GB at 2.54B parameters). Each DiskOffload, before it makes its own,
# looks at every PREFIX folder in offload_dir and removes one whose record says that its owner
# ran on this host and runs no more (owner.is_dead_here: the pid gone, or reused by another
# process, or another boot), with one line on stderr: `note: ...` naming the folder, the owner's
# pid and the bytes freed. A live owner's folder, another host's (its pids cannot be checked
# from here) and one without a readable record are never touched: a record is written whole
# (renamed into place) before any state file, so a folder without one holds no state, or is
# being made right now by a concurrent rank. Record-less folders older than UNKNOWN_AFTER_S are
# named and left to the user. Ranks starting together over one offload_dir each rename a dead
# owner's folder to a name of their own before removing it: one of them gets it, the others
# find it gone; a remover's own folder name says who removes it, so a live remover is left be.


def clear_stale(directory: Path, say=None) -> None:
    """Remove the folders in `directory` of owners dead on this host ([Note: stale state
    folders]); every removal, and every old folder without a record, is one line to say()
    (stderr by default)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    where = f"offload_dir={str(directory)!r}"
    for d in sorted(directory.glob(f"{PREFIX}*")):
        if d.is_symlink() or not d.is_dir() or not os.access(d, os.R_OK | os.X_OK):
            continue  # not a folder this code made, or another user's
        try:
            record = json.loads((d / OWNER).read_text())
            pid = record["pid"]
        except (OSError, ValueError, TypeError, KeyError):  # none yet, or not whole
            with contextlib.suppress(OSError):
                if time.time() - d.stat().st_mtime > UNKNOWN_AFTER_S:
                    say(
                        f"note: {where}: {d} has no readable {OWNER} (a run killed while making "
                        "it, or another program's); left alone: remove it if no run uses it"
                    )
            continue
        rest = d.name[len(PREFIX) :]  # removing-PID-...: taken by another, maybe live
        taker = rest.split("-")[1] if rest.startswith("removing-") else None
        if taker and taker != str(os.getpid()) and owner.alive(taker):
            continue
        if not owner.is_dead_here(record):
            continue
        mine = d.with_name(f"{PREFIX}removing-{os.getpid()}-{d.name[len(PREFIX) :]}")
        try:
            os.rename(d, mine)
        except FileNotFoundError:
            continue  # another rank removes it
        except OSError as exc:
            say(
                f"note: {where}: {d} is left from pid {pid}, which runs no more, but cannot be "
                f"removed from here ({exc.strerror})"
            )
            continue
        freed = 0
        for f in mine.rglob("*"):
            with contextlib.suppress(OSError):
                freed += f.lstat().st_blocks * 512
        shutil.rmtree(mine, ignore_errors=True)
        say(
            f"note: {where}: removed {d}, the state files of pid {pid} (started "
            f"{record.get('started')}), which runs no more: {freed:,} bytes freed"
        )


def _make_root(directory: Path) -> Path:
    """This engine's folder, its owner's record inside before anything else; registered at once
    for removal on every exit ([Note: a folder's last exit])."""
    try:
        root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory))
    except OSError as exc:
        raise ValueError(
            f"offload_dir={str(directory)!r}: cannot make this rank's folder there ({exc.strerror})"
        ) from None
    owner.remove_at_exit(root)
    try:
        data = json.dumps({**owner.identity(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        tmp = root / f".{OWNER}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / OWNER)  # whole or not at all: [Note: stale state folders]
    except BaseException as exc:
        owner.remove_now(root)
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            raise ValueError(
                f"offload_dir={str(directory)!r}: no room for this rank's folder ({exc.strerror})"
            ) from exc
        raise
    return root


class StateFile:
    """One float32 state of one unit in a file of its own, memory-mapped as a tensor."""

    def __init__(self, path: Path, numel: int):
        self.path, self.nbytes = path, 4 * numel
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if self.nbytes:
                os.posix_fallocate(fd, 0, self.nbytes)  # all blocks now: ENOSPC here, or never
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise OSError(
                exc.errno,
                f"offload_dir: cannot allocate {self.nbytes} bytes ({exc.strerror})",
                str(path),
            ) from exc
        self.fd, self.inode = fd, os.fstat(fd).st_ino
        self.map = mmap.mmap(fd, self.nbytes) if self.nbytes else None
        if self.map is None:
            self.tensor = torch.zeros(0)
        else:
            self.tensor = torch.frombuffer(self.map, dtype=torch.float32)

    def check(self) -> None:
        """Refuses (RuntimeError, naming the file) a state file removed or resized from outside."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise RuntimeError(f"disk tier: state file {self.path} was removed") from None
        if st.st_ino != self.inode or st.st_size != self.nbytes:
            raise RuntimeError(
                f"disk tier: state file {self.path} was replaced or resized ({st.st_size} "
                f"bytes, expected {self.nbytes}); the run's state is no longer its own"
            )

    def read_ahead(self) -> None:
        if self.map is not None:
            self.map.madvise(mmap.MADV_WILLNEED)

    def write_back(self) -> None:
        """Pages to disk, then out of the page cache and this process's mapping."""
        if self.map is None:
            return
        os.fsync(self.fd)
        self.map.madvise(mmap.MADV_DONTNEED)  # unmapped first: the cache keeps mapped pages
        os.posix_fadvise(self.fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)


WINDOW = 2
"""Units whose write-back may be in flight at once: with the unit updating and the one read
ahead, the state pages in host memory are at most WINDOW + 2 units'."""


class DiskOffload(HostOffload):
    """HostOffload with each unit's master and optimizer states in memory-mapped files.
    `needed`: the bytes of every state file this rank will make (disk_bytes)."""

    def __init__(self, *, directory, needed: int, **host):
        super().__init__(**host)
        self.directory, self.needed, self.allocated = Path(directory), needed, 0
        clear_stale(self.directory)  # [Note: stale state folders]
        check_space(self.directory, needed)
        self.files: dict[int, list[StateFile]] = {}  # unit index -> its state files
        self.order: list[int] = []  # unit indices in placement order: the update's order
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="zero-disk")
        self.pending: dict[int, Future] = {}  # unit index -> its write-back in flight
        self.disk_ptrs: set[int] = set()  # storages that are state files
        self.root = _make_root(self.directory)
        self.remove = weakref.finalize(self, _remove, self.root, self.writer, os.getpid())

    def _states(self, u: FlatUnit) -> None:
        """u.master (its values kept) and u.opt (zeros) as views of new state files. Any
        failure removes the folder; want of room is refused in one line (ValueError)."""
        names, numel = ["master", *u.opt], u.master.numel()
        self.allocated += len(names) * 4 * numel
        assert self.allocated <= self.needed, ("disk_bytes counts", self.needed, self.allocated)
        files, path = [], None
        try:
            for x in names:
                path = self.root / f"u{u.index:04d}-{x}.f32"
                files.append(StateFile(path, numel))
        except BaseException as exc:
            self.remove()  # the writer stopped, the folder and every file in it removed
            if isinstance(exc, OSError) and exc.errno in NO_SPACE:
                raise ValueError(
                    f"offload_dir={str(self.directory)!r}: no room for this rank's state files "
                    f"({_size(self.needed)} in all; {os.strerror(exc.errno)} allocating "
                    f"{path.name}); its folder {self.root} is removed"
                ) from exc
            raise
        files[0].tensor.copy_(u.master.reshape(-1))  # the files are zeros (fallocate)
        u.master = files[0].tensor
        u.opt = {x: f.tensor for x, f in zip(u.opt, files[1:], strict=True)}
        for f in files:
            self.disk_ptrs.add(f.tensor.untyped_storage().data_ptr())
        self.files[u.index], self.order = files, [*self.order, u.index]
        self._write_back(u.index)

    def is_disk(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.disk_ptrs

    @contextmanager
    def streamed(self, units: list[FlatUnit]):
        """Around the update of `units`: their files checked and their write-back of the
        previous step finished, the next unit's read ahead; afterwards written back, counted."""
        for u in units:
            done = self.pending.pop(u.index, None)
            if done is not None:
                done.result()  # a failed write-back surfaces here, naming its file
            for f in self.files[u.index]:
                f.check()
            self._count(u, "disk_read")
        after = self._next(units[-1].index)
        if after is not None:
            for f in self.files[after]:
                f.read_ahead()
        yield
        for u in units:
            self._count(u, "disk_write")
            self._write_back(u.index)

    def _write_back(self, index: int) -> None:
        """Queue unit `index`'s write-back; wait for the oldest while more than WINDOW are in
        flight, so that a disk slower than the update bounds host memory, not the disk's lag."""
        self.pending[index] = self.writer.submit(_write_back, self.files[index])
        while len(self.pending) > WINDOW:
            oldest = next(iter(self.pending))
            self.pending.pop(oldest).result()

    def settle(self) -> None:
        """Every write-back finished (a checkpoint, the end of a run, a test)."""
        for i in list(self.pending):
            self.pending.pop(i).result()

    def _next(self, index: int) -> int | None:
        i = self.order.index(index) + 1
        return self.order[i] if i < len(self.order) else None

    def _count(self, u: FlatUnit, op: str) -> None:
        files = self.files[u.index]
        nbytes = sum(f.nbytes for f in files)
        self.counter.add(
            op=op, phase="update", kind="disk", unit=u.index, elements=nbytes // 4,
            padding=self.padding[u.index] * len(files), nbytes=nbytes,
        )  # fmt: skip


def _write_back(files: list[StateFile]) -> None:
    for f in files:
        try:
            f.write_back()
        except OSError as exc:
            raise OSError(exc.errno, f"disk tier: writing {f.path} back: {exc.strerror}") from exc


def _remove(root: Path, writer: ThreadPoolExecutor, pid: int) -> None:
    """The engine's state files, when it is collected (its checkpoints are elsewhere), by the
    process that made them only: a forked child collecting its copy leaves them be."""
    if os.getpid() != pid:
        return
    writer.shutdown(wait=True)
    owner.remove_now(root)
