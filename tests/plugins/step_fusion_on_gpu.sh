#!/usr/bin/env bash
# One device call for the step's kernel boundaries (issue 22): the GPU tests of the fused query side (absorb + rope)
# and of the layers and steps that run it, then `ddtree bench step` here, in a base tree, and here with the knobs
# of $KNOBS (one run each, same process kind, same call); probe: tests/plugins/probe_boundaries.py.
#   .cache/step_base    the baseline: `git archive <commit> ddtree | tar -x -C .cache/step_base` (carried, ignored)
#   .cache/step_cubins  sm_90 cubins of both trees compiled on the CPU machine (optional; NVRTC recompiles on a
#                       version mismatch)
# Outputs in $OUT: one file a step and log.txt (each step's command, stderr, exit status and seconds).
# Usage (repo root, on the device):
#   STEPS=tests,probe,new,base,knobs,again KNOBS="--shared-join down" END_S=560 bash tests/plugins/step_fusion_on_gpu.sh
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
root=$PWD
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=$root/.cache/step_cubins
steps=,${STEPS:-tests,new,base,knobs},
end=${END_S:-560}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> "$out/log.txt"
source "$root/tests/plugins/gpu_lib.sh"
(gpu_compile "$root"; [[ -d $root/.cache/step_base ]] && gpu_compile "$root/.cache/step_base") >> "$out/log.txt" 2>&1
if [[ $steps == *,tests,* ]]; then
  gpu_step tests ${TEST_S:-150} "$root" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    ${TESTS:-tests/plugins/test_absorb_gpu.py tests/plugins/test_layer_ops_gpu.py tests/runtime/test_kimi_two_layers_gpu.py
    tests/runtime/test_cuda_step_gpu.py tests/runtime/test_batch_invariant_step_gpu.py
    tests/runtime/test_cuda_moe_routing_gpu.py} ${EXTRA_TESTS:-}
fi
[[ $steps == *,probe,* ]] && gpu_step probe 40 "$root" python3 tests/plugins/probe_boundaries.py --json
STEP_ARGS=${STEP_ARGS:---context 4096 --budget 16 --routing uniform,tree --reuse 0.5 --accept 4 --repeats 8 --json}
[[ $steps == *,new,* ]] && gpu_step step_new ${STEP_S:-140} "$root" python3 -m ddtree bench step $STEP_ARGS
[[ $steps == *,base,* && -d $root/.cache/step_base ]] && gpu_step step_base ${STEP_S:-140} "$root/.cache/step_base" \
  python3 -m ddtree bench step $STEP_ARGS
[[ $steps == *,knobs,* ]] && gpu_step step_knobs ${STEP_S:-140} "$root" python3 -m ddtree bench step $STEP_ARGS \
  ${KNOBS:---shared-join down}
if [[ $steps == *,again,* ]]; then                     # the spread: this tree and its knobs once more, in turn
  gpu_step step_new2 ${STEP_S:-140} "$root" python3 -m ddtree bench step $STEP_ARGS
  gpu_step step_knobs2 ${STEP_S:-140} "$root" python3 -m ddtree bench step $STEP_ARGS ${KNOBS:---shared-join down}
fi
tail -n 3 "$out"/tests.out 2>/dev/null
grep -h "step\|==" "$out/log.txt" | tail -n 30
