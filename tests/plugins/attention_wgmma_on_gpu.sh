#!/usr/bin/env bash
# One device call for the tree_wgmma form (issue 23): the layout probe (tests/plugins/probe_wgmma.py), its GPU
# tests and the launcher's smem sizes, then the default plans against tree_wgmma at 4096 / 32768 keys x 8 / 17
# tokens x 8 heads (tests/plugins/sweep_attention.py: split kernel + combine, and each alone). Repo root:
#   OUT=... bash tests/plugins/attention_wgmma_on_gpu.sh
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$SECONDS
timeout ${PROBE_TIMEOUT:-150} python3 tests/plugins/probe_wgmma.py 2>&1 | tail -12
echo "probe in $((SECONDS - t0)) s"
t0=$SECONDS
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rf --tb=short -p no:cacheprovider --maxfail=2 \
  tests/plugins/test_mla_wgmma_gpu.py > "$out/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - t0)) s"; tail -12 "$out/tests.log"
t0=$SECONDS
timeout ${SWEEP_TIMEOUT:-200} python3 tests/plugins/sweep_attention.py "T=4096,32768 q=8,17 parts" \
  "T=4096 q=8,17 form=tree_wgmma stages=2 splits=8,14,22,32,43 parts" \
  "T=32768 q=8,17 form=tree_wgmma stages=2 splits=32,43,64,86 parts" > "$out/sweep.jsonl" 2> "$out/sweep.err"
echo "sweep rc=$? in $((SECONDS - t0)) s"; grep -v "^$" "$out/sweep.err" | tail -40
