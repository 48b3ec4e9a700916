"""A row of verify's refusals section (verify/refusals/section.py) and how it is judged.

A row is (what is done wrong, the call that does it, the exception type that must be raised,
the text its message must contain), every part stated in the row. Shared by the section's row
modules (verify/refusals/: section.py, ranks.py, damage.py), which import it from
here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SMALL_GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
"""verify.cells.cell's small GPT: the model of the rows that need a GPT."""


@dataclass(frozen=True)
class Refusal:
    """One row: `make()` does the bad thing; it must raise `error` with `says` in its message
    (on a pool, `says` may be a tuple: rank r's text is says[r])."""

    name: str
    module: str  # the library module whose refusal this is (zero/<module>.py)
    make: Callable[[], object]
    error: type[BaseException]
    says: str | tuple[str, ...]
    world: int = 0  # 0: in this process; N: on every rank of a local pool of N

    def expected(self, rank: int = 0) -> str:
        return self.says if isinstance(self.says, str) else self.says[rank]


def attempt(row: Refusal) -> dict:
    """What row.make() did: {"raised": the exception's type name or None, "right_type",
    "message"} (plain data: a rank sends it back to the parent)."""
    try:
        row.make()
    except row.error as exc:
        return {"raised": type(exc).__name__, "right_type": True, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - another type is the row's failure, named
        return {"raised": type(exc).__name__, "right_type": False, "message": str(exc)}
    return {"raised": None, "right_type": False, "message": ""}


def verdict(row: Refusal, outcome: dict, rank: int = 0) -> str:
    """'' when the outcome is the row's refusal; else what happened instead."""
    said = outcome["message"].replace("\n", " ")[:300]
    if outcome["raised"] is None:
        return f"accepted: nothing raised, expected {row.error.__name__}"
    if not outcome["right_type"]:
        return f"raised {outcome['raised']}, not {row.error.__name__}: {said}"
    if row.expected(rank) not in outcome["message"]:
        return f"{outcome['raised']} does not say {row.expected(rank)!r}: {said}"
    return ""


def result(row: Refusal, outcomes: list[dict]) -> dict:
    """A row of the report from every rank's outcome (one, here): passed when each rank's is
    the row's refusal; `message` names the first rank whose is not."""
    why = ""
    for rank, outcome in enumerate(outcomes):
        why = why or verdict(row, outcome, rank)
        if why and len(outcomes) > 1:
            why = f"rank {rank}: {why}"
    got = outcomes[0]
    return {
        "row": row.name,
        "module": row.module,
        "where": "here" if row.world == 0 else f"N={row.world}",
        "expected": f"{row.error.__name__} saying {row.expected()!r}",
        "got": f"{got['raised']}: {got['message'][:300]}" if got["raised"] else "nothing raised",
        "passed": not why,
        "message": why,
    }


def judge_here(rows: list[Refusal]) -> list[dict]:
    """Rows run in this process, one result each."""
    return [result(r, [attempt(r)]) for r in rows]
