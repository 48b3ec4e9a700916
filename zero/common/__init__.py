"""Torch-free code shared by the library, the instruments and the figures.

cli.py       command lines derived from keyword-only dataclasses; one-line refusals
results.py   the one results format: JSON records with provenance, written atomically
memory.py    the paper's analytic memory model per data-parallel rank
owner.py     who made a file and whether that process still runs; folders removed at exit
"""
