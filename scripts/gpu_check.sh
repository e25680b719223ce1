#!/usr/bin/env bash
# Everything GPU-side of luxnn in one go, in at most 10 minutes, on a machine with an NVIDIA
# GPU and CuPy already installed, without network:
#
#   bash scripts/gpu_check.sh            # PYTHON=/path/to/python to choose the interpreter
#
# Stages (each with its own time limit, and none past the script's budget of BUDGET seconds,
# so that the whole script ends within 10 minutes; a failing stage is named and its log's tail
# shown, the later stages still run; a stage the budget leaves no time for fails unrun):
#   wheels    only where a .whl/ folder is at the repository's root (wheels carried to a machine
#             without network, e.g. nvmath-python and nvidia-cudnn-frontend: scripts/gpu_wheels.sh
#             fetches them): pip install --no-index --no-deps --target into the logs directory,
#             put first on PYTHONPATH for every later stage; names what it installed
#   install   pip install --no-build-isolation --no-deps -e .  (builds the C core)
#   tests     tests/test_gpu.py and tests/test_memory_cuda.py, without the GPU-vs-CPU cases
#   match     GPU against CPU: outputs and gradients of an MLP, a CNN, an attention block
#             (float64 to 1e-10, float32 to 1e-4 relative) and of the primitives
#   kernels   every CUDA kernel of ops/cuda and the fused optimiser against its NumPy twin and
#             the CPU's code (activations, softmax, dense, attention, conv, pooling, norms,
#             cross-entropy, embedding, recurrent cells, optimisers; their first compile included),
#             and the GEMMs through nvmath-python's cuBLASLt (tests/test_cuda_gemm.py)
#   graphs    tests/test_gpu_graphs.py: training steps replayed as CUDA graphs against eager ones
#             (bitwise), each invalidation, the fallback, a cache limit, an interrupted replay
#   demo-mlp  luxnn demo --device gpu --model mlp
#   demo-cnn  luxnn demo --device gpu --model cnn
#   nccl      luxnn.distributed's NCCL backend on one GPU (mpiexec -n 1): collectives, start_allreduce,
#             blocking and overlapped DistributedOptimizer steps (skipped, with the reason, without mpi4py)
#   alloc     benchmarks/allocator.py --gpu: alloc+free of device memory through CuPy's pool
#             and through the luxnn cache's C hook
#   table     benchmarks/gpu_step.py: time, driver allocations, peak live and reserved
#             per training step without a pool, with CuPy's pool and with the luxnn cache
#   bench     luxnn bench --device gpu --quick: the training rows (luxnn eager and replayed as CUDA
#             graphs) and the basics beside PyTorch eager and PyTorch's whole-step CUDA graph on
#             the same GPU (time, CUDA kernels per step, peak reserved, first and capture step,
#             luxnn's graph statistics), as markdown; its JSON in the logs directory
# The alloc figures and the tables come last. Exit status: 0 all stages passed, 1 a stage failed, 2 no usable GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
BUDGET=570  # seconds for all stages: 10 minutes, less the GPU probe and the closing prints
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
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/luxnn-gpu-check.XXXXXX")
echo "gpu_check: $gpu"
echo "gpu_check: logs in $LOGS"

# stage NAME SECONDS COMMAND...: run COMMAND under a time limit (at most what is left of the
# budget, less the 5 s a stage over its limit may take to die), its output to NAME.log.
stage() {
    local name=$1 limit=$2 status=0 start=$SECONDS left=$((BUDGET - SECONDS - 5))
    shift 2
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -le 0 ]; then
        echo "gpu_check: stage $name FAILED: not run, the budget of $BUDGET s is spent" | tee "$LOGS/$name.log" >&2
        failed+=("$name")
        return 0
    fi
    timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || status=$?
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

# Wheels carried here (.whl/): installed apart and first on every later stage's PYTHONPATH.
wheels=(.whl/*.whl)
if [ -e "${wheels[0]}" ]; then
    site="$LOGS/site"
    stage wheels 40 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}"
    if [ ${#failed[@]} -eq 0 ]; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        for wheel in "${wheels[@]}"; do  # NAME-VERSION-...whl
            name=$(basename "$wheel")
            echo "gpu_check: installed from .whl/: $(echo "$name" | cut -d- -f1) $(echo "$name" | cut -d- -f2)"
        done
    fi
fi

stage install 40 "$PYTHON" -m pip install --no-build-isolation --no-deps -q -e .
stage tests 75 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_memory_cuda.py -k "not match_the_cpu"
stage match 35 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "match_the_cpu"
stage kernels 120 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_sim_activations.py tests/test_conv.py \
    tests/test_gpu_norm.py tests/test_sim_recurrent.py tests/test_optim_fused.py tests/test_cuda_gemm.py -k "gpu or cuda_kernel"
stage graphs 60 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_graphs.py
stage demo-mlp 20 "$PYTHON" -m luxnn.cli demo --device gpu --model mlp --epochs 5 --no-progress
stage demo-cnn 25 "$PYTHON" -m luxnn.cli demo --device gpu --model cnn --epochs 2 --no-progress
stage nccl 20 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_distributed.py -k nccl_on_one_gpu
stage alloc 30 "$PYTHON" benchmarks/allocator.py --gpu --rounds 3
stage table 30 "$PYTHON" benchmarks/gpu_step.py
stage bench 120 "$PYTHON" -m luxnn.cli bench --device gpu --quick --markdown --json "$LOGS/gpu-bench.json"

for name in tests match kernels graphs nccl; do  # the pytest summaries: counts and skip reasons
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
