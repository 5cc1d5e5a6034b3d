#!/usr/bin/env bash
# GPU check for the issue-6 kernels: GPU tests, then the two benchmarks (JSON under $OUT or ./gpu-out).
# Usage (repo root, on a machine with a GPU and cuda-core/cuda-bindings/NVRTC installed):
#   MOE_ARGS="--m 1,16" GEMM_ARGS="--tp 1" bash tests/plugins/run_on_gpu.sh [tests|bench|all]
set -uo pipefail
what=${1:-all}
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=${DDTREE_KERNEL_CACHE:-/tmp/ddtree-cubins}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import cuda.core, cuda.bindings, numpy; print('cuda.core', cuda.core.__version__, 'numpy', numpy.__version__)"
if [[ $what == tests || $what == all ]]; then
  timeout 420 python3 -m pytest -q -rf --tb=short --maxfail=20 tests/plugins 2>&1 | tee "$out/tests.log" | tail -60
fi
if [[ $what == bench || $what == all ]]; then
  timeout 400 python3 -c "from ddtree.cli import main; main()" bench moe --json ${MOE_ARGS:-} > "$out/moe.json"
  timeout 300 python3 -c "from ddtree.cli import main; main()" bench gemm --json ${GEMM_ARGS:-} > "$out/gemm.json"
fi
