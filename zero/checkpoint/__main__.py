"""`python -m zero.checkpoint`: the command line of zero/checkpoint/cli.py.

Legend: `consolidate DIR OUT` writes one plain state dict; `verify DIR` checks every checksum.
"""

import sys

from .cli import main

sys.exit(main())
