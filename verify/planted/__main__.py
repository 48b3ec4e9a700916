"""python -m verify.planted: the planted-bug suite (suite.py)."""

import sys

from .suite import main

sys.exit(main())
