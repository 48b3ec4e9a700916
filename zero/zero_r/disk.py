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

Files are allocated in full at construction (posix_fallocate), so a full disk is an error there,
naming the file, and never a fault in the middle of a step; a state file removed or resized
from outside is refused by name before its unit's next update. The directory is removed when
the engine is collected. docs/zero_r.md, "Tiers", has the bytes per parameter of each tier.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from ..unit import FlatUnit
from .offload import HostOffload


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
                f"offload_dir: cannot allocate {path} ({self.nbytes} bytes): {exc.strerror}",
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
    """HostOffload with each unit's master and optimizer states in memory-mapped files."""

    def __init__(self, *, directory, **host):
        super().__init__(**host)
        self.root = Path(tempfile.mkdtemp(prefix=f"zero-states-{os.getpid()}-", dir=directory))
        self.files: dict[int, list[StateFile]] = {}  # unit index -> its state files
        self.order: list[int] = []  # unit indices in placement order: the update's order
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="zero-disk")
        self.pending: dict[int, Future] = {}  # unit index -> its write-back in flight
        self.disk_ptrs: set[int] = set()  # storages that are state files
        weakref.finalize(self, _remove, self.root, self.writer)

    def _states(self, u: FlatUnit) -> None:
        """u.master (its values kept) and u.opt (zeros) as views of new state files."""
        names = ["master", *u.opt]
        files = [StateFile(self.root / f"u{u.index:04d}-{x}.f32", u.master.numel()) for x in names]
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


def _remove(root: Path, writer: ThreadPoolExecutor) -> None:
    """The engine's state files, when it is collected: its checkpoints are elsewhere."""
    writer.shutdown(wait=True)
    shutil.rmtree(root, ignore_errors=True)
