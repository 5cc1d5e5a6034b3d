#!/usr/bin/env bash
# The one-GPU GPU suite in one call: every `gpu`-marked test under the rooms that have them (tests needing a second
# GPU, TensorRT-RTX or nccl4py skip themselves), spread over pytest-xdist workers file by file, after the default
# kernels are compiled once into the shared cache. Log: $OUT/gpu_suite.log (or ./gpu-out/).
#   bash tests/gpu_suite.sh                          # all of them
#   WORKERS=1 bash tests/gpu_suite.sh tests/runtime  # some, one process
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$SECONDS
python3 -c "from ddtree.plugins.compile import compile_all; compile_all()" && echo "kernels compiled in $((SECONDS - start)) s"
paths=("$@"); [[ ${#paths[@]} -gt 0 ]] || paths=(tests/backends tests/bench tests/cli tests/parallel tests/plugins tests/runtime)
timeout "${SUITE_TIMEOUT:-500}" python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider --durations=10 \
  -n "${WORKERS:-4}" --dist loadfile "${paths[@]}" > "$out/gpu_suite.log" 2>&1
echo "suite rc=$? in $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_suite.log" | tail -40; grep -E "^SKIPPED" "$out/gpu_suite.log" | sed -E "s/^SKIPPED \[[0-9]+\] [^ ]+ //" | sort | uniq -c | sort -rn | head -12
