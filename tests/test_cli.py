"""The `luxnn` command: every bad argument is one line on stderr naming it, what was expected
and what came, exit status 2, before any work starts; --help and --version."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

import luxnn.demo
from luxnn.bench import commands
from luxnn.cli import main

from test_bench import BASE, NEW


@pytest.fixture
def no_work(monkeypatch):
    """Training and measuring fail the test if they start."""

    def started(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(luxnn.demo, "run", started)
    monkeypatch.setattr(commands, "run", started)
    monkeypatch.setattr(commands, "LocalWorker", started)


def _one_line_error(capsys, *expected):
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    for part in expected:
        assert part in err, (part, err)
    return err


def _gpu_usable():
    try:
        luxnn.gpu_device(force=True)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--lr", "-1"], ["--lr", "expected a finite number above 0", "'-1'"]),
        (["--lr", "nan"], ["--lr", "expected a finite number above 0", "'nan'"]),
        (["--lr", "inf"], ["--lr", "expected a finite number above 0", "'inf'"]),
        (["--lr", "0"], ["--lr", "'0'"]),
        (["--lr", "fast"], ["--lr", "'fast'"]),
        (["--batch-size", "100000"], ["--batch-size", "expected at most 1442", "got 100000"]),
        (["--batch-size", "0"], ["--batch-size", "expected an integer of at least 1", "'0'"]),
        (["--epochs", "-1"], ["--epochs", "expected an integer of at least 1", "'-1'"]),
        (["--epochs", "2.5"], ["--epochs", "'2.5'"]),
        (["--seed", "-3"], ["--seed", "expected an integer of at least 0", "'-3'"]),
        (["--model", "resnet"], ["--model", "'resnet'", "'mlp', 'cnn'"]),
        (["--device", "tpu"], ["--device", "'tpu'"]),
        (["--memory-plot", "/nonexistent/dir/x.png"], ["--memory-plot", "no such directory /nonexistent/dir", "'/nonexistent/dir/x.png'"]),
        (["--memory-plot", ""], ["--memory-plot", "expected a file name, got ''"]),
        (["--memory-plot", "x.txt"], ["--memory-plot", "expected a file name ending in one of", "'png'", "'x.txt'"]),
        (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    ],
)
def test_a_bad_demo_argument_is_one_line_and_exit_status_2_before_training(capsys, no_work, args, expected):
    assert main(["demo", *args]) == 2
    _one_line_error(capsys, *expected)


def test_a_directory_as_memory_plot_is_refused(capsys, no_work, tmp_path):
    assert main(["demo", "--memory-plot", str(tmp_path)]) == 2
    _one_line_error(capsys, "--memory-plot", "expected a file name, got the directory")


def test_memory_plot_without_matplotlib_is_refused_before_training(capsys, no_work, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)  # import raises ImportError
    assert main(["demo", "--memory-plot", str(tmp_path / "m.png")]) == 2
    _one_line_error(capsys, "--memory-plot", "needs matplotlib", "pip install 'luxnn[plot]'")


@pytest.mark.skipif(_gpu_usable(), reason="a GPU is usable here")
def test_device_gpu_without_a_gpu_is_refused_before_training(capsys, no_work):
    assert main(["demo", "--device", "gpu"]) == 2
    _one_line_error(capsys, "--device", "expected a usable CUDA GPU for 'gpu', got none")


@pytest.mark.skipif(_gpu_usable(), reason="a GPU is usable here")
def test_bench_on_the_gpu_without_one_is_refused_before_measuring(capsys, no_work):
    assert main(["bench", "--device", "gpu", "--quick"]) == 2
    _one_line_error(capsys, "luxnn bench: --device gpu needs CuPy and a CUDA device: ")


def test_good_demo_arguments_reach_training_and_an_interrupt_is_one_line(capsys, monkeypatch, tmp_path):
    seen = {}

    def run(model, **kwargs):
        seen.update(kwargs, model=model)
        raise KeyboardInterrupt

    monkeypatch.setattr(luxnn.demo, "run", run)
    plot = str(tmp_path / "m.png")
    assert main(["demo", "--model", "cnn", "--lr", "1e-2", "--batch-size", "1442", "--epochs", "2", "--memory-plot", plot]) == 130
    assert seen == {"model": "cnn", "epochs": 2, "batch_size": 1442, "learning_rate": 0.01, "seed": 0, "memory_plot": plot, "progress": True, "device": "cpu"}
    _one_line_error(capsys, "luxnn demo: interrupted")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--rounds", "0"], ["--rounds", "expected an integer of at least 1", "'0'"]),
        (["--rounds", "many"], ["--rounds", "'many'"]),
        (["--filter", "("], ["--filter", "expected a regular expression", "'('"]),
        (["--filter", "no-such-row"], ["--filter", "matches no row", "'no-such-row'", "time_to_load"]),
        (["--json", "/no/such/dir/r.json"], ["--json", "no such directory /no/such/dir"]),
        (["--against=--help"], ["--against", "revision '--help' does not exist"]),
        (["--quick", "--filter", "basics/dense$", "--against", "no-such-revision-xyz"], ["--against", "'no-such-revision-xyz' does not exist"]),
        (["--fast"], ["unrecognized arguments: --fast"]),
        (["--device", "tpu"], ["--device", "'tpu'", "'cpu', 'gpu'"]),
        (["--device", "gpu", "--against", "main"], ["--against", "expected no revision with --device gpu", "'main'"]),
    ],
)
def test_a_bad_bench_argument_is_one_line_and_exit_status_2_before_measuring(capsys, no_work, args, expected):
    assert main(["bench", *args]) == 2
    _one_line_error(capsys, "luxnn", *expected)


def _malformed(**changes):
    return json.dumps({**BASE, **changes})


@pytest.mark.parametrize(
    "content, expected",
    [
        (bytes(range(256)) * 4, "not UTF-8 text"),
        (b"\x00\x01\x02", "not valid JSON"),
        (b"[1, 2]", "not a luxnn bench result"),
        (b"[" * 100_000, "not a luxnn bench result (RecursionError"),
        (b'{"format": ' + b"1" * 5000 + b"}", "not a luxnn bench result (ValueError"),
        (_malformed(machine=[1]).encode(), "'machine' must be an object, got list"),
        (_malformed(machine={"load_average": "high"}).encode(), "'machine' 'load_average' must be a list of numbers"),
        (_malformed(environment=3).encode(), "'environment' must be an object or null"),
        (_malformed(blas=1.5).encode(), "'blas' must be a list of objects"),
        (_malformed(rows=[{**BASE["rows"][1], "memory": {**BASE["rows"][1]["memory"], "bytes": "many"}}]).encode(), "row 0: 'a': 'memory' must hold"),
        (_malformed(rows=[{**BASE["rows"][1], "times": [[float("inf")]]}]).encode(), "row 0: 'a': 'times' must be a list of rounds"),
    ],
)
def test_compare_on_a_binary_or_malformed_file_is_one_line_and_exit_status_2(capsys, tmp_path, content, expected):
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_bytes(content)
    new.write_text(json.dumps(NEW))
    assert main(["compare", str(base), str(new)]) == 2
    _one_line_error(capsys, f"luxnn compare: {base}", expected)


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["compare"]])
def test_help_of_every_command(capsys, command):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(['luxnn', *command])}")


def test_version_is_the_installed_distributions(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"luxnn {importlib.metadata.version('luxnn')}\n"


def test_the_command_run_as_a_process_exits_2_with_one_line():
    done = subprocess.run([sys.executable, "-m", "luxnn.cli", "demo", "--lr", "nan"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "luxnn demo: argument --lr: expected a finite number above 0, got 'nan' (see luxnn demo --help)\n"


def test_the_demo_counts_upstream_allocations_from_the_step_the_promise_counts():
    # The warm-up may reach upstream in steps 2 and 3 (docs/design.md); from step 4 on a
    # fixed-shape loop must not, and the closing lines say which steps they counted.
    figures = luxnn.demo.run("mlp", epochs=1, batch_size=256, progress=False)
    assert figures["steps"] > luxnn.demo.WARM_UP_STEPS
    assert figures["upstream_allocs_after_warm_up"] == 0
    assert figures["upstream_allocs_after_first_step"] >= figures["upstream_allocs_after_warm_up"]
    assert "0 upstream allocations from step 4 on" in luxnn.demo.report(figures)
