"""The parts of python -m verify (verify/__main__.py): options.py (its options and their checks),
sections.py (the table of its sections: what chooses each, in which order they run and report)
and section_runs.py (what each section runs, lists, says and writes)."""
