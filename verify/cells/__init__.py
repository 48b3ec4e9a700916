"""What verify runs: a cell (cell.py), the matrix's dimensions and presets (matrix.py, covering.py),
injected gradients (inject.py), the branching models (branch.py), feature pairs (interactions.py),
where each planted bug shows and what a plan covers (observable.py), world-size invariance
(invariance.py), and the runner of a plan (run.py)."""
