"""Notebook tools: the git policy (outputs stripped), the generated index, execution, and
figure inspection.

Used by tests/notebooks/test_notebooks.py (as ``from notebooks import tool``) and by
``make strip-notebooks``; from the repository root:

    python -m notebooks.tool strip notebooks/*.ipynb   # strip outputs in place
    python -m notebooks.tool check notebooks/*.ipynb   # exit 1 if any has outputs
    python -m notebooks.tool index                     # write notebooks/README.md
    python -m notebooks.tool index --check             # exit 1 if notebooks/README.md is stale

The index (``index_markdown``) is generated from the notebooks themselves: each one's title is
its first Markdown heading and its summary the first paragraph after it, so the index cannot
list a notebook that does not exist, or miss one that does.

Execution (``execute_notebook``) runs a notebook in a fresh kernel of *this* interpreter with
``ZERO_NOTEBOOK_PROFILE`` set (``small`` in tests), ``MPLBACKEND=Agg``, and the repository first
on ``PYTHONPATH`` (so ``from notebooks import teaching`` is this checkout's). With Agg, figures
stay open after each cell (the inline backend would close them), so one extra cell appended at
the end can describe every open matplotlib Figure (``describe_figures``) as one
``__FIGURES__ <json>`` line.
``check_figures`` then asserts that each figure has axes with data, labels and a title.

nbformat and nbclient are imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
INDEX_PATH = REPO_ROOT / "notebooks" / "README.md"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
FIGURES_MARKER = "__FIGURES__"
KERNEL_NAME = "python3"
# Per-cell metadata that execution adds (nbclient's timings, the ExecuteTime extension).
TRANSIENT_CELL_METADATA = ("execution", "ExecuteTime")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def notebook_paths(directory: Path = NOTEBOOKS_DIR) -> list[Path]:
    """Every notebook in ``directory``, sorted by name (so a new notebook is covered at once)."""
    return sorted(directory.glob("*.ipynb"))


# ---------------------------------------------------------------------------------------------
# Policy: notebooks are stored in git without outputs.


def has_outputs(nb: Any) -> list[str]:
    """What stops ``nb`` from being stored as is: one line per problem, naming the cell index.

    An empty list means the notebook is clean: no code cell has outputs, an execution count or
    execution timings, and the notebook metadata holds no widget state and no ``language_info``
    beyond its name (a kernel writes its Python version there, which differs between machines).
    """
    problems = []
    metadata = nb.get("metadata", {})
    if "widgets" in metadata:
        problems.append("notebook metadata: has 'widgets' state")
    extra_language_info = sorted(set(metadata.get("language_info", {})) - {"name"})
    if extra_language_info:
        problems.append(f"notebook metadata: language_info from a kernel {extra_language_info}")
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        outputs = cell.get("outputs") or []
        if outputs:
            kinds = sorted({out.get("output_type", "?") for out in outputs})
            problems.append(f"cell {index}: {len(outputs)} output(s) ({', '.join(kinds)})")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {index}: execution_count is {cell['execution_count']}")
        transient = [key for key in TRANSIENT_CELL_METADATA if key in cell.get("metadata", {})]
        if transient:
            problems.append(f"cell {index}: execution metadata {transient}")
    return problems


def strip(nb: Any) -> Any:
    """Remove outputs, execution counts, execution timings, widget state and the kernel's
    ``language_info`` (all but its name), in place.

    Returns ``nb`` itself, so ``has_outputs(strip(nb)) == []``.
    """
    metadata = nb.get("metadata", {})
    metadata.pop("widgets", None)
    if "language_info" in metadata:
        metadata["language_info"] = {
            key: value for key, value in metadata["language_info"].items() if key == "name"
        }
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        cell["outputs"] = []
        cell["execution_count"] = None
        metadata = cell.get("metadata", {})
        for key in TRANSIENT_CELL_METADATA:
            metadata.pop(key, None)
    return nb


# ---------------------------------------------------------------------------------------------
# Figure inspection.


def describe_figures() -> list[dict]:
    """Describe every open pyplot figure as JSON-ready dicts.

    This function runs *inside the notebook's kernel*: ``figure_probe_source`` ships its source as
    the last cell, so it must stay self-contained (imports inside, no module globals).

    Each figure is ``{"num", "suptitle", "axes": [...]}``, each axes ``{"title", "xlabel",
    "ylabel", "n_lines", "n_patches", "n_collections", "n_images", "n_texts", "has_data",
    "is_colorbar"}``. ``title`` joins the left, centre and right titles. ``has_data`` is true for
    a line with at least one point, any patch, a non-empty collection, an image or a bar container.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer

    def collection_has_data(collection):
        try:
            if isinstance(collection, PathCollection):  # scatter: one marker path, N offsets
                return len(collection.get_offsets()) > 0
            return len(collection.get_paths()) > 0
        except Exception:
            return False

    def line_has_points(line):
        try:
            return np.asarray(line.get_xdata()).size > 0
        except Exception:
            return False

    figures = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        suptitle = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else ""
        axes = []
        for ax in fig.axes:
            titles = [ax.get_title(loc=loc) for loc in ("left", "center", "right")]
            lines = ax.get_lines()
            has_data = (
                any(line_has_points(line) for line in lines)
                or len(ax.patches) > 0
                or any(collection_has_data(c) for c in ax.collections)
                or len(ax.images) > 0
                or any(isinstance(c, BarContainer) for c in ax.containers)
            )
            axes.append(
                {
                    "title": " | ".join(str(t) for t in titles if t),
                    "xlabel": str(ax.get_xlabel()),
                    "ylabel": str(ax.get_ylabel()),
                    "n_lines": len(lines),
                    "n_patches": len(ax.patches),
                    "n_collections": len(ax.collections),
                    "n_images": len(ax.images),
                    "n_texts": len(ax.texts),
                    "has_data": bool(has_data),
                    "is_colorbar": getattr(ax, "_colorbar", None) is not None,
                }
            )
        figures.append({"num": int(num), "suptitle": str(suptitle), "axes": axes})
    return figures


def figure_probe_source() -> str:
    """Source of the cell appended to a notebook: prints one ``__FIGURES__ <json>`` line."""
    return (
        inspect.getsource(describe_figures)
        + "\n\nimport json as _json\n"
        + f"print({FIGURES_MARKER!r}, _json.dumps(describe_figures()), flush=True)\n"
    )


def parse_figures(executed_nb: Any) -> list[dict]:
    """The figure descriptions printed by the probe cell (the last cell of ``executed_nb``)."""
    cell = executed_nb.cells[-1]
    stdout = "".join(
        out.get("text", "")
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )
    lines = [line for line in stdout.splitlines() if line.startswith(FIGURES_MARKER + " ")]
    if len(lines) != 1:
        raise AssertionError(
            f"the figure probe printed {len(lines)} {FIGURES_MARKER} lines, expected 1; "
            f"its outputs were: {cell.get('outputs')!r}"
        )
    return json.loads(lines[0][len(FIGURES_MARKER) + 1 :])


def check_figures(figures: list[dict], *, where: str = "notebook") -> None:
    """Assert that the notebook drew something readable; list every problem if not.

    At least one figure; each figure has axes; each axes (colorbars aside) has data, an x or y
    label, and a title of its own or its figure's suptitle.
    """
    problems = []
    if not figures:
        problems.append("no matplotlib figure was open at the end of the notebook")
    for fig in figures:
        name = f"figure {fig['num']}" + (f" ({fig['suptitle']!r})" if fig["suptitle"] else "")
        axes = [ax for ax in fig["axes"] if not ax.get("is_colorbar")]
        if not axes:
            problems.append(f"{name}: has no axes")
        for index, ax in enumerate(axes):
            tag = f"{name}, axes {index}" + (f" ({ax['title']!r})" if ax["title"] else "")
            if not ax["has_data"]:
                problems.append(
                    f"{tag}: no data (no line with points, patch, non-empty collection, image or"
                    " bars)"
                )
            if not (ax["xlabel"].strip() or ax["ylabel"].strip()):
                problems.append(f"{tag}: neither an x label nor a y label")
            if not (ax["title"].strip() or fig["suptitle"].strip()):
                problems.append(f"{tag}: no title, and the figure has no suptitle")
    if problems:
        raise AssertionError(f"{where}: " + "\n  ".join(["figures fail the checks:", *problems]))


# ---------------------------------------------------------------------------------------------
# Execution.


def _runs_this_interpreter(argv0: str) -> bool:
    """Would a kernel started with ``argv0`` run ``sys.executable``, in the same environment?"""
    # jupyter_client itself replaces a bare python/pythonX/pythonX.Y with sys.executable.
    major, minor = sys.version_info[:2]
    if argv0 in {"python", f"python{major}", f"python{major}.{minor}"}:
        return True
    found = shutil.which(argv0) or argv0
    # A venv's python is a symlink to the base interpreter, and only the venv's own launcher puts
    # the venv on sys.path: so compare the launcher's folder as well as the file.
    try:
        return Path(found).absolute().parent == Path(sys.executable).absolute().parent and (
            os.path.samefile(found, sys.executable)
        )
    except OSError:
        return False


def native_kernel_runs_this_interpreter() -> bool:
    """True if the ``python3`` kernelspec that Jupyter finds starts ``sys.executable``."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        return False
    return bool(spec.argv) and _runs_this_interpreter(spec.argv[0])


def write_kernelspec(jupyter_dir: Path) -> Path:
    """Write a ``python3`` kernelspec for ``sys.executable`` under ``jupyter_dir/kernels``.

    With ``jupyter_dir`` first on ``JUPYTER_PATH`` it shadows any other ``python3`` kernelspec.
    """
    spec_dir = Path(jupyter_dir) / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python {sys.version_info[0]} (tests)",
        "language": "python",
        "metadata": {"debugger": False},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return spec_dir


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def kernel_for_this_interpreter(*, force_kernelspec: bool = False) -> Iterator[None]:
    """Within the block, kernel ``python3`` runs ``sys.executable``; kernels inherit os.environ.

    If the ``python3`` kernelspec Jupyter finds would start another interpreter (or
    ``force_kernelspec``), a temporary one is written and put first on ``JUPYTER_PATH``.
    """
    if not force_kernelspec and native_kernel_runs_this_interpreter():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="zero-kernelspec-") as tmp:
        write_kernelspec(Path(tmp))
        path = os.pathsep.join(p for p in (tmp, os.environ.get("JUPYTER_PATH", "")) if p)
        with patched_environ({"JUPYTER_PATH": path}):
            yield


def execute_notebook(
    path: Path | str, profile: str = "small", *, timeout: int = 600
) -> tuple[Any, list[dict]]:
    """Execute the notebook at ``path`` and return ``(executed_nb, figures)``.

    The notebook runs in its own folder, in a fresh kernel of this interpreter, with
    ``ZERO_NOTEBOOK_PROFILE=profile``, ``MPLBACKEND=Agg`` and the repository first on
    ``PYTHONPATH`` (so ``from notebooks import teaching`` finds this checkout's package from the
    notebook's folder, installed or not). A probe cell appended at the end describes the open
    figures (see ``describe_figures``). A cell that raises propagates as nbclient's
    ``CellExecutionError``, which shows the cell and its traceback. The file on disk is not
    modified.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(figure_probe_source()))
    env = {
        "ZERO_NOTEBOOK_PROFILE": profile,
        "MPLBACKEND": "Agg",
        # debugpy warns about frozen modules on every kernel start; the tests never debug.
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    with patched_environ(env), kernel_for_this_interpreter():
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name=KERNEL_NAME,
            resources={"metadata": {"path": str(path.parent)}},
        )
        try:
            client.execute()
        except CellExecutionError as error:
            # Same error, readable in a terminal log: without the kernel's colour codes, and naming
            # the notebook.
            message = _ANSI_ESCAPE.sub("", str(error))
            message += f"\nwhile executing {path.name} with profile {profile!r}"
            raise CellExecutionError(message, error.ename, error.evalue) from None
    return nb, parse_figures(nb)


# ---------------------------------------------------------------------------------------------
# The index: notebooks/README.md, generated from the notebooks

INDEX_HEAD = """\
# Notebooks

Notebooks that teach ZeRO (Rajbhandari et al.,
[arXiv 1910.02054](https://arxiv.org/abs/1910.02054)) and reproduce its results with this
codebase, numbered in reading order. Every one runs on a laptop CPU; none needs a GPU. This index
is generated from the notebooks by `python -m notebooks.tool index` (a test checks that it is
current): each title is the notebook's first heading, each summary the start of its first
paragraph. Their logic lives beside them, in `teaching/` (`from notebooks import teaching`).

| notebook | title | summary |
|---|---|---|
"""

INDEX_TAIL = """
## Running them

```bash
.venv/bin/pip install -e '.[notebooks]'    # jupyter, for reading and editing them
.venv/bin/jupyter lab notebooks/
```

- **Profiles.** `ZERO_NOTEBOOK_PROFILE=small` is what `tests/notebooks/test_notebooks.py` uses:
  fewer ranks and steps, under a minute each. Unset, a notebook runs its `full` profile.
- **Figures.** Each notebook saves its figures as PNG to `notebooks/figures/`, named after it.
- **Stored without outputs.** Notebooks are committed stripped (`make strip-notebooks`); a test
  checks it.
- **Exercises.** Replace the `raise NotImplementedError` in an exercise cell with your code and
  run the checking cell below it. Until you write one, the check runs the collapsed solution and
  says so.
"""


def _first_heading_and_paragraph(nb: Any) -> tuple[str, str]:
    """The first Markdown heading's text and the first paragraph after it, on one line."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("#"):
                title = line.lstrip("#").strip()
                paragraph: list[str] = []
                for rest in lines[i + 1 :]:
                    if rest.strip():
                        paragraph.append(rest.strip())
                    elif paragraph:
                        break
                return title, _summary(" ".join(paragraph))
    raise ValueError("no Markdown heading")


def _summary(paragraph: str, at_least: int = 60) -> str:
    """The paragraph's first sentences, as few as make ``at_least`` characters; a sentence that
    ends in a colon (it introduces a list) ends in a full stop instead."""
    out = ""
    for sentence in re.split(r"(?<=[.:!?])\s+(?=[A-Z`*$\[])", paragraph):
        out = f"{out} {sentence}".strip()
        if len(out) >= at_least:
            break
    return out[:-1] + "." if out.endswith(":") else out


def index_markdown(directory: Path = NOTEBOOKS_DIR) -> str:
    """notebooks/README.md, from every notebook in ``directory`` in name (= reading) order."""
    import nbformat

    rows = []
    for path in notebook_paths(directory):
        try:
            title, summary = _first_heading_and_paragraph(nbformat.read(path, as_version=4))
        except ValueError as error:
            raise ValueError(f"{path.name}: {error}; the index needs a title") from None
        title = re.sub(r"^\d+\s*[—-]\s*", "", title)  # "02 — Title": the number is the name's
        cells = (f"[`{path.stem}`]({path.name})", title, summary)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return INDEX_HEAD + "\n".join(rows) + "\n" + INDEX_TAIL


# ---------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    import nbformat

    usage = "usage: python -m notebooks.tool {strip|check} NOTEBOOK... | index [--check]"
    if not argv or argv[0] not in {"strip", "check", "index"}:
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "index":
        text = index_markdown()
        if argv[1:] == ["--check"]:
            if INDEX_PATH.read_text(encoding="utf-8") != text:
                print(f"{INDEX_PATH} is stale: run `python -m notebooks.tool index`")
                return 1
            return 0
        INDEX_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {INDEX_PATH}")
        return 0
    command, paths = argv[0], [Path(p) for p in argv[1:]]
    failed = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        problems = has_outputs(nb)
        if not problems:
            continue
        if command == "strip":
            nbformat.write(strip(nb), path)
            print(f"stripped {path} ({len(problems)} problem(s))")
        else:
            failed += 1
            print(f"{path}:\n  " + "\n  ".join(problems))
    if failed:
        print("run `make strip-notebooks`", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
