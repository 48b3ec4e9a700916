"""The disk tier's purpose (zero/zero_r/disk.py): host memory stays bounded while the fp32 master
and the Adam moments live on disk, and the disk bytes of a step, as the kernel counts them, are
the bytes the tier's design says it moves.

Two children (tests/helpers/disk_memory_child.py) train the same 32.7M-parameter MLP (stage 3,
bf16 with bf16 gradients, N = 1, gloo on the CPU) at once: one with offload_dir under this test's
tmp_path, the control with offload_optimizer alone (the states in host memory). Every expected
value comes from the module's parameter shapes, the dtypes and the number of states; the
measurements come from the kernel (/proc/self/status, /proc/self/io), none from the engine's own
accounting.

Which resident set is bounded. The state files are mapped MAP_SHARED, so a state page the update
touches is file-backed RSS (RssFile), not RssAnon; the tier fsyncs a unit's files after its
update and drops their pages from the mapping (madvise DONTNEED) and the page cache (fadvise
DONTNEED). So: RssAnon holds what must be resident and no state; RssFile holds at most the
units whose pages are mapped at once (the one updating and up to WINDOW written back); the
total, VmHWM (anon + file), is bounded by their sum. Asserted: the total peak against the bound
derived below (and the control's above it); the quiescent RssFile back at its baseline after
every step; the control's quiescent RssAnon above the disk run's by the states' bytes.

Which I/O counter measures the tier. It moves its bytes through the mapping, not read/write
calls, so rchar/wchar (bytes through syscalls) do not see them; read_bytes counts the pages the
process makes the block layer read (page faults and madvise WILLNEED's read-ahead, cache misses
only: the tier drops the pages after each write-back, so every step misses), write_bytes the
pages it dirties (counted when dirtied, written by the tier's fsync). Both count whole pages.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from measure.resident import reset_peak_rss
from reference.layout import ALIGN
from tests.helpers.disk_memory_child import CONFIG
from tests.helpers.torchrun import REPO
from zero.zero_r.disk import WINDOW

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS = 3
"""Step 1 reads only the master (below); steps 2 and 3 are the steady state."""
STATES = 3
"""Files per unit: the fp32 master and AdamW's two moments."""
F32, BF16 = 4, 2
PAGE = os.sysconf("SC_PAGE_SIZE")
FIXED = 4 << 20
"""What the bound allows beyond what scales with the model: the interpreter's and torch's
objects of a step (the autograd graph of 57 layers, the activations of 8 rows of 768: under
1 MiB) and the sampler thread's stack."""
NO_DISK = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")
"""File systems in memory: mapped pages are RssShmem there and nothing reaches a disk."""


def filesystem(path: Path) -> str:
    """The type of the file system holding `path` (the longest mount point above it)."""
    path, best, kind = str(path.resolve()), "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point = left.split()[4].encode().decode("unicode_escape")  # \040 for a space
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, right.split()[0]
    return kind


def child(tmp: Path, directory: str, name: str) -> subprocess.Popen:
    """tests/helpers/disk_memory_child.py in a subprocess, its output in tmp/NAME.out, .err."""
    command = [sys.executable, "-m", "tests.helpers.disk_memory_child", str(tmp / f"{name}.store"),
               directory, str(STEPS)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    with open(tmp / f"{name}.out", "wb") as out, open(tmp / f"{name}.err", "wb") as err:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The disk run and the control, trained at once; each one's JSON record."""
    tmp = tmp_path_factory.mktemp("disk_bounded")
    kind = filesystem(tmp)
    if kind in NO_DISK:
        pytest.skip(f"{tmp} is on {kind}: state pages would be shared memory, never disk I/O")
    if not Path("/proc/self/io").exists():
        pytest.skip("/proc/self/io is missing: this kernel keeps no per-process I/O counters")
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here: VmHWM cannot be reset")
    (tmp / "offload").mkdir()
    procs = {
        "disk": child(tmp, str(tmp / "offload"), "disk"),
        "control": child(tmp, "-", "control"),
    }
    records = {}
    try:
        for name, proc in procs.items():
            proc.wait(240)
            log = (tmp / f"{name}.err").read_text()
            assert proc.returncode == 0, f"{name}: exit status {proc.returncode}\n{log[-3000:]}"
            records[name] = json.loads((tmp / f"{name}.out").read_text().strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert list((tmp / "offload").iterdir()) == []  # the engine's folder went with it
    return records


def extents(record) -> list[int]:
    """Each unit's padded flat buffer (N = 1: this rank's extent is all of it), from the
    parameter shapes: every parameter at an offset aligned to ALIGN elements, the unit padded to
    whole chunks (reference/layout.py). The named units are layers.i, the root the rest."""
    named = {f"layers.{i}": shapes for i, shapes in enumerate(record["layers"])}
    groups = [[named[u]] for u in record["units"]]
    groups.append([shapes for u, shapes in named.items() if u not in record["units"]])  # the root
    out = []
    for layers in groups:
        offset = sum(math.ceil(math.prod(s) / ALIGN) * ALIGN for shapes in layers for s in shapes)
        out.append(max(1, math.ceil(offset / CONFIG["chunk"])) * CONFIG["chunk"])
    return out


def pages(nbytes: int) -> int:
    return math.ceil(nbytes / PAGE) * PAGE


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def test_host_memory_stays_bounded_while_the_states_are_on_disk(runs):
    """The disk run's peak RSS (VmHWM, anon + file, construction and three steps, above its own
    RSS before the engine was built) stays under the bound of what must be resident, a bound the
    states alone exceed; the control's, the same model with its states in host memory, is above
    the bound and above the disk run's by the states' bytes, less what the bound lets the disk
    run map of them: the tier is what keeps them out."""
    disk, control = runs["disk"], runs["control"]
    ext = extents(disk)
    psi, unit = sum(ext), max(ext)
    states = STATES * F32 * psi
    # What must be resident (stage 3, N = 1, CPU: the device is host memory too):
    #   the bf16 working copy of every unit                                    2 bytes/param
    #   the bf16 reduced gradient, held from backward to step (the tree)      2 bytes/param
    #   the host gradient the update reads (bf16 gradients)                   2 bytes/param
    #   the upload staging: two slots of the largest unit, bf16               2 x 2 x unit
    #   the state pages mapped at once: the unit updating, the one read
    #   ahead, WINDOW being written back (file-backed)                        (WINDOW+2) x 12 x unit
    #   one unit's step transients, two units in flight: the gathered bf16
    #   parameters 2, their bf16 gradients 2, the fp32 unscaled gradient 4,
    #   the float64 squares of the norm 8                                     2 x 16 x unit
    #   FIXED
    resident = 3 * BF16 * psi
    window = (WINDOW + 2) * STATES * F32 * unit
    bound = resident + 2 * 2 * BF16 * unit + window + 2 * 16 * unit + FIXED
    assert bound < states, (mib(bound), mib(states))  # the states exceed the budget

    def peak(r):
        return r["hwm"] - r["base"]["VmRSS"]

    said = (
        f"disk peak {mib(peak(disk))}, control peak {mib(peak(control))}, bound {mib(bound)}, "
        f"states {mib(states)}, disk sampled anon/file peaks "
        f"{mib(disk['sampled']['RssAnon'] - disk['base']['RssAnon'])} / "
        f"{mib(disk['sampled']['RssFile'] - disk['base']['RssFile'])}"
    )
    assert peak(disk) <= bound, said
    assert peak(control) > bound, said
    # The control's peak holds all the states; the disk run's may hold `window` of them (and
    # FIXED differs between two processes): the difference is the tier's doing.
    assert peak(control) - peak(disk) >= states - window - FIXED, said
    # Quiescent (after gc and malloc_trim), after each step: the disk run maps no state page
    # (not one unit's master file stays: its RssFile is back at its baseline within 4 x unit
    # bytes), holds no shared memory, and the control's RssAnon exceeds the disk run's by the
    # states, within page rounding: each of the control's STATES x units state tensors is an
    # allocation of its own, which can round up by up to two pages (its header, its end).
    rounding = 2 * PAGE * STATES * len(ext)
    for d, c in zip(disk["steps"], control["steps"], strict=True):
        assert d["status"]["RssFile"] - disk["base"]["RssFile"] <= F32 * unit, said
        assert d["status"]["RssShmem"] == disk["base"]["RssShmem"], said
        extra = (c["status"]["RssAnon"] - control["base"]["RssAnon"]) - (
            d["status"]["RssAnon"] - disk["base"]["RssAnon"]
        )
        assert abs(extra - states) <= rounding, (mib(extra), said)
    # The sampler's largest RssFile (a lower bound on the file-backed peak) within the window.
    assert disk["sampled"]["RssFile"] - disk["base"]["RssFile"] <= window, said


def test_the_os_counts_the_states_bytes_each_way_per_step(runs):
    """/proc/self/io around each step of the disk run: read_bytes and write_bytes are the state
    files' pages, master + 2 moments of every unit, each way, from step 2 on; step 1 writes all
    of them and reads at least the master's (the moments' files were allocated, never written:
    fallocate's unwritten extents read as zeros without I/O on a file system that has them).
    rchar and wchar, the syscalls' bytes, see a small fraction: the tier's bytes go through the
    mapping. The control run moves nothing to or from the disk."""
    disk, control = runs["disk"], runs["control"]
    ext = extents(disk)
    # Each state file is 4 x extent bytes; the kernel counts whole pages.
    master = sum(pages(F32 * e) for e in ext)
    want = STATES * master
    # The file system's own metadata (an inode's block, an extent block) read or dirtied on the
    # process's account: at most a page per state file and step.
    slack = STATES * len(ext) * PAGE
    rows = [r["io"] for r in disk["steps"]]
    said = f"per step want {want:,} (+{slack:,}); read/write " + ", ".join(
        f"{r['read_bytes']:,}/{r['write_bytes']:,}" for r in rows
    )
    for s, r in enumerate(rows):
        assert want <= r["write_bytes"] <= want + slack, said
        low = master if s == 0 else want
        assert low <= r["read_bytes"] <= want + slack, said
        assert r["cancelled_write_bytes"] == 0, said
        assert r["rchar"] + r["wchar"] < want / 10, (r, said)
    for r in control["steps"]:
        assert r["io"]["read_bytes"] <= slack and r["io"]["write_bytes"] <= slack, r
