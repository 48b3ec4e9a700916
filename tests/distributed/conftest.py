"""The distributed tier's one shared run: `python -m verify --quick`, made once per session by
the first test that asks for it (quick_report). tests/distributed/test_verify_cli.py checks the
preset as a whole from it; the parity, MP and watchdog tests read their sections from the same
report instead of running those sections a second time (the same cells, about 30 s)."""

import contextlib
import io
import json
import time

import pytest


@pytest.fixture(scope="session")
def quick_report(tmp_path_factory):
    """{"rc", "data" (the --json report), "markdown", "printed", "took"} of one --quick run."""
    from verify.__main__ import main

    where = tmp_path_factory.mktemp("quick")
    out, md = where / "quick.json", where / "quick.md"
    printed = io.StringIO()
    started = time.time()
    with contextlib.redirect_stdout(printed):
        rc = main(["--quick", "--json", str(out), "--markdown", str(md)])
    return {
        "rc": rc,
        "data": json.loads(out.read_text()),
        "markdown": md.read_text(),
        "printed": printed.getvalue(),
        "took": time.time() - started,
    }
