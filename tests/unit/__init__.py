"""One-process tests. A package, so that its test modules may share a basename with one in
tests/distributed (test_teaching.py: the one-process half here, the gloo half there)."""
