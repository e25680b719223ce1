"""The scripts here run under mpiexec (tests/test_distributed.py launches them): pytest must
not import them, not even for doctests."""

collect_ignore_glob = ["*.py"]
