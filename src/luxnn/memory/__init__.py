"""The step-scoped caching allocator.

Inside ``with cached(cache):`` every NumPy array allocation of the current thread (or
asyncio task) is served from `cache`; a block goes back to the cache when its last array
dies. After the first step of a fixed-shape loop no allocation reaches the system, and peak
memory stays at the step's working set.

>>> import numpy as np
>>> from luxnn import memory
>>> cache = memory.AllocCache()
>>> def step(x):
...     return np.tanh(x @ x.T).sum()
>>> x = np.ones((512, 512), dtype=np.float32)
>>> for _ in range(5):
...     with memory.cached(cache) as scope:
...         loss = step(x)
>>> scope.stats.upstream_allocs
0

The package, one responsibility a module: `cache` (`AllocCache` and its figures), `scope`
(`cached`, `step`, `uncached`), `frontend` (how an array library's allocations reach a cache:
NumPy's NEP 49 handler, and the protocol every library's front end keeps), `cupy_backend`
(CuPy's front end and the CUDA driver), `plan` (step plans), `errors` (out-of-memory errors
and byte formatting), `timeline` (`plot_timeline`), and the C core, ``_core`` (``csrc/``).

This module imports only NumPy and its own C core.
"""

from .cache import (
    DEFAULT_EVICT_AFTER, EVENT_KINDS, AllocCache, CacheStats, ScopeStats, bin_size, get_allocator_cache,
)  # fmt: skip
from .errors import CacheMemoryError
from .scope import Scope, UncachedScope, cached, step, uncached
from .timeline import plot_timeline

__all__ = [
    "AllocCache", "CacheStats", "ScopeStats", "CacheMemoryError", "Scope", "UncachedScope",
    "cached", "step", "uncached", "plot_timeline", "bin_size", "get_allocator_cache", "DEFAULT_EVICT_AFTER",
    "EVENT_KINDS",
]  # fmt: skip
