"""The notebooks and their logic, in one folder.

- ``NN_*.ipynb``: the notebooks, numbered in reading order; README.md is their index, generated.
- ``teaching/``: their logic (pictures, message tables, exercise checkers, gloo runs, the claims'
  measurements), which the notebooks import as ``from notebooks import teaching``.
- ``tool.py``: strip, check and index them, and execute them for the tests
  (``python -m notebooks.tool strip|check|index [--check]``).

Importing this package imports nothing else.
"""
