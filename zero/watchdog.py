"""The collective watchdog: every collective fingerprinted, a stalled or diverging rank named.

(Interface first; the implementation follows in this module.)

Every error the watchdog raises is a CollectiveError whose message contains one line

    watchdog blames rank 1: <why>

(or "watchdog blames ranks 1, 3: ..." when several ranks are to blame), naming each blamed rank
and the collective it was at. `blamed(text)` reads that line back out of any text (a traceback
relayed by zero.launch, a torchrun log), so that tools and tests can check who was blamed
without parsing the rest.
"""

from __future__ import annotations

import re

BLAME = "watchdog blames"

_BLAME_RE = re.compile(r"watchdog blames ranks? ([0-9]+(?:, [0-9]+)*)")


class CollectiveError(RuntimeError):
    """A rank diverged, stalled or died; `.blamed` holds the ranks to blame (sorted)."""

    def __init__(self, message: str, *, blamed: tuple[int, ...]):
        super().__init__(message)
        self.blamed = tuple(sorted(blamed))


def blame_line(ranks, why: str) -> str:
    """The one line every watchdog error carries: 'watchdog blames rank R: why'."""
    ranks = sorted(ranks)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"{BLAME} {who}: {why}"


def blamed(text: str) -> set[int]:
    """The ranks named by every 'watchdog blames ...' line in `text` (empty when none)."""
    out: set[int] = set()
    for m in _BLAME_RE.finditer(text):
        out.update(int(x) for x in m.group(1).split(", "))
    return out
