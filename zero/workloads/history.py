"""A training run's loss history on disk: an append-only file beside the checkpoints.

[Note: bounded manifests] A checkpoint's manifest once embedded the whole loss history, so every
save grew with the run (492 KB at step 3000). Now rank 0 appends one JSON line per entry to
CKPT/history.jsonl as the run goes, and a checkpoint records only a mark of constant size: the
file's length and the sha256 of that prefix at save time (the file is fsynced first). Resuming reads
exactly that prefix, checks its digest, and cuts the file back to it, so the entries of steps after
the checkpoint (which the resumed run repeats) are not doubled, and a line half-written by a crash
is dropped. The history a resumed run reports is therefore the one it reported before: the same
entries, in the same order. A checkpoint of the older kind (the history inside its manifest) is
still read."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

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
