"""`python -m zero.checkpoint`: the command line of zero/checkpoint/cli.py.

Legend: `consolidate DIR OUT` writes one plain state dict; `verify DIR` checks every checksum.
"""

from ..common import cli
from .cli import main

cli.run(main, "python -m zero.checkpoint")
