#!/usr/bin/env bash
# Real-GPU check of fastanneal.cuda (correctness vs the CPU kernels, speed vs a cuBLAS GEMM).
#
#   bash benchmarks/gpu_check.sh [OUT_JSON] [gpu_check.py options, e.g. --repeats 5]
#
# Runs from the repository root with PYTHONPATH=. (fastanneal need not be installed; dask is
# not needed). Needs python3 with numpy, numba, numba-cuda, and cupy or torch for the GEMM
# floor. Default JSON: $GPU_CHECK_OUT, else benchmarks/results/gpu_check.json. Wall-clock
# limit: $GPU_CHECK_TIMEOUT seconds (default 420). Set GPU_CHECK_TESTS=1 to also run
# tests/test_cuda_sim.py on the real GPU first (FASTANNEAL_REAL_CUDA=1; needs pytest).
# Exit status: 0 when every section passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

out="${GPU_CHECK_OUT:-benchmarks/results/gpu_check.json}"
if [[ $# -gt 0 && "$1" != --* ]]; then
    out="$1"
    shift
fi
mkdir -p "$(dirname "$out")"

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
    2>/dev/null || echo "nvidia-smi: not available"
python3 -c "import numba, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__)"

rc_tests=0
if [[ "${GPU_CHECK_TESTS:-0}" == "1" ]]; then
    echo "== tests/test_cuda_sim.py on the real GPU"
    # numba-cuda (0.30 and the GPU image's) registers np.row_stack, removed in NumPy 2.5:
    # alias it in a throwaway sitecustomize so that its first compile does not fail.
    shim="$(mktemp -d)"
    printf 'import numpy as np\nif not hasattr(np, "row_stack"):\n    np.row_stack = np.vstack\n' \
        > "$shim/sitecustomize.py"
    PYTHONPATH="$shim:$PYTHONPATH" FASTANNEAL_REAL_CUDA=1 timeout 240 python3 -m pytest \
        tests/test_cuda_sim.py -q -x -p no:cacheprovider -k "not compile_for" \
        -W ignore::numba.core.errors.NumbaPerformanceWarning
    rc_tests=$?
    echo "tests exit status: $rc_tests"
fi

timeout "${GPU_CHECK_TIMEOUT:-420}" python3 benchmarks/gpu_check.py --out "$out" "$@"
rc=$?
echo "gpu_check.py exit status: $rc (JSON: $out)"
if [[ $rc -eq 0 && $rc_tests -ne 0 ]]; then
    rc=$rc_tests
fi
exit $rc
