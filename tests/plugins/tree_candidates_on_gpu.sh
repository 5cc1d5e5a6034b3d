#!/usr/bin/env bash
# One device call for the candidate-table tree build (issue 23) and the router's planned lanes (issue 22):
#   1. every kernel compiled for sm_90 in parallel (this tree, then BEFORE's changed ones)
#   2. GPU tests: tree build / sampler / walk, the vocab nodes, the fused router, the tiny model's DDTree == AR
#   3. `ddtree bench tree --build auto,pops` (the planned build and the pops, same process); SWEEP=B,B,...: both
#      builds at those budgets (greedy, V 163840), for CANDIDATES_FROM
#   4. STEP=1: `ddtree bench step` at budget 16 (+ AR) here and in BEFORE (a `git archive` of the tree before)
# Every step is time-boxed (DEADLINE seconds in all) so what finished comes back. Results under $OUT.
#   BEFORE=.cache/step_before STEP=1 DEADLINE=540 bash tests/plugins/tree_candidates_on_gpu.sh
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup
end=$((SECONDS + ${DEADLINE:-540}))
root=$PWD

gpu_compile "$root" >> "$out/log.txt" 2>&1
[[ -n ${BEFORE:-} ]] && gpu_compile "$BEFORE" tree_build.cu router.cu >> "$out/log.txt" 2>&1
echo "compiled at $SECONDS s" >> "$out/log.txt"

T=tests/plugins
TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests $T/test_tree_gpu.py $T/test_vocab_nodes_gpu.py $T/test_sampler_graph_gpu.py \
  $T/test_router_gpu.py tests/runtime/test_cuda_step_gpu.py >> "$out/log.txt" 2>&1
echo "tests done at $SECONDS s" >> "$out/log.txt"

gpu_step tree 90 "$root" python3 -m ddtree bench tree --vocab 163840,20480 --budget 16,64 --mode greedy,top_p0.95 \
  --build auto,pops --json
[[ -n ${SWEEP:-} ]] && gpu_step tree_sweep 90 "$root" python3 -m ddtree bench tree --vocab 163840 --budget "$SWEEP" \
  --mode greedy --build candidates,pops --json
if [[ ${STEP:-0} == 1 ]]; then
  step_args="--context 4096 --budget 16 --routing uniform,tree --reuse 0.5 --accept 4 --ar --repeats 10 --json"
  gpu_step step_after 200 "$root" python3 -m ddtree bench step $step_args
  [[ -n ${BEFORE:-} ]] && gpu_step step_before 200 "$BEFORE" python3 -m ddtree bench step $step_args
fi
echo "end at $SECONDS s" >> "$out/log.txt"
