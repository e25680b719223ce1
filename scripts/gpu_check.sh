#!/usr/bin/env bash
# Everything GPU-side of luxnn in one go, in at most 10 minutes, on a machine with an NVIDIA
# GPU and CuPy already installed, without network:
#
#   bash scripts/gpu_check.sh            # PYTHON=/path/to/python to choose the interpreter
#
# Stages (each with its own time limit; a failing stage is named and its log's tail shown,
# the later stages still run):
#   install   pip install --no-build-isolation --no-deps -e .  (builds the C core)
#   tests     tests/test_gpu.py and tests/test_memory_cuda.py, without the GPU-vs-CPU cases
#   match     GPU against CPU: outputs and gradients of an MLP, a CNN, an attention block
#             (float64 to 1e-10, float32 to 1e-4 relative) and of the primitives
#   kernels   every CUDA kernel of ops/cuda and the fused optimiser against its NumPy twin and
#             the CPU's code (activations, softmax, dense, attention, conv, pooling, norms,
#             cross-entropy, embedding, recurrent cells, optimisers; their first compile included)
#   demo-mlp  luxnn demo --device gpu --model mlp
#   demo-cnn  luxnn demo --device gpu --model cnn
#   nccl      luxnn.distributed's NCCL backend on one GPU (mpiexec -n 1): collectives, start_allreduce,
#             blocking and overlapped DistributedOptimizer steps (skipped, with the reason, without mpi4py)
#   alloc     benchmarks/allocator.py --gpu: alloc+free of device memory through CuPy's pool
#             and through the luxnn cache's C hook
#   table     benchmarks/gpu_step.py: time, driver allocations, peak live and reserved
#             per training step without a pool, with CuPy's pool and with the luxnn cache
#   bench     luxnn bench --device gpu --quick: the training rows and the basics beside PyTorch
#             eager on the same GPU (time, CUDA kernels per step, peak reserved, first step),
#             as markdown; its JSON in the logs directory
# The alloc figures and the tables come last. Exit status: 0 all stages passed, 1 a stage failed, 2 no usable GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/luxnn-gpu-check.XXXXXX")
failed=()

# No GPU, no check: say so plainly instead of failing stage after stage.
if ! gpu=$("$PYTHON" - <<'EOF' 2>&1
import cupy
n = cupy.cuda.runtime.getDeviceCount()
assert n > 0, "no CUDA device"
props = cupy.cuda.runtime.getDeviceProperties(0)
print(f"{props['name'].decode()} ({n} device{'s' * (n > 1)}), CuPy {cupy.__version__}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
EOF
); then
    echo "gpu_check: no usable NVIDIA GPU through CuPy with $PYTHON:" >&2
    echo "$gpu" | tail -n 3 | sed 's/^/    /' >&2
    echo "gpu_check: nothing was run; install CuPy (pip install 'luxnn[cuda12]') on a machine with a GPU" >&2
    exit 2
fi
echo "gpu_check: $gpu"
echo "gpu_check: logs in $LOGS"

# stage NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to NAME.log.
stage() {
    local name=$1 limit=$2 status=0 start=$SECONDS
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || status=$?
    if [ "$status" -eq 0 ]; then
        echo "gpu_check: stage $name passed ($((SECONDS - start)) s)"
        return 0
    fi
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "gpu_check: stage $name FAILED: over its limit of $limit s" >&2
    else
        echo "gpu_check: stage $name FAILED (exit status $status)" >&2
    fi
    tail -n 40 "$LOGS/$name.log" | sed "s/^/    [$name] /" >&2
    failed+=("$name")
}

stage install 45 "$PYTHON" -m pip install --no-build-isolation --no-deps -q -e .
stage tests 90 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_memory_cuda.py -k "not match_the_cpu"
stage match 45 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "match_the_cpu"
stage kernels 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_sim_activations.py tests/test_conv.py \
    tests/test_gpu_norm.py tests/test_sim_recurrent.py tests/test_optim_fused.py -k "gpu or cuda_kernel"
stage demo-mlp 30 "$PYTHON" -m luxnn.cli demo --device gpu --model mlp --epochs 5 --no-progress
stage demo-cnn 30 "$PYTHON" -m luxnn.cli demo --device gpu --model cnn --epochs 2 --no-progress
stage nccl 30 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_distributed.py -k nccl_on_one_gpu
stage alloc 60 "$PYTHON" benchmarks/allocator.py --gpu --rounds 3
stage table 60 "$PYTHON" benchmarks/gpu_step.py
stage bench 120 "$PYTHON" -m luxnn.cli bench --device gpu --quick --markdown --json "$LOGS/gpu-bench.json"

for name in tests match kernels nccl; do  # the pytest summaries: counts and skip reasons
    grep -E "passed|failed|SKIPPED|error" "$LOGS/$name.log" | tail -n 5 | sed "s/^/    [$name] /" || true
done
for name in demo-mlp demo-cnn; do
    grep -E "^(model|test accuracy|allocator cache)" "$LOGS/$name.log" | sed "s/^/    [$name] /" || true
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED stages: ${failed[*]} (logs in $LOGS)" >&2
else
    echo "gpu_check: all stages passed"
fi
echo
# The figures last (what the alloc and table stages printed, even if a model failed in them).
sed -n '/^5\. alloc+free/,$p' "$LOGS/alloc.log" || true
echo
grep -v "^gpu_step: " "$LOGS/table.log" | sed -n '/^GPU training steps on/,$p' || true
echo
sed -n '/^- run: /,$p' "$LOGS/bench.log" | grep -v "^luxnn bench: wrote" || true
[ ${#failed[@]} -eq 0 ]
