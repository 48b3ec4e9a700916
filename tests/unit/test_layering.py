"""The packages stack in one direction (no package has an import cycle inside: that is
tests/unit/test_house_rules.py's, with this file's cycle finder).

    reference  <-  zero  <-  measure  <-  verify  <-  paper_figures, notebooks

A package may import only the packages below it (and itself): the library (zero) never imports
the instruments that measure it (measure), the harness that checks it (verify), or the figures
and the notebooks' logic (notebooks/teaching/) built on top. Imports inside functions count as
much as module-level ones.
"""

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("reference", "zero", "measure", "verify", ("paper_figures", "notebooks"))
PACKAGES = [p for layer in LAYERS for p in ((layer,) if isinstance(layer, str) else layer)]


def level(package: str) -> int:
    return next(i for i, x in enumerate(LAYERS) if package == x or package in x)


def imports(path: Path, package: str, root: Path | None = None) -> set[str]:
    """Dotted module names that `path` (in `root`, the repository by default) imports
    (absolute, relative resolved), function-level imports included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    root = REPO if root is None else root
    here = [package, *path.relative_to(root / package).with_suffix("").parts]
    if here[-1] == "__init__":
        here.pop()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, `level - 1` packages up
                base = here[: len(here) - node.level + (path.name == "__init__.py")]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            out.add(stem)
            out.update(f"{stem}.{a.name}" for a in node.names)  # `from zero import engine`
    return out


def project_edges() -> list[tuple[str, str, str]]:
    """(file, importing package, imported package) for every import between our packages."""
    edges = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for name in imports(path, package):
                top = name.split(".")[0]
                if top in PACKAGES and top != package:
                    edges.append((str(path.relative_to(REPO)), package, top))
    return edges


def test_every_package_imports_only_the_packages_below_it():
    upward = [e for e in project_edges() if level(e[2]) >= level(e[1])]
    assert upward == [], "imports against the layering (file, from, to): " + repr(upward)


def test_the_layering_check_sees_an_upward_import(tmp_path, monkeypatch):
    """Non-vacuity: a zero module importing measure (inside a function) is reported."""
    fake = tmp_path / "zero"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from measure import bench\n")
    (fake / "ok.py").write_text("from . import bad\nfrom reference import tree\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert imports(fake / "bad.py", "zero") == {"measure", "measure.bench"}
    assert imports(fake / "ok.py", "zero") == {"zero", "zero.bad", "reference", "reference.tree"}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (depth-first search with colours)."""
    colour, stack = {}, []

    def visit(n):
        colour[n] = "grey"
        stack.append(n)
        for m in sorted(graph[n]):
            if colour.get(m) == "grey":
                return stack[stack.index(m) :] + [m]
            if m not in colour and (found := visit(m)):
                return found
        colour[n] = "black"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in colour and (found := visit(n)):
            return found
    return None


@pytest.mark.parametrize(
    "graph, has_cycle",
    [({"a": {"b"}, "b": {"c"}, "c": set()}, False), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)],
)
def test_the_cycle_finder_finds_cycles(graph, has_cycle):
    assert (cycle(graph) is not None) == has_cycle
