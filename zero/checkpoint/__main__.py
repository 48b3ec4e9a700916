"""`python -m zero.checkpoint`: the command line of zero/checkpoint/cli.py."""

import sys

from .cli import main

sys.exit(main())
