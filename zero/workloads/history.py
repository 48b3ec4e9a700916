"""A training run's loss history on disk: an append-only file beside the checkpoints.

[Note: bounded manifests] A checkpoint's manifest once embedded the whole loss history, so every
save grew with the run (492 KB at step 3000). Now rank 0 appends one JSON line per entry to
CKPT/history.jsonl as the run goes, and a checkpoint records only a mark of constant size: the
file's length and the sha256 of that prefix at save time (the file is fsynced first). Resuming reads
exactly that prefix, checks its digest, and cuts the file back to it, so the entries of steps after
the checkpoint (which the resumed run repeats) are not doubled, and a line half-written by a crash
is dropped. The history a resumed run reports is therefore the one it reported before: the same
entries, in the same order. A checkpoint of the older kind (the history inside its manifest) is
still read.

Also here: what rank 0 shows of the history as the run goes, a progress bar (Progress) and the
loss curve (plot_losses), and how a failed run leaves the file and its checkpoint root
(after_failure, tidy_after_failure)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
import sys
from pathlib import Path

from .. import checkpoint
from ..checkpoint import CheckpointError
from ..common.results import write_atomic

FILE = "history.jsonl"
"""The history's file name inside the checkpoint root."""


class HistoryLog:
    """Rank 0's append-only history file; `history` is {"train": [...], "val": [...]}."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.history: dict = {"train": [], "val": []}
        self._hash, self._size, self._file = hashlib.sha256(), 0, None

    def start(self) -> None:
        """A fresh run: an empty file."""
        self._open(b"")

    def append(self, split: str, entry: dict) -> None:
        """Add one entry to history[split] and to the file (flushed, not fsynced)."""
        self.history[split].append(entry)
        line = (json.dumps({"split": split, **entry}) + "\n").encode()
        self._file.write(line)
        self._file.flush()
        self._hash.update(line)
        self._size += len(line)

    def mark(self) -> dict:
        """The constant-size record a checkpoint keeps: the file made durable, its length and
        the sha256 of its content."""
        os.fsync(self._file.fileno())
        return {"file": FILE, "bytes": self._size, "sha256": self._hash.hexdigest()}

    def restore(self, extra) -> dict:
        """The history at a checkpoint, from its `extra`; the file is cut back to it."""
        if isinstance(extra, dict) and isinstance(extra.get("history"), dict):
            self._open(b"")  # an older checkpoint: the history came inside the manifest
            for split in ("train", "val"):
                for entry in extra["history"].get(split, []):
                    self.append(split, entry)
            return self.history
        mark = extra.get("history_log") if isinstance(extra, dict) else None
        if not isinstance(mark, dict) or not isinstance(mark.get("bytes"), int):
            raise ValueError(f"extra={extra!r}: the checkpoint holds no loss-history mark")
        try:
            with open(self.path, "rb") as f:
                data = f.read(mark["bytes"])
        except OSError as exc:
            raise ValueError(f"{self.path}: cannot read the loss history ({exc})") from None
        if len(data) != mark["bytes"] or hashlib.sha256(data).hexdigest() != mark["sha256"]:
            raise ValueError(
                f"{self.path}: its first {mark['bytes']} bytes are not the history the "
                f"checkpoint recorded (found {len(data)} bytes, a different sha256)"
            )
        self._open(data)
        for line in data.splitlines():
            entry = json.loads(line)
            self.history[entry.pop("split")].append(entry)
        return self.history

    def _open(self, prefix: bytes) -> None:
        """The file cut back to `prefix` (which it begins with) and open for appending."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # appends go to the end, wherever that is
        self._file.truncate(len(prefix))
        self._hash, self._size = hashlib.sha256(prefix), len(prefix)
        self.history = {"train": [], "val": []}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def after_failure(path: str | os.PathLike, extra, *, fresh: bool) -> str:
    """The history file of a run that failed, made to agree with what it leaves: a fresh run that
    committed no checkpoint of its own (`fresh`) leaves no history, so a file that would claim a
    run is removed; else the file is cut back to the mark of the checkpoint `latest` names
    (`extra`, its manifest's), dropping the entries of the steps the failure lost, as a resume
    would. A file that does not begin with the marked history is left as it is (the resume
    will refuse it, naming it). Returns what was done, for the log."""
    path = Path(path)
    if not path.exists():
        return ""
    if fresh:
        path.unlink()
        return f"removed {path} (no checkpoint of this run)"
    mark = extra.get("history_log") if isinstance(extra, dict) else None
    if not isinstance(mark, dict) or not isinstance(mark.get("bytes"), int):
        return ""
    with open(path, "r+b") as f:
        data = f.read(mark["bytes"])
        if len(data) != mark["bytes"] or hashlib.sha256(data).hexdigest() != mark.get("sha256"):
            return ""
        if f.seek(0, os.SEEK_END) == mark["bytes"]:
            return ""
        f.truncate(mark["bytes"])
        f.flush()
        os.fsync(f.fileno())
    return f"cut {path} back to the history of the last checkpoint"


def latest_checkpoint(ckpt: Path) -> Path | None:
    """The step directory that the checkpoint root `ckpt` names latest; None where it has none
    (or it cannot be read)."""
    try:
        return checkpoint.resolve(ckpt)
    except CheckpointError:
        return None


def tidy_after_failure(ckpt: Path, step_dir: Path | None, before: Path | None) -> None:
    """After a failed run, its ranks stopped: the loss history agrees with the checkpoint left
    (after_failure: removed if this run started fresh, `step_dir` None, and committed none after
    `before`), and the root `ckpt` goes if that leaves it empty."""
    now = latest_checkpoint(ckpt)
    with contextlib.suppress(OSError, CheckpointError):
        extra = checkpoint.read_manifest(now)["extra"] if now is not None else None
        after_failure(ckpt / FILE, extra, fresh=step_dir is None and now == before)
        ckpt.rmdir()  # only if empty


class Progress:
    """Rank 0's display: a tqdm bar when tqdm is installed (it is optional), else plain lines."""

    def __init__(self, *, total: int, initial: int, show: bool, every: int):
        self.show, self.every, self.bar = show, every, None
        if show:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def step(self, step: int, fields: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif self.show and (step + 1) % self.every == 0:
            self.say(f"step {step + 1}: " + ", ".join(f"{k} {v}" for k, v in fields.items()))

    def say(self, text: str) -> None:
        if self.show:
            (self.bar.write if self.bar is not None else print)(text)
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(history: dict, path: Path, *, title: str) -> None:
    """The loss curve (train per step, validation at each evaluation) as a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(
        [h["step"] for h in history["train"]],
        [h["loss"] for h in history["train"]],
        lw=0.8,
        label="train (mean over the step's micro-batches)",
    )
    ax.plot(
        [h["step"] for h in history["val"]],
        [h["loss"] for h in history["val"]],
        "o-",
        label="validation",
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    write_atomic(path, buf.getvalue())
    del fig, ax
    _release()


def _release() -> None:
    """[Note: memory of a plot] Rank 0 grew by ~1.3 MiB per evaluation, for two reasons. Every
    artist points back at its figure, so a dropped Figure is freed only by a full cyclic
    collection, which a process holding torch's ~200k long-lived objects seldom runs: each
    evaluation's figure and its Agg canvas (770x440 RGBA, 1.3 MB) stayed resident. And once the
    first canvas was freed, glibc raised its mmap threshold to its size (1.3 MB), so later canvases
    came from the heap, whose free pages it gives back only from the top: ~60 KiB per evaluation
    more stayed resident, unused. So a plot collects its garbage (~0.1 s) and trims the heap."""
    gc.collect()
    if sys.platform.startswith("linux"):
        import ctypes
        import ctypes.util

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)  # glibc; absent: no trim
