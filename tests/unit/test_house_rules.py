"""The house rules that keep the code readable as it grows (docs/design.md §4.3 and §4.2), each
kept by a test here, and each test shown to report a planted violation.

- a stage file (zero/stages/stage*.py) at most 300 lines: stage k+1 reads as a diff of stage k;
- zero/engine.py at most 400 lines, its __init__ at most 40: construction as named steps;
- no file in zero/ over 500 lines;
- zero/'s top level at most 20 entries: the core, and a folder per role;
- stage 1 read in context (STAGE1_CONTEXT) at most 1,700 lines: the paper's idea before the
  machinery;
- no import cycle inside any package, imports inside functions included.

The README's limit (200 lines) is kept by tests/unit/test_docs.py. A file that must exceed its
limit is named in EXCEPTIONS with the reason; none is today.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_layering import cycle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STAGE_FILE_MAX_LINES = 300
ENGINE_MAX_LINES = 400
ENGINE_INIT_MAX_LINES = 40
ZERO_FILE_MAX_LINES = 500
ZERO_TOP_LEVEL_MAX = 20
EXCEPTIONS: dict[str, str] = {}  # repository path -> why it may exceed its limit
STAGE1_CONTEXT = (
    "zero/stages/stage1.py", "zero/stages/base.py", "zero/unit.py", "zero/partition.py",
    "zero/collectives.py", "zero/engine.py", "zero/optim/update.py", "zero/config.py",
)  # fmt: skip
"""Stage 1 in context, its direct path: the stage, its base, the unit and its partition, the
collectives it calls, the engine that runs it, the update and the config it reads."""
STAGE1_CONTEXT_MAX_LINES = 1700
PACKAGES = (
    "reference",
    "zero",
    "measure",
    "verify",
    "paper_figures",
    "notebooks",
    "apps",
)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def size_problems(root: Path) -> list[str]:
    """Every file over its limit, as 'path: N lines, more than LIMIT'."""
    limits = {}
    for path in sorted((root / "zero").rglob("*.py")):
        limits[path] = ZERO_FILE_MAX_LINES
    for path in sorted((root / "zero" / "stages").glob("stage*.py")):
        limits[path] = STAGE_FILE_MAX_LINES
    if (root / "zero" / "engine.py").exists():
        limits[root / "zero" / "engine.py"] = ENGINE_MAX_LINES
    out = []
    for path, limit in limits.items():
        rel = str(path.relative_to(root))
        if rel not in EXCEPTIONS and (n := lines(path)) > limit:
            out.append(f"{rel}: {n} lines, more than {limit}")
    return out


def top_level(root: Path) -> list[str]:
    """zero/'s entries, files and folders, as a reader listing it sees them."""
    return sorted(p.name for p in (root / "zero").iterdir() if p.name != "__pycache__")


def init_lines(path: Path, cls: str = "ZeroEngine") -> int:
    """Lines of cls.__init__ in path, its signature and docstring included."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return item.end_lineno - item.lineno + 1
    raise AssertionError(f"{path}: no {cls}.__init__")


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Modules of `package` and the modules of it each one imports, at any depth of the code.
    `from pkg import name` depends on pkg.name where that is a module, else on pkg's __init__;
    `import a.b` on a.b and on each package above it but the module's own."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = [package, *path.relative_to(root / package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        # the package a relative import starts from: the module's own, or the __init__'s
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    deps.update(".".join(parts[: i + 1]) for i in range(len(parts)))
                    # a module's own packages are initialising already when it runs
                    deps -= {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")))}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    deps.add(f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem)
        graph[name] = {m for m in deps if m in modules and m != name}
    return graph


def cycles(root: Path) -> dict[str, list[str]]:
    """{package: one import cycle} for every package that has one."""
    out = {}
    for package in PACKAGES:
        if (root / package).is_dir() and (found := cycle(module_graph(root, package))):
            out[package] = found
    return out


def test_files_stay_within_their_limits():
    assert size_problems(ROOT) == []


def context_lines(root: Path, files=STAGE1_CONTEXT) -> int:
    """Lines a reader reads to follow stage 1 through the code it calls."""
    return sum(lines(root / f) for f in files)


def test_stage_1_reads_in_context_within_its_limit():
    n = context_lines(ROOT)
    assert n <= STAGE1_CONTEXT_MAX_LINES, f"stage 1 in context: {n} lines"


def test_a_planted_long_context_is_counted(tree):
    for f in STAGE1_CONTEXT:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        (tree / f).write_text("x = 1\n" * (STAGE1_CONTEXT_MAX_LINES // len(STAGE1_CONTEXT) + 1))
    assert context_lines(tree) > STAGE1_CONTEXT_MAX_LINES


def test_zero_top_level_is_short():
    entries = top_level(ROOT)
    assert len(entries) <= ZERO_TOP_LEVEL_MAX, entries


def test_a_planted_crowded_top_level_is_counted(tree):
    for i in range(ZERO_TOP_LEVEL_MAX):
        (tree / "zero" / f"m{i}.py").write_text("")
    assert len(top_level(tree)) > ZERO_TOP_LEVEL_MAX


def test_the_engine_is_built_by_named_steps():
    n = init_lines(ROOT / "zero" / "engine.py")
    assert n <= ENGINE_INIT_MAX_LINES, f"ZeroEngine.__init__: {n} lines"


def test_no_package_has_an_import_cycle():
    assert cycles(ROOT) == {}


def test_exceptions_name_existing_files_with_a_reason():
    for path, why in EXCEPTIONS.items():
        assert (ROOT / path).is_file(), path
        assert len(why.split()) >= 5, (path, why)


@pytest.fixture
def tree(tmp_path):
    """A small repository that keeps every rule."""
    (tmp_path / "zero" / "stages").mkdir(parents=True)
    (tmp_path / "zero" / "engine.py").write_text(
        "class ZeroEngine:\n    def __init__(self):\n        self.a = 1\n"
    )
    (tmp_path / "zero" / "stages" / "stage1.py").write_text("x = 1\n")
    (tmp_path / "zero" / "config.py").write_text("from . import loop\n")
    (tmp_path / "zero" / "loop.py").write_text("import os\n")
    return tmp_path


def test_the_rules_hold_on_a_clean_tree(tree):
    assert size_problems(tree) == [] and cycles(tree) == {}
    assert init_lines(tree / "zero" / "engine.py") == 2


@pytest.mark.parametrize(
    "path, limit",
    [
        ("zero/stages/stage1.py", STAGE_FILE_MAX_LINES),
        ("zero/engine.py", ENGINE_MAX_LINES),
        ("zero/config.py", ZERO_FILE_MAX_LINES),
    ],
)
def test_a_planted_long_file_is_reported(tree, path, limit):
    (tree / path).write_text("x = 1\n" * (limit + 1))
    assert size_problems(tree) == [f"{path}: {limit + 1} lines, more than {limit}"]


def test_a_planted_long_init_is_counted(tree):
    body = "".join(f"        self.a{i} = {i}\n" for i in range(ENGINE_INIT_MAX_LINES))
    (tree / "zero" / "engine.py").write_text(f"class ZeroEngine:\n    def __init__(self):\n{body}")
    assert init_lines(tree / "zero" / "engine.py") == ENGINE_INIT_MAX_LINES + 1


def test_a_planted_cycle_through_a_function_level_import_is_reported(tree):
    (tree / "zero" / "loop.py").write_text("def f():\n    from .config import g\n")
    assert cycles(tree) == {"zero": ["zero.config", "zero.loop", "zero.config"]}
