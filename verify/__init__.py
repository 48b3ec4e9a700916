"""The verification harness: proves zero/ equal to reference/ (bitwise, or within derived bounds).

Read in this order:
  checks/       one cell: the engine and the reference side by side on every rank (harness.py,
                sides.py), the named checks (verdict.py), what a cell must see from the model and
                config alone (expect.py, expect_memory.py), what "equal" means: bits, or a derived
                bound (compare.py, lockstep.py, bounds.py), and the reports (report.py)
  cells/        which cells: a cell (cell.py), covering arrays over the matrix's dimensions and the
                --quick and --complete presets (covering.py, matrix.py), injected gradients
                (inject.py), where each planted bug shows (observable.py), feature pairs
                (interactions.py), world-size invariance (invariance.py), a plan's run (run.py)
  features/     each option verified beside the dimensions, declared once (its registry)
  planted/      deliberate bugs that the cells must catch, each by its named check
  checkpoints/  the resume table and consolidation; parity/ plain PyTorch and the external
                anchors (torch.optim, DDP, DeepSpeed); mp/ model parallelism; refusals/ bad input
  command/      python -m verify: a table of sections (__main__.py); faults/ the fault suite
"""
