"""Shared fixtures. PyTorch is an optional oracle: tests that take `torch` skip without it.
Hypothesis draws the same examples on every run and machine (derandomize): a failure is a
bug to fix, never a draw of luck."""

import pytest
from hypothesis import settings

settings.register_profile("luxnn", derandomize=True)
settings.load_profile("luxnn")


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")
