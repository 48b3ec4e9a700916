"""Test-wide settings: hypothesis profiles and the GPU auto-skip. Nothing else is global.

Hypothesis profiles, chosen by the environment variable HYPOTHESIS_PROFILE:
- ``ci`` (default, ``make test``): 40 examples per property, no deadline.
- ``full`` (``make test-full``): 400 examples per property, otherwise as ``ci``.

Deadlines are off because timings on 2 shared cores (and on ranks that time-share them) say
nothing about a property; slow tests are bounded by pytest-timeout instead (pyproject.toml).
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "full", parent=settings.get_profile("ci"), deadline=None, max_examples=400
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch  # lazily: collecting the non-GPU tests must not pay for importing torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
