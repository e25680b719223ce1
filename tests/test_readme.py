"""The README's Python examples run as written, in order, in one namespace."""

import re
import warnings
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)  # the tour writes a checkpoint
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gpu_device() warns on a machine without a GPU
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    assert namespace["cache"].stats().misses > 0  # the allocator example allocated from its cache
