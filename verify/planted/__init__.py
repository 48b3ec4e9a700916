"""Planted bugs: deliberately broken engines that verify must report failing, each by the check
it names (suite.py: the registry and the runs; plants.py: the base bugs' patches and Patch; a
feature's bugs live in its record, verify/features/). `python -m verify.planted` runs them."""

from .plants import Patch
from .suite import (
    BUGS,
    RESUME_OBSERVABLE,
    by_its_check,
    check_of,
    checks_of,
    cost,
    main,
    markdown,
    observable,
    run,
    run_bug,
)

__all__ = [
    "BUGS", "RESUME_OBSERVABLE", "Patch", "by_its_check", "check_of", "checks_of", "cost", "main",
    "markdown", "observable", "run", "run_bug",
]  # fmt: skip
