"""Every notebook in notebooks/ is stored stripped, executes with its small profile, and draws
labelled, non-empty figures; notebooks/README.md is the index generated from them. A notebook is
covered the day it is added.

The harness itself is tested too (the last tests here): an unlabelled figure and a stored output
must be caught.
"""

import subprocess
import sys

import matplotlib
import nbformat
import pytest

from notebooks import tool as notebook_tools
from notebooks.tool import (
    INDEX_PATH,
    check_figures,
    describe_figures,
    execute_notebook,
    has_outputs,
    index_markdown,
    kernel_for_this_interpreter,
    notebook_paths,
    strip,
)

NOTEBOOKS = notebook_paths()

pytestmark = pytest.mark.notebook


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_stripped(path):
    problems = has_outputs(nbformat.read(path, as_version=4))
    assert not problems, (
        f"{path.name} is stored with outputs:\n  "
        + "\n  ".join(problems)
        + "\nRun `make strip-notebooks` and commit the result."
    )


def test_index_is_generated_from_the_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == [f"{i:02d}_" for i in range(1, len(NOTEBOOKS) + 1)]
    assert INDEX_PATH.read_text(encoding="utf-8") == index_markdown(), (
        "notebooks/README.md is stale: run `python -m notebooks.tool index` and commit it"
    )


def test_index_takes_title_and_summary_from_the_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    intro = (
        "# 07 — A title\n\nFirst sentence, which is long enough on its own: it goes on. Two.\n\n3"
    )
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_markdown_cell(intro)]
    nbformat.write(nb, tmp_path / "07_new.ipynb")
    row = index_markdown(tmp_path).split("|---|---|---|\n")[1].splitlines()[0]
    assert row == (
        "| [`07_new`](07_new.ipynb) | A title | First sentence, which is long enough on its own: "
        "it goes on. |"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_and_draws_labelled_figures(path):
    _, figures = execute_notebook(path, profile="small")
    check_figures(figures, where=path.name)


# ---------------------------------------------------------------------------------------------
# The harness has teeth.


def _write_notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nb, path)
    return path


def test_harness_rejects_an_unlabelled_figure_and_accepts_a_labelled_one(tmp_path):
    bad = _write_notebook(
        tmp_path / "unlabelled.ipynb",
        "import os, sys\nprint(sys.executable)\nprint(os.environ['ZERO_NOTEBOOK_PROFILE'])",
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([0, 1], [0, 1])",
        "1 + 1",  # a later cell: the figure must still be open at the end
    )
    executed, figures = execute_notebook(bad)
    printed = executed.cells[0].outputs[0]["text"].split()
    assert printed == [sys.executable, "small"], "kernel runs another interpreter or profile"
    assert len(figures) == 1 and len(figures[0]["axes"]) == 1, figures
    assert figures[0]["axes"][0]["has_data"], figures
    with pytest.raises(AssertionError, match="neither an x label nor a y label"):
        check_figures(figures)
    with pytest.raises(AssertionError, match="no title"):
        check_figures(figures)

    good = _write_notebook(
        tmp_path / "labelled.ipynb",
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([0, 1], [0, 1])\n"
        "ax.set_xlabel('x')\nax.set_title('a line')",
        "plt.figure()\nplt.bar(['a', 'b'], [1, 2])\nplt.ylabel('count')\nplt.suptitle('bars')",
    )
    _, figures = execute_notebook(good)
    assert [f["num"] for f in figures] == [1, 2], figures
    check_figures(figures)


def test_harness_propagates_a_cell_error(tmp_path):
    from nbclient.exceptions import CellExecutionError

    raises = _write_notebook(tmp_path / "raises.ipynb", "x = 1", "1 / 0", "x = 2")
    with pytest.raises(CellExecutionError, match=r"(?s)ZeroDivisionError.*raises\.ipynb"):
        execute_notebook(raises)


def test_check_figures_rejects_no_figures_and_empty_axes():
    with pytest.raises(AssertionError, match="no matplotlib figure"):
        check_figures([])
    empty_axes = {"title": "t", "xlabel": "x", "ylabel": "", "has_data": False}
    with pytest.raises(AssertionError, match="no data"):
        check_figures([{"num": 1, "suptitle": "", "axes": [empty_axes]}])
    with pytest.raises(AssertionError, match="has no axes"):
        check_figures([{"num": 1, "suptitle": "s", "axes": []}])


def test_describe_figures_in_process():
    import matplotlib.pyplot as plt

    if matplotlib.get_backend().lower() != "agg":
        plt.switch_backend("Agg")
    plt.close("all")
    try:
        fig, (a, b, c, d) = plt.subplots(1, 4)
        a.plot([], [])
        b.scatter([], [])
        c.bar([0, 1], [1, 2])
        c.bar_label(c.containers[0])
        d.imshow([[0, 1], [1, 0]])
        fig.suptitle("four")
        (described,) = describe_figures()
    finally:
        plt.close("all")
    axes = described["axes"]
    assert described["suptitle"] == "four"
    assert [ax["has_data"] for ax in axes] == [False, False, True, True]
    assert axes[2]["n_patches"] == 2 and axes[2]["n_texts"] == 2
    assert axes[3]["n_images"] == 1


def test_has_outputs_flags_a_stored_output_and_strip_removes_it(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("print(1)")]
    assert has_outputs(nb) == []
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nb.cells[1].execution_count = 3
    nb.metadata["widgets"] = {"state": {}}
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.7"}
    problems = has_outputs(nb)
    assert len(problems) == 4, problems
    assert sum("cell 1" in p for p in problems) == 2, problems
    assert any("widgets" in p for p in problems), problems
    assert any("language_info" in p for p in problems), problems

    path = tmp_path / "dirty.ipynb"
    nbformat.write(nb, path)
    tool = [sys.executable, "-m", "notebooks.tool"]
    root = notebook_tools.REPO_ROOT  # where `python -m` finds the package
    check = subprocess.run([*tool, "check", str(path)], cwd=root, capture_output=True, text=True)
    assert check.returncode == 1 and "cell 1" in check.stdout, check
    subprocess.run([*tool, "strip", str(path)], cwd=root, check=True, capture_output=True)
    assert has_outputs(nbformat.read(path, as_version=4)) == []
    assert has_outputs(strip(nb)) == []


def test_temporary_kernelspec_points_at_this_interpreter():
    from jupyter_client.kernelspec import KernelSpecManager

    with kernel_for_this_interpreter(force_kernelspec=True):
        spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[:3] == [sys.executable, "-m", "ipykernel_launcher"]
