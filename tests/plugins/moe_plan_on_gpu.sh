#!/usr/bin/env bash
# One device call for a MoE kernel or plan change (issue 22; NOTES "MoE streaming"), before / after:
#   1. kernels compiled for sm_90 in parallel (this tree; BEFORE's BEFORE_SOURCES, default moe.cu)
#   2. GPU tests: the MoE launches (bitwise against each other, the float64 rule), the batch-invariant MoE;
#      RUNTIME=1: also the runtime's routed MoE and DDTree == AR step tests
#   3. `ddtree bench moe --tp 8` at MS rows, uniform and tree routing, here and in BEFORE (same process each)
#   4. tests/plugins/sweep_moe_two.py at SWEEP_MS rows with VARIANTS (here)
#   5. STEP=1: `ddtree bench step` at budget 16 here and in BEFORE
#   6. NCU=1: ncu stall sampling of gate_up / down at 17 rows, here
#   7. GEMM_MS=M,M..: tests/plugins/sweep_gemm.py 8 at those rows (every skinny GEMM plan), here
#   GEMM_BENCH=M,M..: `ddtree bench gemm --tp 8` at those rows here and in BEFORE (before the step)
#   MORE_TESTS="FILE ...": more GPU test files in step 2's second pytest (with RUNTIME=1)
# Then $OUT/bundle.tgz holds every file (the device returns few files).
# BEFORE is a `git archive` of the commit before (its own bench). Every step time-boxed (DEADLINE s in all).
#   BEFORE=.cache/base STEP=1 DEADLINE=540 bash tests/plugins/moe_plan_on_gpu.sh
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup
end=$((SECONDS + ${DEADLINE:-540}))
root=$PWD
gpu_compile "$root" >> "$out/log.txt" 2>&1 &
[[ -n ${BEFORE:-} ]] && gpu_compile "$BEFORE" ${BEFORE_SOURCES:-moe.cu} >> "$out/log.txt" 2>&1 &
wait
echo "compiled at $SECONDS s" >> "$out/log.txt"

T=tests/plugins
TEST_TIMEOUT=${TEST_TIMEOUT:-150} gpu_tests $T/test_moe_stream_gpu.py $T/test_kernels_gpu.py \
  $T/test_batch_invariant_gpu.py -k moe >> "$out/log.txt" 2>&1
if [[ ${RUNTIME:-0} == 1 ]]; then
  cp "$out/tests.log" "$out/tests_kernels.log"
  TEST_TIMEOUT=${TEST2_TIMEOUT:-150} gpu_tests tests/runtime/test_cuda_moe_routing_gpu.py tests/runtime/test_batch_invariant_step_gpu.py \
    tests/runtime/test_cuda_step_gpu.py ${MORE_TESTS:-} >> "$out/log.txt" 2>&1
fi
echo "tests done at $SECONDS s" >> "$out/log.txt"

MS=${MS:-1,8,12,17,24,33}
for routing in uniform tree; do
  args="--tp 8 --m $MS --no-router --paths auto,two-kernel,stream --routing $routing --reuse 0.5 --json"
  gpu_step moe_after_$routing 40 "$root" python3 -m ddtree bench moe $args
  [[ -n ${BEFORE:-} ]] && gpu_step moe_before_$routing 40 "$BEFORE" python3 -m ddtree bench moe $args
done
[[ -n ${VARIANTS:-} ]] && gpu_step sweep ${SWEEP_S:-120} "$root" python3 $T/sweep_moe_two.py 8 ${SWEEP_MS:-12,17,24} \
  "$VARIANTS"
if [[ -n ${GEMM_BENCH:-} ]]; then
  gpu_step gemm_after 60 "$root" python3 -m ddtree bench gemm --tp 8 --m "$GEMM_BENCH" --json
  [[ -n ${BEFORE:-} ]] && gpu_step gemm_before 60 "$BEFORE" python3 -m ddtree bench gemm --tp 8 --m "$GEMM_BENCH" --json
fi
if [[ ${STEP:-0} == 1 ]]; then
  step_args="--context 4096 --budget 16 --routing uniform,tree --reuse 0.5 --accept 4 --repeats 10 --json"
  gpu_step step_after 120 "$root" python3 -m ddtree bench step $step_args
  [[ -n ${BEFORE:-} ]] && gpu_step step_before 120 "$BEFORE" python3 -m ddtree bench step $step_args
fi
if [[ ${NCU:-0} == 1 ]]; then     # M = 17 uniform, the plan's kernels: launches 3-4 (gate_up, down of the 2nd run)
  ncu=/usr/local/cuda/bin/ncu
  gpu_step ncu 70 "$root" $ncu --clock-control none --section SourceCounters --section WarpStateStats \
    -k regex:"moe_(gate_up|down)_r" --launch-skip 2 -c 2 -f -o "$out/moe17" python3 $T/profile_moe.py 8 17 uniform 3
  if [[ -f $out/moe17.ncu-rep ]]; then
    $ncu -i "$out/moe17.ncu-rep" --page source --csv --print-source sass 2>> "$out/log.txt" \
      | python3 $T/ncu_source_top.py 45 > "$out/ncu_top.txt" 2>&1
    $ncu -i "$out/moe17.ncu-rep" --page details > "$out/ncu_details.txt" 2>&1
    rm -f "$out/moe17.ncu-rep"
  fi
fi
[[ -n ${GEMM_MS:-} ]] && gpu_step gemm_sweep 150 "$root" python3 $T/sweep_gemm.py 8 "$GEMM_MS"
echo "end at $SECONDS s" >> "$out/log.txt"
(cd "$out" && tar -czf bundle.tgz --exclude bundle.tgz ./* && find . -type f ! -name bundle.tgz ! -name log.txt -delete)
