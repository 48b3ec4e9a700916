"""Bad input and damaged checkpoints, each refused by its named error (section.py): the rows
(rows.py, bad_inputs.py), the ones that need ranks (ranks.py) and the damaged checkpoints
(damage.py)."""
