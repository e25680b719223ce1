"""The benchmark suite (``luxnn bench``) and its comparison table (``luxnn compare``).

- `models`: the networks of the suite and their peers (PyTorch eager, NumPy by hand) as
  step builders;
- `suite`: the rows, grouped by what is compared side by side;
- `runner`: warm-up, interleaved rounds, the memory pass, fresh-process rows, the JSON;
- `worker`: the process that runs a suite for ``--against`` and the fresh-process rows;
- `revision`: ``--against REV``, a revision built in a temporary worktree;
- `compare`: the tables; `stats`: medians, IQRs, ratios and their formatting;
- `gpu`, `gpu_models`: ``luxnn bench --device gpu``, its rows on a CUDA GPU beside PyTorch's.

The modules import each other relatively and luxnn itself only as ``luxnn``, so that the
package can be copied under another name and run against another revision's luxnn.
BENCHMARKS.md at the repository root says how to run and read it.
"""


class BenchError(Exception):
    """A user's error (bad input, a revision that does not build): the command prints the
    message and exits non-zero, without a traceback."""
