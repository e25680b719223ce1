"""Shared fixtures. PyTorch is an optional oracle: tests that take `torch` skip without it;
tests that take `gpu` skip without CuPy and a usable CUDA GPU; `threads` sets luxnn's
kernel threads for one test.
Hypothesis draws the same examples on every run and machine (derandomize): a failure is a
bug to fix, never a draw of luck."""

import pytest
from hypothesis import settings

settings.register_profile("luxnn", derandomize=True)
settings.load_profile("luxnn")


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _the_same_bits_on_a_quiet_and_a_busy_machine():
    """Products whose BLAS threads follow the machine's load would compute to other last
    bits as other processes come and go: every test holds them to one thread (tests of
    the rule itself turn it back on)."""
    from luxnn import parallel

    parallel.set_follow_load(False)
    yield
    parallel.set_follow_load(True)


@pytest.fixture
def threads():
    """Set luxnn's kernel threads for one test (``threads(2)``); restored after it."""
    from luxnn import parallel

    before = parallel.num_threads()
    yield parallel.set_num_threads
    parallel.set_num_threads(before)


@pytest.fixture(scope="session")
def gpu():
    """The first usable CUDA GPU as a luxnn device."""
    import luxnn as lx

    try:
        return lx.gpu_device(force=True)
    except RuntimeError as err:
        pytest.skip(f"needs CuPy and a usable CUDA GPU ({err})")
