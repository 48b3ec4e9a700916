"""The resume table: save at (N1, stage 1), load at (N2, stage 2), bit for bit against the
uninterrupted run (resume.py), and the consolidated checkpoint one step on as plain PyTorch
(consolidated.py). `python -m verify --resume` adds it."""
