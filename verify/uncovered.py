"""The committed list of library lines that verify does not run, each with its reason.

verify/uncovered.toml holds one [[line]] entry per uncovered place of the library (the part of
zero/ that verify/linecoverage.py measures). An entry names its place without line numbers, so
that edits elsewhere in a file do not move it:

    [[line]] file = "zero/ranks/launch.py" scope = "init_from_env"      # qualname of a def or
    class, a module-level name, "__main__"
                                 # (the `if __name__ == "__main__":` block) or "<module>"
    match = ["torch.cuda.is_available()"]  # texts of lines (each must match), or "*": the scope
    reason = "gpu-only"          # a key of REASONS why = "tests/gpu/test_cuda.py runs it on a CUDA
    machine"

An entry explains every statement in its scope (nested defs included) whose source line
contains one of its `match` texts (each text must name a line); where that line opens a
compound statement (if, for, while, with, try, an except clause, def), its body too (an if's
elif and else parts are not its body: list them on their own). `check` then splits a run's
missed lines into explained and unexplained, and names every entry that matches no code (stale)
or explains no missed line (covered now): both must be edited away, so the list cannot go stale
silently. Reads nothing from zero/ (safe to import before measurement starts).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the tomli package (a dev dependency there)
    import tomli as tomllib

LIST = Path(__file__).with_name("uncovered.toml")

REASONS = {
    "gpu-only": "a CUDA path (pinned host memory, streams, NCCL); verify runs on CPU ranks",
    "torchrun": "runs only in a world launched by torchrun; verify starts local ranks",
    "error-path": "refuses bad input or reports a failure (a lost rank, a corrupt checkpoint); "
    "verify feeds valid input to healthy ranks",
    "elsewhere": "library code outside the step that verify checks; the named test runs it",
    "unreachable": "defensive code that no valid state reaches, or no caller in zero/",
    "gap": "a path verify should check and does not yet; `why` says what would",
}
"""Why a library line may stay unrun by verify (an entry's `reason`)."""

FIELDS = ("file", "scope", "match", "reason", "why")
MODULE = "<module>"
MAIN = "__main__"
"""The scope of a module's `if __name__ == "__main__":` block."""


def _is_main_guard(node) -> bool:
    t = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (
        isinstance(t, ast.Compare)
        and isinstance(t.left, ast.Name)
        and t.left.id == "__name__"
        and len(t.comparators) == 1
        and getattr(t.comparators[0], "value", None) == "__main__"
    )


@dataclass(frozen=True)
class Entry:
    file: str
    scope: str
    match: tuple[str, ...]
    """Texts of lines, each naming at least one line of the scope; ("*",): the whole scope."""
    reason: str
    why: str

    def __post_init__(self):
        if isinstance(self.match, str):
            object.__setattr__(self, "match", (self.match,))

    def __str__(self) -> str:
        shown = self.match[0] if len(self.match) == 1 else list(self.match)
        return f"{self.file} {self.scope} {shown!r} ({self.reason})"


def parse(text: str, *, source: str = str(LIST)) -> list[Entry]:
    """The entries of a list's TOML text; ValueError naming the entry and field when malformed."""
    data = tomllib.loads(text)
    unknown = set(data) - {"line"}
    if unknown:
        raise ValueError(f"{source}: unknown table(s) {sorted(unknown)}: only [[line]] entries")
    out = []
    for i, raw in enumerate(data.get("line", [])):
        where = f"{source}: entry {i + 1}"
        missing = [k for k in FIELDS if not isinstance(raw.get(k), str) or not raw[k].strip()]
        match = raw.get("match")
        if isinstance(match, list) and match and all(isinstance(m, str) and m for m in match):
            missing.remove("match")
        extra = sorted(set(raw) - set(FIELDS))
        if missing or extra:
            raise ValueError(
                f"{where} ({raw.get('file')!r}): fields {missing} missing or empty, {extra} "
                f"unknown; each entry needs the strings {list(FIELDS)} (match: or a list of them)"
            )
        if raw["reason"] not in REASONS:
            raise ValueError(f"{where}: reason={raw['reason']!r}: allowed are {sorted(REASONS)}")
        fields = {k: raw[k] for k in FIELDS}
        fields["match"] = tuple([match] if isinstance(match, str) else match)
        out.append(Entry(**fields))
    return out


def load(path: Path = LIST) -> list[Entry]:
    return parse(Path(path).read_text(encoding="utf-8"), source=str(path))


@dataclass
class Scopes:
    """One source file's scopes and their line ranges: each def or class by qualname, each
    module-level assignment by its name, MAIN, and MODULE (the whole file)."""

    lines: list[str]
    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)
    """First line of a compound statement (or except clause) -> last line of its body."""

    @classmethod
    def of(cls, text: str) -> Scopes:
        tree = ast.parse(text)
        out = cls(lines=text.splitlines())
        out.ranges[MODULE] = [(1, len(out.lines))]

        def visit(node, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}.{child.name}" if prefix else child.name
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    out.ranges.setdefault(name, []).append((first, child.end_lineno))
                elif node is tree and _is_main_guard(child):
                    out.ranges.setdefault(MAIN, []).append((child.lineno, child.end_lineno))
                elif node is tree and isinstance(child, (ast.Assign, ast.AnnAssign)):
                    targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                    for t in targets:  # a module-level name is a scope of its own
                        if isinstance(t, ast.Name):
                            out.ranges.setdefault(t.id, []).append((child.lineno, child.end_lineno))
                if isinstance(child, (ast.stmt, ast.excepthandler)) and hasattr(child, "body"):
                    body = child.body if isinstance(child.body, list) else [child.body]
                    out.blocks[child.lineno] = max(
                        out.blocks.get(child.lineno, 0), body[-1].end_lineno
                    )
                visit(child, name)

        visit(tree, "")
        return out

    def scope_lines(self, scope: str) -> set[int]:
        return {i for a, b in self.ranges.get(scope, ()) for i in range(a, b + 1)}

    def explained(self, entry: Entry) -> set[int]:
        """The lines `entry` names in this file (empty: it matches nothing)."""
        return set().union(*(self.matched(entry.scope, m) for m in entry.match))

    def matched(self, scope: str, match: str) -> set[int]:
        """The lines one match text names in a scope."""
        inside = self.scope_lines(scope)
        if match == "*":
            return inside
        out: set[int] = set()
        for i in sorted(inside):
            if match in self.lines[i - 1]:
                out.update(range(i, self.blocks.get(i, i) + 1))
        return out


def scopes_of(root: Path, file: str, cache: dict) -> Scopes | None:
    if file not in cache:
        path = root / file
        cache[file] = Scopes.of(path.read_text(encoding="utf-8")) if path.is_file() else None
    return cache[file]


def stale(entries: list[Entry], root: Path) -> list[str]:
    """Entries that name no code: a missing file, scope or matching line (one line each)."""
    cache: dict = {}
    out = []
    for e in entries:
        s = scopes_of(root, e.file, cache)
        if s is None:
            out.append(f"{e}: no such file")
        elif e.scope not in s.ranges:
            out.append(f"{e}: no def or class {e.scope!r} in {e.file}")
        else:
            for m in e.match:
                if not s.matched(e.scope, m):
                    out.append(f"{e}: no line of {e.scope} contains {m!r}")
    return out


@dataclass
class Report:
    """A run's coverage of the library against the list."""

    files: dict[str, tuple[list[int], list[int]]]
    """path -> (statement lines, missed lines)"""
    listed: dict[str, list[int]]
    """path -> missed lines that an entry explains"""
    unlisted: list[str]
    """'path:line: text' of each missed line that no entry explains"""
    stale: list[str]
    idle: list[str]
    """entries that explain no missed line of this run (covered now)"""
    by_reason: dict[str, int]

    @property
    def total(self) -> int:
        return sum(len(s) for s, _ in self.files.values())

    @property
    def covered(self) -> int:
        return self.total - sum(len(m) for _, m in self.files.values())

    @property
    def percent(self) -> float:
        return 100.0 * self.covered / self.total if self.total else 0.0

    def ok(self, *, threshold: float) -> bool:
        return not (self.unlisted or self.stale or self.idle) and self.percent >= threshold

    def lines(self, *, threshold: float) -> list[str]:
        out = ["library line coverage (verify/linecoverage.py), statements run by some process:"]
        for path, (s, m) in sorted(self.files.items()):
            if s:
                listed = len(self.listed.get(path, []))
                out.append(f"  {path:<36} {len(s) - len(m):>5}/{len(s):<5} {listed} listed")
        missed = self.total - self.covered
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.by_reason.items()))
        out.append(
            f"covered {self.covered}/{self.total} statements = {self.percent:.1f}% "
            f"(threshold {threshold:g}%); {missed} missed: {missed - len(self.unlisted)} listed "
            f"in verify/uncovered.toml ({reasons}), {len(self.unlisted)} unlisted"
        )
        out += [f"UNLISTED {u}" for u in self.unlisted]
        out += [f"STALE {u}" for u in self.stale]
        out += [f"COVERED NOW (remove the entry) {u}" for u in self.idle]
        if self.percent < threshold:
            out.append(f"BELOW THRESHOLD: {self.percent:.1f}% < {threshold:g}%")
        return out

    def as_dict(self) -> dict:
        return {
            "covered": self.covered,
            "total": self.total,
            "percent": round(self.percent, 2),
            "listed_by_reason": dict(self.by_reason),
            "unlisted": self.unlisted,
            "stale": self.stale,
            "covered_now": self.idle,
            "files": {p: {"statements": len(s), "missed": m} for p, (s, m) in self.files.items()},
        }


def check(files: dict[str, tuple[list[int], list[int]]], entries: list[Entry], *, root: Path):
    """Split each file's missed lines into listed and unlisted; find stale and idle entries."""
    cache: dict = {}
    listed: dict[str, set[int]] = {}
    by_reason: dict[str, int] = {}
    idle = []
    for e in entries:
        s = scopes_of(root, e.file, cache)
        lines = s.explained(e) if s is not None and e.scope in s.ranges else set()
        hit = lines & set(files.get(e.file, ((), ()))[1])
        if lines and not hit:
            idle.append(str(e))
        new = hit - listed.get(e.file, set())
        by_reason[e.reason] = by_reason.get(e.reason, 0) + len(new)
        listed.setdefault(e.file, set()).update(hit)
    unlisted = []
    for path, (_, missed) in sorted(files.items()):
        src = scopes_of(root, path, cache)
        for i in missed:
            if i not in listed.get(path, set()):
                text = src.lines[i - 1].strip() if src is not None else ""
                unlisted.append(f"{path}:{i}: {text}")
    return Report(
        files=files,
        listed={p: sorted(v) for p, v in listed.items()},
        unlisted=unlisted,
        stale=stale(entries, root),
        idle=idle,
        by_reason=by_reason,
    )
