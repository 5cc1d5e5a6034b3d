#!/usr/bin/env bash
# One device call for the streaming MoE launch (issue 22; ddtree/plugins/kernels/NOTES.md "MoE streaming"): its GPU
# tests (and test_kernels_gpu's MoE tests: the two launches share w4_mainloop), then before/after benchmarks in the
# same call. Two trees, both carried to the device under .cache (ignored):
#   .cache/moe_base  the baseline: `git archive <commit> ddtree | tar -x -C .cache/moe_base`
#   .cache/moe_new   the change alone: `git archive <commit> ddtree tests pyproject.toml` + the changed files, so
#                    that other work in progress in the checkout (another kernel's edits) is not measured with it
# Outputs in $OUT: one .out a step, every step's stderr and exit status in log.txt (the device returns a few files).
# Usage (repo root, on the device):
#   bash tests/plugins/moe_stream_on_gpu.sh     STEPS=tests,base,new,sweep,engine (default all)  END_S=165
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins
steps=,${STEPS:-tests,base,new,sweep,engine},
end=${END_S:-165}
root=$PWD
new=$root/${NEW_TREE:-.cache/moe_new}
[[ -d $new ]] || new=$root                     # no isolated copy: this checkout
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> "$out/log.txt"
source "$root/tests/plugins/gpu_lib.sh"          # gpu_step: each step under the call's time budget
MS=${MS:-1,2,4,8,17,33,65}
for tree in "$new" "$root/.cache/moe_base"; do     # the benches' cubins compile beside the tests (pytest has its own)
  [[ -d $tree ]] && (cd "$tree" && PYTHONPATH=$PWD python3 -c \
    "from ddtree.plugins.compile import compile_cubin; compile_cubin('moe.cu', 'sm_90')" >> "$out/log.txt" 2>&1 &)
done
if [[ $steps == *,tests,* ]]; then     # one session: one compile (conftest's cache is per session)
  gpu_step tests ${TEST_S:-75} "$new" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/plugins/test_moe_stream_gpu.py tests/plugins/test_kernels_gpu.py -k moe
fi
if [[ $steps == *,base,* && -d $root/.cache/moe_base ]]; then
  gpu_step base 25 "$root/.cache/moe_base" python3 -m ddtree bench moe --tp 8 --m $MS --no-router \
    --paths two-kernel,stream --json
fi
if [[ $steps == *,new,* ]]; then       # the plan's choice (auto) beside both paths
  gpu_step new 25 "$new" python3 -m ddtree bench moe --tp 8 --m $MS --no-router --paths auto,two-kernel,stream --json
fi
if [[ $steps == *,sweep,* ]]; then     # per M: the two launches, then each variant (tests/plugins/sweep_moe_stream.py)
  gpu_step sweep_small 30 "$new" python3 tests/plugins/sweep_moe_stream.py 8 ${SMALL_MS:-1,2,4,8} \
    ${SMALL_VARIANTS:-default,bulk,bulk_pin_s14,bulk_pin_w8_tpw2,r5_s14,bulk_r5_s14,bulk_s8_tpw2}
  [[ -n ${MID_MS:-} ]] && gpu_step sweep_mid 30 "$new" python3 tests/plugins/sweep_moe_stream.py 8 $MID_MS \
    ${MID_VARIANTS:-default,w8_s4_2bps_tpw7}
  gpu_step sweep_large 30 "$new" python3 tests/plugins/sweep_moe_stream.py 8 ${LARGE_MS:-17,33,65} \
    ${LARGE_VARIANTS:-default,bulk,s4_tpw7,bulk_s4_tpw7,w8_s4_2bps_tpw7,bulk_w8_s4_2bps_tpw7}
fi
if [[ $steps == *,engine,* ]]; then    # the engine's MoE on the plan's path (batch-invariant plan, routed layers)
  gpu_step engine 60 "$new" python3 -m pytest -q -rf --tb=short -p no:cacheprovider tests/plugins/test_batch_invariant_gpu.py \
    tests/runtime/test_batch_invariant_step_gpu.py tests/runtime/test_cuda_moe_routing_gpu.py
fi
tail -n 3 "$out"/*.out 2>/dev/null | tail -n 40
