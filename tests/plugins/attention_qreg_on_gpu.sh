#!/usr/bin/env bash
# One device call for the tree_qreg experiment (issue 23): its GPU tests (Kimi and (64, 16) dims; the
# launcher's smem sizes), then `ddtree bench attention` at 4096 / 32768 keys x 8 / 17 tokens x 8 heads with the
# default plans and with tree_qreg forced at each block shape. Repo root, on the device:
#   OUT=... bash tests/plugins/attention_qreg_on_gpu.sh
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$SECONDS
timeout ${TEST_TIMEOUT:-40} python3 -m pytest -q -rf --tb=short -p no:cacheprovider --maxfail=3 \
  tests/plugins/test_mla_attention_gpu.py -k "qreg and (l512 or l64) or smem_size and l512" > "$out/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - t0)) s"; tail -15 "$out/tests.log"
shapes="--context 4096,32768 --q 8,17 --heads 8"
t0=$SECONDS
timeout ${BENCH_TIMEOUT:-25} python3 -m ddtree bench attention $shapes --json > "$out/default.json" 2> "$out/default.err"
echo "default rc=$? in $((SECONDS - t0)) s"; grep "^H" "$out/default.err"
t0=$SECONDS
timeout ${QREG_TIMEOUT:-30} python3 -m ddtree bench attention $shapes --form tree_qreg --warps 2,4,8 --row-groups 2,4 \
  --json > "$out/qreg.json" 2> "$out/qreg.err"
echo "qreg rc=$? in $((SECONDS - t0)) s"; grep -v "^$" "$out/qreg.err" | tail -20
