"""Parity with plain PyTorch (section.py, with the plain side and its bounds in lockstep.py) and
the external anchors: the reference against textbook training code (anchors.py).
`python -m verify --parity` runs the parity section."""
