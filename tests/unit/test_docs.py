"""Citations into the docs resolve, and no text points outside the repository.

`scan(root)` returns every broken reference under `root` as a line of text:
- `docs/<name>.md §N[.M]` (also `<name>.md §N` inside docs/) names a file of docs/ and a numbered
  heading in it (`## 2. …`, `### 1.3 …`);
- every `docs/<name>.md` mention, and every relative Markdown link `[…](path#anchor)` in a .md file,
  names a file that exists (and a heading whose anchor is `anchor`);
- an upper-case Markdown name (such as `STATUS.md`) names a file in the repository;
- no text names a path outside the repository (a `../shared` folder, an absolute `/work/` path).
The tests run it on the repository and, to show it can fail, on planted files.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".ipynb", ".md"}
SKIP_DIRS = {"__pycache__", "node_modules", "results", "runs"}
README_MAX_LINES = 200  # the house rule: a newcomer reads it in minutes

CITATION = re.compile(r"(?<![\w/.])(docs/)?([a-z][a-z0-9_]*)\.md ?§ ?(\d+(?:\.\d+)?)")
DOCS_MENTION = re.compile(r"(?<![\w/.])docs/([a-z][a-z0-9_]*)\.md")
LINK = re.compile(r"\]\(([^)\s]+)\)")
UPPER_MD = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[A-Z][A-Z0-9_]*\.md)\b")
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:reference|zero|measure|verify|paper_figures|tools|tests|notebooks"
    r"|benchmarks|docs)/[\w/.-]*\w\.(?:py|md|ipynb))\b"
)
HISTORY = ("CHANGELOG.md",)  # a changelog names files as they were when it was written
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])/" + r"work/")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
NUMBERED = re.compile(r"^(\d+(?:\.\d+)*)\.?(?:\s|$)")


def files(root: Path) -> list[Path]:
    """The .py, .ipynb and .md files under root, outside hidden and generated folders, and not
    this file (its planted examples are broken on purpose)."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if any(p.startswith(".") or p in SKIP_DIRS for p in rel[:-1]):
            continue
        if path.resolve() == Path(__file__).resolve():
            continue
        if path.suffix in SUFFIXES and path.is_file():
            out.append(path)
    return out


def text_of(path: Path) -> str:
    """A file's text; for a notebook, its cells' sources (outputs are stripped in git anyway)."""
    raw = path.read_text(encoding="utf-8")
    if path.suffix != ".ipynb":
        return raw
    cells = json.loads(raw).get("cells", [])
    return "\n".join("".join(c.get("source", [])) for c in cells)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def headings(path: Path) -> tuple[set[str], set[str]]:
    """(section numbers, anchors) of a Markdown file's headings, outside code fences."""
    numbers, anchors, fenced = set(), set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if m:
            title = m.group(2)
            anchors.add(slug(title))
            n = NUMBERED.match(title)
            if n:
                numbers.add(n.group(1))
    return numbers, anchors


def scan(root: Path) -> list[str]:
    """Every broken citation, link or outside reference under root, one line each."""
    paths = files(root)
    md_names = {p.name for p in paths if p.suffix == ".md"}
    md_paths = {str(p.relative_to(root)) for p in paths if p.suffix == ".md"}
    docs = root / "docs"
    problems = []
    for path in paths:
        rel = path.relative_to(root)
        text = text_of(path)
        in_docs = rel.parts[0] == "docs"
        for m in CITATION.finditer(text):
            if not (m.group(1) or in_docs):
                continue
            target = docs / f"{m.group(2)}.md"
            if not target.is_file():
                problems.append(f"{rel}: {m.group(0)!r} cites a missing file")
            elif m.group(3) not in headings(target)[0]:
                problems.append(f"{rel}: {m.group(0)!r} cites a section that is not there")
        for m in DOCS_MENTION.finditer(text):
            if not (docs / f"{m.group(1)}.md").is_file():
                problems.append(f"{rel}: {m.group(0)!r} names a missing file")
        for m in UPPER_MD.finditer(text):
            name = m.group(1)
            known = name in md_paths if "/" in name else name in md_names
            if not known:
                problems.append(f"{rel}: {name!r} is not a file of this repository")
        for m in REPO_PATH.finditer(text):
            if str(rel) not in HISTORY and not (root / m.group(1)).exists():
                problems.append(f"{rel}: {m.group(1)!r} is not a file of this repository")
        for m in OUTSIDE.finditer(text):
            problems.append(f"{rel}: {m.group(0)!r} points outside the repository")
        if path.suffix == ".md":
            problems += broken_links(root, path, text)
    readme = root / "README.md"
    if readme.is_file():
        lines = len(readme.read_text(encoding="utf-8").splitlines())
        if lines > README_MAX_LINES:
            problems.append(f"README.md: {lines} lines, more than {README_MAX_LINES}")
    return problems


def broken_links(root: Path, path: Path, text: str) -> list[str]:
    """Relative Markdown links of one file whose target (or heading anchor) does not exist."""
    out = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = path.relative_to(root)
        if not dest.exists():
            out.append(f"{rel}: link {target!r} names a missing file")
        elif anchor and dest.suffix == ".md" and anchor not in headings(dest)[1]:
            out.append(f"{rel}: link {target!r} names a missing heading")
    return out


def test_every_citation_and_link_in_the_repository_resolves():
    assert scan(ROOT) == []


def test_the_docs_keep_the_section_numbers_code_cites():
    assert {"1", "2", "3", "4", "5"} <= headings(ROOT / "docs" / "design.md")[0]
    want = {f"1.{i}" for i in range(1, 11)} | {"1", "2"}
    assert want <= headings(ROOT / "docs" / "paper.md")[0]


# -- the scanner can fail ------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# D\n\n## 2. Contract\n\n### 2.1 Tree\n")
    (tmp_path / "README.md").write_text("See [the design](docs/design.md#2-contract).\n")
    (tmp_path / "ok.py").write_text('"""docs/design.md §2 and docs/design.md §2.1."""\n')
    return tmp_path


def test_a_clean_tree_passes(repo):
    assert scan(repo) == []


@pytest.mark.parametrize(
    "text, why",
    [
        ('"""docs/design.md §7"""', "section that is not there"),
        ('"""docs/design.md §2.4"""', "section that is not there"),
        ('"""docs/desgin.md §2"""', "missing file"),
        ('"""see docs/nowhere.md"""', "missing file"),
        ('"""see ' + "DESIGN" + '.md §2"""', "not a file of this repository"),
        ('"""see ../' + "shared/PAPER" + '.md"""', "outside the repository"),
        ('"""see /' + 'work/shared/x"""', "outside the repository"),
        ('"""see zero/stage9.py"""', "not a file of this repository"),
    ],
)
def test_a_planted_bad_reference_is_reported(repo, text, why):
    (repo / "bad.py").write_text(text + "\n")
    problems = scan(repo)
    assert problems and all(p.startswith("bad.py") for p in problems)
    assert any(why in p for p in problems)


def test_a_broken_link_or_anchor_and_a_long_readme_are_reported(repo):
    (repo / "docs" / "x.md").write_text("[a](design.md#3-engine) [b](missing.md)\n")
    (repo / "README.md").write_text("line\n" * (README_MAX_LINES + 1))
    problems = scan(repo)
    assert any("missing heading" in p for p in problems)
    assert any("'missing.md' names a missing file" in p for p in problems)
    assert any(p.startswith("README.md:") and "lines" in p for p in problems)


def test_a_notebook_citation_is_checked(repo):
    nb = {"cells": [{"cell_type": "markdown", "source": ["docs/design.md §9"]}]}
    (repo / "n.ipynb").write_text(json.dumps(nb))
    assert any("n.ipynb" in p for p in scan(repo))
