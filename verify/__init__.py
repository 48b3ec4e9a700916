"""The verification harness: proves zero/ equal to reference/ (bitwise, or within derived bounds).

bounds.py holds every tolerance's derivation. The `python -m verify` matrix arrives with the
engine.
"""
