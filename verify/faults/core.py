"""The fault suite's machinery: a case, a process tree run under a deadline, and the verdicts.

A case (`Case`) names one fault, says what the right outcome is and carries a deadline. Its
`run(ctx)` returns a `Result`: one verdict of VERDICTS and the evidence. Every process a case
starts goes through `Job`: a new session, an environment variable of its own (MARK: so that it
and every descendant, forked ranks and torchrun's workers included, can be found), its own
TMPDIR, and output captured to files. At the end of a case every marked process still alive is
counted as an orphan, killed and reaped, the TMPDIR is checked for the launcher's
rendezvous directories (`zero-spawn-*`, `zero-pool-*`), and the case's directory for what a crash
may leave that the next run must remove (`leftovers`: the disk tier's state folders, a prune's
trash, a save that never committed), before both are removed. A case that runs a next run (a
`--resume`) runs it before it returns, so what is counted is what outlived it. Nothing here
trusts the code under test to clean up: that is what is being checked.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

VERDICTS = ("survived", "refused", "hang", "silent_wrong", "unclear")
"""survived: completed, or resumed from `latest`, bitwise as the undisturbed run; refused: a
clear error (names the rank or the file; one line for bad input); hang: the case's deadline
passed; silent_wrong: finished without an error but with another result (or bad input
accepted); unclear: an error that does not name the culprit (or a traceback for bad input)."""

FAILING = ("hang", "silent_wrong", "unclear")

SETTLE_S = 5.0
"""How long the ranks may outlive their launcher before they count as orphans: a rank told to
stop (a parent-death signal, a SIGTERM passed on) needs well under a second to leave; 5 s
leaves room for a loaded machine, and the orphans the issue found lived 20 s or for good."""


@dataclass
class Result:
    """What one case observed. `orphans`, `temp_left` and `leftovers` are filled in by
    `Ctx.finish`."""

    verdict: str
    detail: str = ""
    bytes_lost: int = 0
    orphans: int = 0
    temp_left: int = 0
    leftovers: int = 0
    bad_inputs: int = 0  # bad inputs tried (bad-input cases)
    clear: int = 0  # of those, refused with a one-line error naming the field
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.verdict in FAILING or bool(
            self.bytes_lost or self.orphans or self.temp_left or self.leftovers
        )


@dataclass(frozen=True)
class Case:
    """One fault: `fault` what is done, `right` what counts as the right outcome, `deadline_s`
    after which the case is a hang (everything it started is killed). `fast`: in the fast subset.
    """

    name: str
    family: str
    fault: str
    right: str
    deadline_s: float
    run: object  # callable(ctx) -> Result
    fast: bool = False


class Ctx:
    """A case's working directory, TMPDIR and processes; `finish()` cleans them all up."""

    def __init__(self, root: Path, case: Case, shared):
        self.case, self.shared = case, shared
        self.dir = root / case.name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir(parents=True)
        self.jobs: list[Job] = []
        self.orphans = 0
        self.deadline = time.monotonic() + case.deadline_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def job(self, argv: list[str], *, env: dict | None = None, tag: str = "", **kw) -> Job:
        j = Job(self, argv, env=env, tag=tag or f"job{len(self.jobs)}", **kw)
        self.jobs.append(j)
        return j

    def settle(self, job: Job, grace_s: float = SETTLE_S) -> int:
        """After `job`'s leader ended: wait up to grace_s for the rest of its processes to end,
        then count what is left as orphans (kept in self.orphans) and kill it."""
        end = time.monotonic() + grace_s
        while marked_pids(job.mark) and time.monotonic() < end:
            time.sleep(0.1)
        left = [p for p in marked_pids(job.mark) if p != job.pid]
        self.orphans += len(left)
        job.kill()
        return len(left)

    def finish(self, result: Result) -> Result:
        """Count and kill what is left of every job, check TMPDIR and the case's dir for what a
        crash left (leftovers()), remove the case's dir."""
        time.sleep(0.2 if all(j.done() for j in self.jobs) else 0)
        orphans = set()
        for j in self.jobs:
            if j.done():  # the launcher ended: whatever of its job is still there is orphan
                orphans |= set(marked_pids(j.mark))
            j.kill()
        temps = [p.name for p in self.tmp.glob("zero-*")] if self.tmp.is_dir() else []
        result.orphans, result.temp_left = len(orphans) + self.orphans, len(temps)
        left = leftovers(self.dir)
        result.leftovers = len(left)
        if result.orphans:
            result.detail += f"; {result.orphans} orphan process(es) left after the launcher ended"
        if temps:
            result.detail += f"; temp dirs left: {temps}"
        if left:
            shown = [str(p.relative_to(self.dir)) for p in left]
            result.detail += f"; left behind after the next run: {shown}"
        if os.environ.get("FAULTS_KEEP") is None:
            shutil.rmtree(self.dir, ignore_errors=True)
        return result


STATE_FOLDER = "zero-states-"
"""The prefix of the disk tier's state folders (zero.zero_r.disk.PREFIX: one per rank in its
offload_dir)."""


def leftovers(root: Path) -> list[Path]:
    """What a crash may leave under `root` that the next run must have removed: the disk tier's
    state folders (STATE_FOLDER*, anywhere), and under every `ckpt` folder a prune's trash
    (`.trash-*`) and a step folder without manifest.json (a save that never committed). Links
    are not followed."""
    found = []
    for top, dirs, _ in os.walk(root):
        here = Path(top)
        for name in dirs:
            d = here / name
            if d.is_symlink():
                continue
            if name.startswith(STATE_FOLDER):
                found.append(d)
            elif here.name == "ckpt" and name.startswith(".trash-"):
                found.append(d)
            elif here.name == "ckpt" and name.startswith("step-"):
                if not os.path.lexists(d / "manifest.json"):
                    found.append(d)
        dirs[:] = [n for n in dirs if not n.startswith(STATE_FOLDER)]  # its files are its own
    return sorted(found)


MARK = "FAULTS_JOB"
"""The environment variable that marks every process of a job: forked ranks inherit it, and
torchrun passes it to its workers, whatever session or process group they move to."""


def marked_pids(mark: str) -> list[int]:
    """Every live process whose environment holds MARK=mark (zombies included)."""
    needle = f"{MARK}={mark}".encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in env:
                out.append(int(d))
    return out


def _stat(pid: int):
    """(state, ppid, pgrp, session, starttime) of /proc/PID/stat, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    return rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19])


def children(pid: int) -> list[int]:
    """Live direct children of `pid`, oldest first (by start time, then pid)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and st[1] == pid and st[0] != "Z":
                found.append((st[4], int(d)))
    return [p for _, p in sorted(found)]


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (None if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(m.group(1)) if m else None


class Job:
    """A command in its own session, TMPDIR = the case's, output to files; never left running."""

    def __init__(self, ctx: Ctx, argv, *, env=None, tag="job", preexec=None, cwd=None):
        self.tag = tag
        self.out_path = ctx.dir / f"{tag}.out"
        base = {k: v for k, v in os.environ.items() if k not in STRIP_ENV}
        self.mark = f"{ctx.case.name}-{tag}-{os.getpid()}-{time.monotonic_ns()}"
        full_env = {**base, "TMPDIR": str(ctx.tmp), "PYTHONPATH": str(REPO), **(env or {})}
        full_env[MARK] = self.mark
        full_env = {k: v for k, v in full_env.items() if v is not None}
        self._file = open(self.out_path, "wb")  # noqa: SIM115 - closed in kill()

        def setup():
            # as from a terminal: a shell running the suite in the background ignores SIGINT,
            # and an ignored signal would stay ignored in every process started here
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if preexec is not None:
                preexec()

        self.proc = subprocess.Popen(
            argv, cwd=cwd or REPO, env=full_env, stdout=self._file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=setup,
        )  # fmt: skip
        self.pid = self.sid = self.proc.pid
        self.started = time.monotonic()

    def done(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, ctx: Ctx) -> int | None:
        """The exit status, or None when the case's deadline passed first (then killed)."""
        try:
            return self.proc.wait(timeout=max(0.0, ctx.left()))
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def text(self) -> str:
        if not self._file.closed:
            self._file.flush()
        return self.out_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL every process of the job (stopped ones too), then reap the leader."""
        for _ in range(3):
            pids = marked_pids(self.mark)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not pids:
                break
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._file.close()


STRIP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK")  # fmt: skip
"""Launcher variables of the suite's own environment: never passed on by accident."""

PY = sys.executable


def torchrun_argv(module: str, args: list[str], nproc: int = 2) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m module ...` with this interpreter's torchrun."""
    launcher = shutil.which("torchrun", path=str(Path(PY).parent)) or "torchrun"
    return [launcher, "--standalone", "--nproc-per-node", str(nproc), "-m", module, *args]


def one_line_error(text: str) -> str | None:
    """The single error line of a CLI refusal ('prog: error: ...'), None if there is a
    traceback or more than one line after the usage lines argparse prints."""
    lines = [x for x in text.strip().splitlines() if x.strip()]
    if not lines or "Traceback" in text:
        return None
    errors = [x for x in lines if ": error: " in x or x.startswith("error: ")]
    if len(errors) != 1 or errors[0] != lines[-1]:
        return None
    return errors[0]


@dataclass
class Figures:
    """The suite's totals, as the issue asks for them."""

    faults: int = 0
    survived: int = 0
    refused: int = 0
    hangs: int = 0
    silent_wrong: int = 0
    unclear: int = 0
    bytes_lost: int = 0
    orphans: int = 0
    temp_left: int = 0
    leftovers: int = 0
    bad_inputs: int = 0
    clear_errors: int = 0
    failed_cases: list = field(default_factory=list)

    def add(self, name: str, r: Result) -> None:
        if r.bad_inputs:
            self.bad_inputs += r.bad_inputs
            self.clear_errors += r.clear
        else:
            self.faults += 1
            key = {"hang": "hangs"}.get(r.verdict, r.verdict)
            setattr(self, key, getattr(self, key) + 1)
        self.bytes_lost += r.bytes_lost
        self.orphans += r.orphans
        self.temp_left += r.temp_left
        self.leftovers += r.leftovers
        if r.failed or (r.bad_inputs and r.clear != r.bad_inputs):
            self.failed_cases.append(name)

    @property
    def ok(self) -> bool:
        return not self.failed_cases
