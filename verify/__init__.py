"""The verification harness: proves zero/ equal to reference/ (bitwise, or within derived bounds).

Read in this order: harness.py (one cell: engine and reference side by side on every rank),
expect.py (what a cell must see, from the model and config alone: units, groups, collectives,
resident bytes), inject.py (gradients fed in without backward), compare.py and lockstep.py with
bounds.py (what "equal" means: bits, or a derived bound), covering.py and matrix.py (which
cells: covering arrays over the matrix's dimensions, the --quick and --complete presets, where
each planted bug is observable), invariance.py (the same run at N = 1, 2, 4, 8), run.py and
report.py (running a plan, JSON/Markdown/heatmap), __main__.py (python -m verify). anchors.py
keeps the reference honest against torch.optim, plain PyTorch, DDP and DeepSpeed; resume.py
checks checkpoints; planted.py plants deliberate bugs that the cells must catch.
"""
