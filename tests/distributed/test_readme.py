"""The README's Python examples run as written (so that they never rot)."""

import math
import pathlib
import re

import numpy as np
import pytest

from reference.precision import bits

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    ns: dict = {}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), ns)
    # what each example leaves behind must be what the README says it shows
    if "world" in ns:  # the simulation example: the same bits as the single-process step
        for name, value in ns["state"].master.items():
            assert np.array_equal(bits(ns["world"].full_master()[name]), bits(value))
    elif "resumed" in ns:  # the checkpoint example: resumed at N = 4, stage 3 = uninterrupted
        assert ns["resumed"] == ns["uninterrupted"]
    elif "losses" in ns:  # the engine example: three steps with finite global losses
        assert len(ns["losses"]) == 3 and all(math.isfinite(x) for x in ns["losses"])
    else:
        pytest.fail(f"README block {index} has no example this test knows how to check")
