"""Training text for `python -m zero.workloads.train`: the Python standard library's source,
byte-level.

Every Python ships its standard library as source, so the default corpus needs no download:
the *.py files under the running interpreter's stdlib directory (``os.path.dirname(os.__file__)``),
sorted by relative path, without test suites (directories named ``test`` or ``tests``),
``site-packages`` and caches. ``--data PATH`` takes any text file or folder instead.

Legend:
    V        vocabulary: 256, one token per byte (no tokenizer to ship or version)
    T        tokens per sequence (the model's block_size)
    B        sequences per micro-batch
    doc      one file of the corpus (or one fixed-size piece of a large single file)

[Note: split by name] Whether a document is validation is decided by a hash of its *name* (its
relative path) alone: blake2b(name) read as a fraction in [0, 1) below ``val_fraction``. So the
split does not depend on the file's contents, on which other files exist, on their order, or on
the machine; a file keeps its side of the split across Python versions as long as its path does.
The stdlib differs between Python versions, so every run records the corpus's fingerprint (the
names' hash, the contents' hash, the hash of both together, counts, the names themselves when
few, the Python version): two runs are comparable when those agree. A resume that reads the
same bytes under other names reads other data (another split), and the fingerprint says which
of the two changed.

[Note: sampling] Micro-batch j of data step s is B windows of T + 1 bytes at offsets drawn from a
generator seeded with stable_seed("corpus", seed, s, j): a pure function of (seed, s, j), never of
the rank or of what ran before, so a run is the same at every world size and a resumed run reads
exactly the data the uninterrupted one would (docs/design.md §2). Validation batches are drawn the
same way from the validation text with their own index, the same ones at every evaluation.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..materialize import stable_seed

VOCAB_SIZE = 256
"""Byte-level tokens."""

EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages", "__pycache__"})
"""Directory names skipped anywhere in the stdlib tree: test suites, installed packages, caches."""

PIECE_BYTES = 1 << 16
"""A corpus of fewer than MIN_DOCS documents (one file, say) is cut into pieces of this many bytes,
named "<name>#<i>", so that the split by name still has documents to put on each side."""

MIN_DOCS = 20

SHOWN_NAMES = (8, 200)
"""The fingerprint lists the file names themselves when there are at most this many, of at most
this many characters in all (else only their hash)."""


def _fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: expected {allowed}")


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(os.path.dirname(os.__file__))


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the stdlib's *.py files, sorted (see the module docstring)."""
    root = stdlib_dir() if root is None else Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune, don't descend
        rel = Path(dirpath).relative_to(root)
        out += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(out)


def is_validation(name: str, val_fraction: float) -> bool:
    """[Note: split by name] True when the document ``name`` belongs to the validation split."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


def split_names(names, val_fraction: float) -> tuple[list[str], list[str]]:
    """(train names, validation names) in the given order ([Note: split by name]). When the
    hash puts no name on the validation side, the name of lowest hash goes there, which is still
    a function of the names alone."""
    val = [n for n in names if is_validation(n, val_fraction)]
    if not val and names:
        val = [min(names, key=lambda n: hashlib.blake2b(n.encode("utf-8")).digest())]
    chosen = set(val)
    return [n for n in names if n not in chosen], val


def _text_files(root: Path) -> list[str]:
    """Every regular, non-hidden file under ``root`` without a NUL byte in its first 8 KiB."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for f in filenames:
            path = Path(dirpath) / f
            if f.startswith(".") or not path.is_file():
                continue
            with open(path, "rb") as fh:
                if b"\0" in fh.read(8192):
                    continue  # binary
            out.append(path.relative_to(root).as_posix())
    return sorted(out)


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A byte corpus split into train and validation text, with the fingerprint runs record."""

    source: str
    """'stdlib' or the --data path as given."""
    train: torch.Tensor = field(repr=False)  # 1D uint8, the training documents concatenated
    val: torch.Tensor = field(repr=False)  # 1D uint8, the validation documents concatenated
    fingerprint: dict = field(repr=False)
    """files, names (when few: SHOWN_NAMES), file_list_sha256 (the names), text_sha256 (the
    contents alone: their sorted sha256s, whatever their names), content_sha256 (each name with
    its content), bytes, train/val documents and bytes, python."""

    def batch(
        self, *, split: str, seed: int, index: tuple[int, ...], batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), int64 (B, T): B windows at offsets drawn from stable_seed(split tag,
        seed, *index) ([Note: sampling]); targets are the inputs shifted by one."""
        text = self.train if split == "train" else self.val
        if text.numel() < seq_len + 2:
            raise _fail("seq_len", seq_len, f"fewer than the {split} text's {text.numel()} bytes")
        g = torch.Generator().manual_seed(stable_seed("corpus", split, seed, *index))
        starts = torch.randint(0, text.numel() - seq_len - 1, (batch_size, 1), generator=g)
        windows = text[starts + torch.arange(seq_len + 1)].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _documents(data: Path | None) -> tuple[str, list[tuple[str, bytes]], str]:
    if data is None:
        root = stdlib_dir()
        return "stdlib", [(n, (root / n).read_bytes()) for n in stdlib_files(root)], str(root)
    path = Path(data)
    if path.is_file():
        return str(data), [(path.name, path.read_bytes())], str(path)
    if path.is_dir():
        names = _text_files(path)
        if not names:
            raise _fail("data", str(data), "a text file or a folder holding text files")
        return str(data), [(n, (path / n).read_bytes()) for n in names], str(path)
    raise _fail("data", str(data), "an existing text file or folder")


def load_corpus(data: str | os.PathLike | None = None, *, val_fraction: float = 0.05) -> Corpus:
    """The default stdlib corpus (``data=None``) or the text file/folder at ``data``, split by
    name ([Note: split by name]). Raises ValueError naming ``data`` or ``val_fraction``."""
    if not (isinstance(val_fraction, float) and 0.0 < val_fraction < 1.0):
        raise _fail("val_fraction", val_fraction, "a float in (0, 1)")
    source, docs, where = _documents(data)
    files = [n for n, _ in docs]
    content, digests = hashlib.sha256(), []
    for name, blob in docs:
        digests.append(hashlib.sha256(blob).digest())
        content.update(hashlib.sha256(name.encode()).digest() + digests[-1])
    few = len(files) <= SHOWN_NAMES[0] and sum(map(len, files)) <= SHOWN_NAMES[1]
    if len(docs) < MIN_DOCS:  # too few names to split: cut into named pieces
        docs = [
            (f"{n}#{i}", blob[at : at + PIECE_BYTES])
            for n, blob in docs
            for i, at in enumerate(range(0, len(blob), PIECE_BYTES))
        ]
    _, val_names = split_names([n for n, _ in docs], val_fraction)
    chosen = set(val_names)
    train_docs = [d for d in docs if d[0] not in chosen]
    val_docs = [d for d in docs if d[0] in chosen]
    if not train_docs and len(docs) > 1:  # the split, not the text, left nothing to train on
        raise _fail(
            "val_fraction",
            val_fraction,
            f"a smaller fraction: it holds out all {len(docs)} pieces of {source}",
        )
    if not train_docs:
        raise _fail("data", source, f"text of more than one piece ({PIECE_BYTES} bytes)")

    def joined(ds) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(b for _, b in ds)), dtype=torch.uint8)

    fingerprint = {
        "source": source,
        "location": where,
        "files": len(files),
        "names": files if few else None,
        "file_list_sha256": hashlib.sha256("\n".join(files).encode()).hexdigest(),
        "text_sha256": hashlib.sha256(b"".join(sorted(digests))).hexdigest(),
        "content_sha256": content.hexdigest(),
        "bytes": sum(len(b) for _, b in docs),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "val_fraction": val_fraction,
        "python": platform.python_version(),
    }
    train, val = joined(train_docs), joined(val_docs)
    fingerprint.update(train_bytes=train.numel(), val_bytes=val.numel())
    return Corpus(source=source, train=train, val=val, fingerprint=fingerprint)
