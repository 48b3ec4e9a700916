"""Model parallelism against reference/mp.py: the MP cells (cells.py, plan.py, split.py, checks.py,
report.py), the operators in lock-step (lockstep.py) with their bounds (bounds.py), and the MP
checkpoint rows (resume.py). `python -m verify --mp` runs them."""
