"""What a killed writer left in a checkpoint root, removed by the root's exclusive holder.

    gone = remove_leftovers(OUT / "ckpt")   # [(path, what it was)]; holding OUT/run.lock

Why and when: [Note: crash leftovers] and [Note: leftover temp files] in
zero/checkpoint/commit.py. Never call it from save(): a root without its holder's lock may be
shared with another run's save in progress.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .commit import TRASH, _rmtree, remove_temps
from .format import (
    LATEST,
    MANIFEST,
    POINTER_LIMIT,
    STEP_DIR,
    CheckpointError,
    _fsync_dir,
    read_regular,
)


def _named_by_latest(root: Path) -> str | None:
    """The name `latest` holds, None where there is none that reads."""
    with contextlib.suppress(OSError, CheckpointError, UnicodeDecodeError):
        return read_regular(root / LATEST, limit=POINTER_LIMIT).decode().strip()
    return None


def remove_leftovers(root) -> list[tuple[Path, str]]:
    """Remove every trash folder, every step directory without manifest.json that `latest`
    does not name, then the temp files (remove_temps); returns [(path, what it was)], in that
    order. A directory with a manifest (even one that does not validate), the one `latest` names
    (--resume names what is wrong with it), links and other files are kept. Call only while
    holding the root exclusively ([Note: crash leftovers])."""
    root, gone = Path(root), []
    if not root.is_dir() or root.is_symlink():
        return []
    named = _named_by_latest(root)
    for d in sorted(root.iterdir()):
        if d.is_symlink() or not d.is_dir():
            continue
        if TRASH.fullmatch(d.name):
            gone.append((d, "a removal cut short"))
        elif STEP_DIR.fullmatch(d.name) and d.name != named:
            if os.path.lexists(d / MANIFEST):
                continue
            gone.append((d, f"a save that never committed: no {MANIFEST}"))
        else:
            continue
        _rmtree(d)
    if gone:
        _fsync_dir(root)
    return gone + [(f, "a temp file") for f in remove_temps(root)]
