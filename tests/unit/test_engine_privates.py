"""Helpers outside the engine read no private attribute of it.

The engine's private names are computed from the code, never listed by hand: every `self._x`
that zero/engine.py's ZeroEngine (or one of its base classes defined in this repository) assigns,
and every `_x` method they define. No other Python file under the scanned folders may touch
`<anything>._x` for one of those names (nor getattr/setattr/hasattr/delattr it by a literal
name): a helper that needs the engine's state reads a public accessor or is passed the value.

Not reports: `self._x` inside the engine's own classes, and `self._x` / `cls._x` inside another
class that itself assigns or defines `_x` (that class's own attribute of the same name).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ("zero/engine.py", "ZeroEngine")
SCANNED = ("zero", "verify", "measure", "paper_figures", "notebooks", "tests")
NAMED_ACCESS = ("getattr", "setattr", "hasattr", "delattr")

KNOWN_IN_VERIFY: set[tuple[str, str]] = set()
"""(path, attribute) of verify/'s reads of engine privates: being removed (verify/ is another
engineer's to change). Each must still be found, or it is stale here."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _module_file(root: Path, path: str, node: ast.ImportFrom) -> Path | None:
    """The repository file an import names (relative or absolute), if it is one."""
    if node.level:
        base = (root / path).parent
        for _ in range(node.level - 1):
            base = base.parent
    else:
        base = root
    parts = (node.module or "").split(".") if node.module else []
    target = base.joinpath(*parts)
    for candidate in (target.with_suffix(".py"), target / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _class_chain(root: Path, path: str, name: str) -> list[tuple[str, ast.ClassDef]]:
    """(path, class) of `name` in `path` and its base classes defined in this repository."""
    tree = ast.parse((root / path).read_text(), filename=path)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if name not in classes:
        return []
    cls, out = classes[name], [(path, classes[name])]
    imported = {
        a.asname or a.name: node
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue  # nn.Module and the like: not this repository's
        if base.id in classes:
            out += _class_chain(root, path, base.id)
        elif base.id in imported:
            found = _module_file(root, path, imported[base.id])
            if found is not None:
                out += _class_chain(root, found.relative_to(root).as_posix(), base.id)
    return out


def _own_names(cls: ast.ClassDef) -> set[str]:
    """The private names a class defines as methods or assigns to `self.` anywhere in it."""
    names = {
        n.name
        for n in cls.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and _private(n.name)
    }
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and _private(node.attr)
        ):
            names.add(node.attr)
    return names


def engine_privates(root: Path = ROOT) -> set[str]:
    """The engine's private attribute and method names, from its classes' code."""
    chain = _class_chain(root, *ENGINE)
    assert chain, f"{ENGINE[1]} not found in {ENGINE[0]}"
    return set().union(*(_own_names(cls) for _, cls in chain))


class _Reads(ast.NodeVisitor):
    """Accesses to one of `names` in one file, with the enclosing class's own names excused."""

    def __init__(self, names: set[str], engine_classes: set[str]):
        self.names, self.engine_classes = names, engine_classes
        self.classes: list[tuple[str, set[str]]] = []
        self.found: list[tuple[int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append((node.name, _own_names(node)))
        self.generic_visit(node)
        self.classes.pop()

    def _excused(self, receiver: ast.expr, name: str) -> bool:
        if not (isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")):
            return False
        if not self.classes:
            return False
        cls, own = self.classes[-1]
        return cls in self.engine_classes or name in own

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.names and not self._excused(node.value, node.attr):
            self.found.append((node.lineno, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if (
            isinstance(f, ast.Name)
            and f.id in NAMED_ACCESS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in self.names
            and not self._excused(node.args[0], node.args[1].value)
        ):
            self.found.append((node.lineno, node.args[1].value))
        self.generic_visit(node)


def private_reads(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(path, line, name) of every access to an engine private outside the engine's classes."""
    names = engine_privates(root)
    chain = _class_chain(root, *ENGINE)
    engine_files = {path: set() for path, _ in chain}
    for path, cls in chain:
        engine_files[path].add(cls.name)
    out = []
    for folder in SCANNED:
        for file in sorted((root / folder).rglob("*.py")):
            path = file.relative_to(root).as_posix()
            reads = _Reads(names, engine_files.get(path, set()))
            reads.visit(ast.parse(file.read_text(), filename=path))
            out += [(path, line, name) for line, name in reads.found]
    return out


def test_the_engine_has_private_names_to_guard():
    names = engine_privates()
    assert {"_losses", "_stage_of", "_next"} <= names, names


def test_no_file_outside_the_engine_touches_its_private_attributes():
    found = private_reads()
    unknown = [r for r in found if (r[0], r[2]) not in KNOWN_IN_VERIFY]
    assert not unknown, "engine privates read outside it (add a public accessor):\n" + "\n".join(
        f"{p}:{line}: ._{name.lstrip('_')}" for p, line, name in unknown
    )
    stale = KNOWN_IN_VERIFY - {(p, name) for p, _, name in found}
    assert not stale, f"KNOWN_IN_VERIFY lists reads no longer there: {sorted(stale)}"
    assert all(p.startswith("verify/") for p, _ in KNOWN_IN_VERIFY)


def test_a_planted_read_is_reported(tmp_path):
    """The rule can fail: a tree with an engine whose private a helper reads, and one whose
    helper keeps to the public accessor."""
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "base.py").write_text(
        "class Base:\n    def _from_base(self):\n        return self._hidden\n"
    )
    (tmp_path / "zero" / "engine.py").write_text(
        "from torch import nn\n"
        "from .base import Base\n\n\n"
        "class ZeroEngine(Base, nn.Module):\n"
        "    def __init__(self):\n"
        "        self._losses, self.public = [], 1\n\n"
        "    def _launch(self):\n"
        "        return self._losses\n\n"
        "    @property\n"
        "    def losses(self):\n"
        "        return tuple(self._losses)\n"
    )
    (tmp_path / "zero" / "helper.py").write_text(
        "class Other:\n"
        "    def __init__(self):\n"
        "        self._launch = None\n\n"
        "    def go(self, engine):\n"
        "        return self._launch, engine.losses, engine.public\n"
    )
    assert engine_privates(tmp_path) == {"_losses", "_launch", "_from_base"}
    assert private_reads(tmp_path) == []
    (tmp_path / "tests").mkdir()
    planted = "test_x.py"  # a file of the temporary tree only
    (tmp_path / "tests" / planted).write_text(
        "def f(engine):\n"
        "    engine._launch()\n"
        "    return getattr(engine, '_losses'), engine._from_base\n"
    )
    (tmp_path / "verify").mkdir()
    reader = "cell.py"  # a file of the temporary tree only
    (tmp_path / "verify" / reader).write_text(
        "class Cell:\n    def run(self):\n        return self._losses\n"
    )
    assert private_reads(tmp_path) == [
        (f"verify/{reader}", 3, "_losses"),
        (f"tests/{planted}", 2, "_launch"),
        (f"tests/{planted}", 3, "_losses"),
        (f"tests/{planted}", 3, "_from_base"),
    ]
