"""The house rules that keep the code readable as it grows (docs/design.md §4.3 and §4.2), each
kept by a test here, and each test shown to report a planted violation.

- a stage file (zero/stages/stage*.py) at most 300 lines: stage k+1 reads as a diff of stage k;
- zero/engine.py at most 400 lines, its __init__ at most 40: construction as named steps;
- no file over 500 lines and no function over 80 in reference/, zero/, verify/, measure/,
  paper_figures/ and notebooks/ (NOT_YET_SIZED would name a package with why: none today);
- every package's top level (reference/, zero/, measure/, verify/, paper_figures/, notebooks/) at
  most 20 entries, files and folders: the core, and a folder per role or subject (CROWDED would
  name an exception: none today);
- stage 1 read in context at most 2,000 lines: the paper's idea before the machinery, read in
  one sitting (an afternoon of four hours, at the 500 lines an hour of a careful reading);
- no import cycle inside any package, imports inside functions included; every package a rule
  names exists.

Stage 1 in context is computed from the code, never listed by hand. It is what a reader follows
from the stage, in lines as the other limits count them (a blank line inside what is read is
scrolled past too):
- every class on Stage1's chain of base classes that is defined in zero/, whole: stage k+1 reads
  as a diff of stage k, so the chain is read in full;
- every function and method under zero/ that runs in a small stage-1 step (two ranks; the
  engine's construction, two micro-steps' forward and backward and step(), in deterministic and
  in fast mode), whole, docstring and comments included;
- for a class with a method that runs, its `class` line and docstring;
- the docstring of every module holding any of these.
Declarations outside functions (dataclass fields, module constants) are looked up rather than read
in order, and are not counted; nor is what does not run in the step (other stages, offload, model
parallelism, checkpoints; the torch ops of the update where the compiled loop runs). Not stage
1's own reading, by package: zero/ranks/ (starting ranks, the watchdog and heartbeats: the same
for every stage), zero/common/ (torch-free bookkeeping shared with the instruments: the traffic
counter's records) and zero/workloads/ (the model being trained: applications on the library).

The README's limit (200 lines) is kept by tests/unit/test_docs.py. A file that must exceed its
limit is named in EXCEPTIONS with the reason; none is today.
"""

from __future__ import annotations

import ast
import collections
import importlib.util
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
TOP_LEVEL_MAX = 20
"""Entries at a package's top level, files and folders: a listing read at a glance."""
EXCEPTIONS: dict[str, str] = {}  # repository path -> why it may exceed its limit
STAGE1_MAX_LINES = 2000
"""Stage 1 in context, in lines: a careful reader covers about 500 lines of code and comment an
hour, and one sitting is an afternoon of four hours."""
NOT_STAGE_READING = ("zero/ranks", "zero/common", "zero/workloads")
"""Packages whose code a step runs but a reader of stage 1 does not read (module docstring)."""
PACKAGES = (
    "reference",
    "zero",
    "measure",
    "verify",
    "paper_figures",
    "notebooks",
)


FUNCTION_MAX_LINES = 80
"""No function (or method) longer, decorators left out: one screen and a half."""
NOT_YET_SIZED: dict[str, str] = {}
"""Packages the file and function limits do not name yet, each with why."""
SIZED = tuple(p for p in PACKAGES if p not in NOT_YET_SIZED)
"""The packages whose every file is at most ZERO_FILE_MAX_LINES and every function at most
FUNCTION_MAX_LINES."""
CROWDED: dict[str, tuple[int, str]] = {}
"""Packages whose top level the rule does not hold yet: {package: (its entries when it was named
here, why)}. Once it fits TOP_LEVEL_MAX, its exception goes (test_every_package_top_level_is_short
says so)."""


def long_functions(root: Path, packages=SIZED) -> list[str]:
    """Every function over FUNCTION_MAX_LINES, as 'path:line name: N lines'."""
    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > FUNCTION_MAX_LINES:
                        rel = path.relative_to(root)
                        out.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return out


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def size_problems(root: Path) -> list[str]:
    """Every file over its limit, as 'path: N lines, more than LIMIT'."""
    limits = {}
    for package in SIZED:
        for path in sorted((root / package).rglob("*.py")):
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


def top_level(root: Path, package: str = "zero") -> list[str]:
    """A package's entries, files and folders, as a reader listing it sees them (bytecode caches
    and hidden entries left out)."""
    return sorted(
        p.name
        for p in (root / package).iterdir()
        if p.name != "__pycache__" and not p.name.startswith(".")
    )


def crowded(root: Path, packages=PACKAGES, allowed=CROWDED) -> list[str]:
    """Every package of `packages` whose top level is over TOP_LEVEL_MAX, unless `allowed` names
    it, as 'package/: N entries, more than MAX'; and every one `allowed` names that fits again,
    its exception then stale."""
    if gone := missing(root, packages):
        raise ValueError(f"no such package: {gone}")
    out = []
    for package in packages:
        n = len(top_level(root, package))
        if package not in allowed and n > TOP_LEVEL_MAX:
            out.append(f"{package}/: {n} entries, more than {TOP_LEVEL_MAX}")
        elif package in allowed and n <= TOP_LEVEL_MAX:
            out.append(f"{package}/: {n} entries, within {TOP_LEVEL_MAX}: drop its exception")
    return out


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


def missing(root: Path, packages) -> list[str]:
    """The names in `packages` (folders relative to root) that are not packages of root."""
    return [p for p in packages if not (root / p / "__init__.py").is_file()]


def cycles(root: Path, packages=PACKAGES) -> dict[str, list[str]]:
    """{package: one import cycle} for every package that has one; a package named here that
    does not exist is an error, not a package without cycles."""
    if gone := missing(root, packages):
        raise ValueError(f"no such package: {gone}")
    out = {}
    for package in packages:
        if found := cycle(module_graph(root, package)):
            out[package] = found
    return out


def test_files_stay_within_their_limits():
    assert size_problems(ROOT) == []


def test_no_function_is_over_its_limit():
    assert long_functions(ROOT) == []


def test_a_planted_long_function_is_reported(tree):
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_MAX_LINES))
    (tree / "zero" / "loop.py").write_text(f"import os\n\n\ndef step():\n{body}")
    assert long_functions(tree, ("zero",)) == [
        f"zero/loop.py:4 step: {FUNCTION_MAX_LINES + 1} lines"
    ]


def test_every_package_but_those_named_is_sized():
    assert set(SIZED) | set(NOT_YET_SIZED) == set(PACKAGES) and missing(ROOT, SIZED) == []


# -- stage 1 in context -------------------------------------------------------------------------


def traced(fn, root: Path = ROOT) -> set[tuple[str, int]]:
    """fn() run under sys.setprofile: (path relative to root, first line) of every function
    under root/zero/ that was called in this thread (lambdas and comprehensions included; the
    reading unit holding them is found by reading_lines)."""
    zero, calls = str(root / "zero") + "/", set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(zero):
            code = frame.f_code
            calls.add((str(Path(code.co_filename).relative_to(root)), code.co_firstlineno))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def stage1_step(rank: int, world_size: int) -> set[tuple[str, int]]:
    """What a stage-1 step runs under zero/, on one rank: the engine's construction, two
    micro-steps' forward and backward, and step(), in deterministic and in fast mode (§2.6). The
    model, its data and the config are the user's, made before."""
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine
    from zero.workloads.models import MLP, MLPConfig, mlp_microbatches

    k, calls = 2, set()
    for deterministic in (True, False):
        model = MLP(MLPConfig(d_in=16, d_hidden=48, d_out=4, n_layer=3))
        cfg = ZeroConfig(
            stage=1,
            micro_batches=world_size * k,
            deterministic=deterministic,
            units=tuple(model.unit_names()),
            chunk=128,
        )
        data = mlp_microbatches(model.cfg, seed=0, data_step=0, count=world_size * k, batch_size=4)

        def step(model=model, cfg=cfg, data=data):
            engine = ZeroEngine(model, cfg)
            for i in range(k):
                _, loss = engine(*data[i * world_size + rank])
                engine.backward(loss)
            engine.step()

        calls |= traced(step)
    return calls


def class_chain(cls: type, root: Path = ROOT) -> set[tuple[str, str]]:
    """(path relative to root, class name) of every class on cls's MRO defined under zero/."""
    out = set()
    for c in cls.__mro__:
        path = Path(getattr(sys.modules.get(c.__module__), "__file__", None) or "")
        if path.is_relative_to(root / "zero"):
            out.add((str(path.relative_to(root)), c.__name__))
    return out


def _span(node: ast.AST) -> range:
    first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return range(first, node.end_lineno + 1)


def _docstring(node: ast.AST) -> ast.AST | None:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        return body[0] if isinstance(body[0].value.value, str) else None
    return None


def reading_lines(root: Path, calls, chain) -> dict[str, int]:
    """{file: lines a reader of stage 1 reads there} (the module docstring's rule): the
    classes of `chain` whole; each function or method holding a call of `calls` whole, with its
    class's `class` line and docstring; the module docstring of each file with any of these.
    Files of the NOT_STAGE_READING packages are left out."""
    ran = collections.defaultdict(set)
    for path, line in calls:
        ran[path].add(line)
    for path, _ in chain:
        ran.setdefault(path, set())
    out = {}
    for path, lines_run in sorted(ran.items()):
        if any(Path(path).is_relative_to(p) for p in NOT_STAGE_READING):
            continue
        text = (root / path).read_text()
        tree, read = ast.parse(text), set()
        funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (path, node.name) in chain:
                read.update(_span(node))
            elif isinstance(node, ast.ClassDef):
                hit = [m for m in node.body if isinstance(m, funcs) and lines_run & set(_span(m))]
                for m in hit:
                    read.update(_span(m))
                if hit:
                    doc = _docstring(node)
                    read.update(range(_span(node).start, (doc or node).lineno + 1))
                    read.update(_span(doc) if doc else ())
            elif isinstance(node, funcs) and lines_run & set(_span(node)):
                read.update(_span(node))
        if read:
            doc = _docstring(tree)
            read |= set(_span(doc)) if doc else set()
            out[path] = len(read)
    return out


@pytest.fixture(scope="module")
def stage1_reading() -> dict[str, int]:
    from zero.ranks.local import spawn
    from zero.stages.stage1 import Stage1

    calls = set().union(*spawn(stage1_step, 2))  # the ranks' union: they run the same code
    return reading_lines(ROOT, calls, class_chain(Stage1))


def test_stage_1_reads_in_context_within_its_limit(stage1_reading):
    n = sum(stage1_reading.values())
    assert n <= STAGE1_MAX_LINES, f"stage 1 in context: {n} lines, {stage1_reading}"


def test_stage_1_in_context_is_what_docs_design_says(stage1_reading):
    """The stage, its base, and the modules docs/design.md §4.3 names as what stage 1 calls."""
    for path in (
        "zero/stages/stage1.py",
        "zero/stages/stage0.py",
        "zero/stages/base.py",
        "zero/zero_r/buckets.py",
        "zero/collectives.py",
        "zero/engine.py",
        "zero/optim/update.py",
    ):
        assert path in stage1_reading, path
    assert not any(Path(p).is_relative_to(q) for p in stage1_reading for q in NOT_STAGE_READING)


def test_the_packages_left_out_of_stage_1_exist():
    assert missing(ROOT, NOT_STAGE_READING) == []


def _load(path: Path, name: str, monkeypatch):
    """The module in `path`, imported under `name` (known to sys.modules, as class_chain reads)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_a_planted_call_into_a_new_module_is_counted(tree, monkeypatch):
    stage_py, new_py = Path("zero", "stage.py"), Path("zero", "planted.py")  # new files
    (tree / stage_py).write_text(
        '"""A stage."""\n\n\ndef step(helper=None):\n    return helper() if helper else 1\n'
    )
    (tree / new_py).write_text(
        '"""A planted module."""\n\n\ndef helper():\n    """Called by the stage."""\n    return 2\n'
    )
    stage = _load(tree / stage_py, "planted_stage", monkeypatch)
    helper = _load(tree / new_py, "planted_helper", monkeypatch).helper
    before = reading_lines(tree, traced(stage.step, tree), set())
    after = reading_lines(tree, traced(lambda: stage.step(helper), tree), set())
    assert before == {str(stage_py): 3}
    assert after == {str(stage_py): 3, str(new_py): 4}


def test_a_planted_base_class_is_counted(tree, monkeypatch):
    base_py, new_py = Path("zero", "stages", "stage0.py"), Path("zero", "mixin.py")
    (tree / base_py).write_text(
        '"""Stage 0."""\n\n\nclass Stage0:\n    def step(self):\n        return 0\n'
    )
    (tree / new_py).write_text('"""A planted base."""\n\n\nclass Mixin:\n    x = 1\n')
    base = _load(tree / base_py, "planted_stage0", monkeypatch).Stage0
    mixin = _load(tree / new_py, "planted_mixin", monkeypatch).Mixin
    plain, planted = type("Stage1", (base,), {}), type("Stage1", (mixin, base), {})
    assert reading_lines(tree, set(), class_chain(plain, tree)) == {str(base_py): 4}
    assert reading_lines(tree, set(), class_chain(planted, tree)) == {
        str(base_py): 4,
        str(new_py): 3,
    }


def test_every_package_top_level_is_short():
    assert crowded(ROOT) == [], {p: top_level(ROOT, p) for p in PACKAGES}


def test_the_crowded_packages_are_named_with_a_count_and_a_reason():
    assert set(CROWDED) <= set(PACKAGES)
    for package, (most, why) in CROWDED.items():
        assert most > TOP_LEVEL_MAX and len(why.split()) >= 5, (package, most, why)


def _crowd(package: Path, n: int) -> None:
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    for i in range(n - len(list(package.iterdir()))):
        (package / f"m{i}.py").write_text("")


def test_a_planted_crowded_package_is_reported(tree):
    _crowd(tree / "paper_figures", TOP_LEVEL_MAX)
    (tree / "paper_figures" / "__pycache__").mkdir()
    (tree / "paper_figures" / ".ipynb_checkpoints").mkdir()
    assert crowded(tree, ("zero", "paper_figures"), {}) == []
    (tree / "paper_figures" / "measured").mkdir()  # a folder counts as much as a file
    assert crowded(tree, ("zero", "paper_figures"), {}) == [
        f"paper_figures/: {TOP_LEVEL_MAX + 1} entries, more than {TOP_LEVEL_MAX}"
    ]


def test_only_a_named_package_may_be_crowded_and_a_stale_exception_is_reported(tree):
    _crowd(tree / "verify", TOP_LEVEL_MAX + 2)
    allowed = {"verify": (TOP_LEVEL_MAX + 2, "being restructured by the feature registry")}
    assert crowded(tree, ("zero", "verify"), allowed) == []
    assert crowded(tree, ("zero", "verify"), {}) == [
        f"verify/: {TOP_LEVEL_MAX + 2} entries, more than {TOP_LEVEL_MAX}"
    ]
    assert crowded(tree, ("zero",), {"zero": allowed["verify"]}) == [
        f"zero/: 5 entries, within {TOP_LEVEL_MAX}: drop its exception"
    ]


def test_the_engine_is_built_by_named_steps():
    n = init_lines(ROOT / "zero" / "engine.py")
    assert n <= ENGINE_INIT_MAX_LINES, f"ZeroEngine.__init__: {n} lines"


def test_no_package_has_an_import_cycle():
    assert cycles(ROOT) == {}


def test_a_planted_missing_package_is_reported(tree):
    with pytest.raises(ValueError, match="no such package: \\['apps'\\]"):
        cycles(tree, ("zero", "apps"))


def test_exceptions_name_existing_files_with_a_reason():
    for path, why in EXCEPTIONS.items():
        assert (ROOT / path).is_file(), path
        assert len(why.split()) >= 5, (path, why)


@pytest.fixture
def tree(tmp_path):
    """A small repository that keeps every rule."""
    (tmp_path / "zero" / "stages").mkdir(parents=True)
    (tmp_path / "zero" / "__init__.py").write_text("")
    (tmp_path / "zero" / "engine.py").write_text(
        "class ZeroEngine:\n    def __init__(self):\n        self.a = 1\n"
    )
    (tmp_path / "zero" / "stages" / "stage1.py").write_text("x = 1\n")
    (tmp_path / "zero" / "config.py").write_text("from . import loop\n")
    (tmp_path / "zero" / "loop.py").write_text("import os\n")
    return tmp_path


def test_the_rules_hold_on_a_clean_tree(tree):
    assert size_problems(tree) == [] and cycles(tree, ("zero",)) == {}
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
    assert cycles(tree, ("zero",)) == {"zero": ["zero.config", "zero.loop", "zero.config"]}
