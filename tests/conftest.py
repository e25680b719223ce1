"""Shared fixtures. PyTorch is an optional oracle: tests that take `torch` skip without it."""

import pytest


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")
