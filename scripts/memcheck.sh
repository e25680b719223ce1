#!/usr/bin/env bash
# Build luxnn's C extensions and run their tests under valgrind memcheck.
#
#   scripts/memcheck.sh [pytest args...]      (default: tests/test_memory*.py but one,
#                                              and the recurrent C passes' tests; below)
#
# Python runs with PYTHONMALLOC=malloc so that every allocation is visible to valgrind.
# CPython, glibc's loader and NumPy report errors of their own under valgrind (reads of
# uninitialised small-int state, vectorised string compares, interpreter state kept until
# exit); those are counted and listed by kind but do not fail the run. An error fails it
# when any stack of the error (where it happened, where the memory was allocated or
# freed, where an uninitialised value came from) is in one of luxnn's C files (the
# allocator's core, the BLAS holds, the recurrent passes): that is the suppression rule. Leaks count only when definite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# One XML file per process: the fork tests' children go on under valgrind and write their
# own reports (one file for all of them would hold several documents).
XML=${MEMCHECK_XML:-/tmp/luxnn-memcheck}
rm -f "$XML".*.xml

# This checkout's extensions, and this checkout's package (also from a worktree of another's install).
"$PYTHON" setup.py -q build_ext --inplace >/dev/null 2>&1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# By default every memory test but test_memory_shapes.py, whose model training loops took
# over 20 minutes for one test under valgrind (CI's budget is 90 in all; the C paths they
# take, several plans in one arena, are the state machine's and test_memory_plan.py's too;
# pass the file to check it), and the recurrent C passes' tests.
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    for f in tests/test_memory*.py; do
        [ "$f" = tests/test_memory_shapes.py ] || tests+=("$f")
    done
    tests+=(tests/test_recurrent.py
            -k "not torch and (memory or c_passes or gates or split_over_threads or float32_lstm or mixed_dtypes or lstm_without)")
fi

# Valgrind runs one thread at a time. Its default hand-over lets a thread that gives up the
# CPU take it straight back, so a test's busy thread kept the forking thread from running
# for ten minutes at a stretch; --fair-sched=yes hands over in turn.
set +e
PYTHONMALLOC=malloc LUXNN_MEMCHECK=1 valgrind --tool=memcheck --fair-sched=yes --xml=yes --xml-file="$XML.%p.xml" \
    --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite \
    --track-origins=yes --num-callers=40 \
    "$PYTHON" -m pytest -q -p no:cacheprovider "${tests[@]}"
tests_status=$?
set -e

"$PYTHON" - "$XML".*.xml <<'PY'
import collections, glob, os, sys, xml.etree.ElementTree as ET

# luxnn's C files: the allocator's core (memory/csrc), the BLAS holds, the recurrent passes.
OURS = sorted(glob.glob("src/luxnn/memory/csrc/*.[ch]")) + ["src/luxnn/_blas.c", "src/luxnn/ops/_recurrent.c",
                                                            "src/luxnn/ops/_recurrent_cell.h"]
OUR_FILES = {os.path.realpath(p) for p in OURS}


def ours(frame) -> bool:
    """Whether a stack frame is in one of luxnn's C files (valgrind names its directory and file)."""
    return os.path.realpath(os.path.join(frame.findtext("dir") or "", frame.findtext("file") or "")) in OUR_FILES


ours_errors, noise, unreadable = [], collections.Counter(), []
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:  # a process killed before valgrind finished its report
        unreadable.append(f"{path}: {err}")
        continue
    for error in root.iter("error"):
        kind = error.findtext("kind")
        if any(ours(frame) for frame in error.iter("frame")):
            ours_errors.append(error)
        else:
            noise[kind] += 1
print(f"memcheck: {len(sys.argv) - 1} processes; {len(ours_errors)} errors involving luxnn's C ({len(OURS)} files: {', '.join(os.path.basename(p) for p in OURS)}); "
      f"{sum(noise.values())} elsewhere (CPython/glibc/NumPy): {dict(noise)}")
for line in unreadable:
    print("unreadable report:", line)
for error in ours_errors:
    print("---", error.findtext("kind"), error.findtext("what") or error.findtext("xwhat/text"))
    for frame in error.iter("frame"):
        print("   ", frame.findtext("fn"), f"{frame.findtext('file')}:{frame.findtext('line')}")
sys.exit(1 if ours_errors or unreadable else 0)
PY
core_status=$?
echo "pytest exit status under valgrind: $tests_status"
exit $(( core_status || tests_status ))
