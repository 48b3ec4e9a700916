"""How verify checks one cell: the engine and the reference side by side (harness.py, sides.py),
the named checks and their verdict (verdict.py), the expected values stated from the model and the
config alone (expect.py, expect_memory.py), the fast-mode bounds (lockstep.py, bounds.py), bit
comparisons (compare.py) and the rows and reports (report.py)."""
