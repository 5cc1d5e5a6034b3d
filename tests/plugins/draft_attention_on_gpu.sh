#!/usr/bin/env bash
# One device call for the drafter attention's splits (issue 22's step): its GPU tests and the runtime's step tests,
# tests/plugins/sweep_draft_attention.py, then `ddtree bench step` at budget 16 here and in BEFORE (a `git archive`
# of the tree before). Time-boxed (DEADLINE s); results under $OUT.
#   BEFORE=.cache/step_head DEADLINE=400 bash tests/plugins/draft_attention_on_gpu.sh
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup
end=$((SECONDS + ${DEADLINE:-400}))
root=$PWD
gpu_compile "$root" >> "$out/log.txt" 2>&1
[[ -n ${BEFORE:-} ]] && gpu_compile "$BEFORE" draft_attention.cu >> "$out/log.txt" 2>&1
echo "compiled at $SECONDS s" >> "$out/log.txt"
TEST_TIMEOUT=${TEST_TIMEOUT:-150} gpu_tests tests/plugins/test_draft_attention_gpu.py tests/runtime/test_cuda_step_gpu.py \
  tests/runtime/test_batch_invariant_step_gpu.py >> "$out/log.txt" 2>&1
gpu_step sweep 60 "$root" python3 tests/plugins/sweep_draft_attention.py 4096,32768 9,17,33,65,132
step_args="--context 4096 --budget 16 --routing uniform,tree --reuse 0.5 --accept 4 --repeats 10 --json"
gpu_step step_after 150 "$root" python3 -m ddtree bench step $step_args
[[ -n ${BEFORE:-} ]] && gpu_step step_before 150 "$BEFORE" python3 -m ddtree bench step $step_args
echo "end at $SECONDS s" >> "$out/log.txt"
