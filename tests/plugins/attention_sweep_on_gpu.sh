#!/usr/bin/env bash
# One device call for the short-context / many-row attention work (issue 23): the old code's bench (a
# baseline checkout in $BEFORE, e.g. `git archive HEAD ddtree | tar -x -C ../before`), plan sweeps
# (tests/plugins/sweep_attention.py -> $out/sweep.jsonl), block timelines (profile_attention.py), then GPU tests.
# Usage (repo root, on the device): MODE=explore|final BEFORE=../before bash tests/plugins/attention_sweep_on_gpu.sh
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup
deadline=$((SECONDS + ${BUDGET:-140}))   # every step ends by then, whatever its own limit
step() {   # timeout, log name, command...: run it, say how long it took
  local limit=$1 name=$2 t0=$SECONDS; shift 2
  (( limit > deadline - SECONDS )) && limit=$((deadline - SECONDS))
  (( limit > 0 )) || { echo "  $name: no time left" >&2; return; }
  timeout "$limit" "$@" 2>>"$out/$name.log"; echo "  $name rc=$? $((SECONDS - t0)) s" >&2
}
SHAPES="--context ${BEFORE_CONTEXTS:-4096,32768} --q 1,2,8,17 --heads 8"
if [[ -n ${BEFORE:-} && -d $BEFORE ]]; then
  (cd "$BEFORE" && PYTHONPATH=. step 25 before python3 -m ddtree bench attention $SHAPES --json) > "$out/before.json"
fi
sweep() { step "$1" sweep python3 tests/plugins/sweep_attention.py "${@:2}" >> "$out/sweep.jsonl"; }
case ${MODE:-explore} in
  explore)
    sweep 75 "T=4096,32768 q=1,2,8,17 parts" "T=64 q=1,2,8,17 parts l2" \
      "T=4096,32768 q=17 form=tree warps=2,4,8 stages=2,3 parts" \
      "T=4096 q=17 form=tree warps=4 stages=2 splits=4,8,13,25,51" \
      "T=32768 q=17 form=tree warps=4 stages=2 splits=13,25,51,102" \
      "T=4096,32768 q=8 form=tree warps=2,4,8 stages=2,3" \
      "T=4096,32768 q=17 form=tree warps=4,8 stages=2 l2" \
      "T=32768 q=2,8,17 form=decode parts" \
      "T=4096 q=1,2,8 splits=8,16,32 parts"
    DD_PROFILE=1 step 20 profile python3 tests/plugins/profile_attention.py 4096,17,8 4096,1,8 32768,17,8 \
      > "$out/profile.txt"
    TEST_TIMEOUT=35 gpu_tests tests/plugins/test_mla_attention_gpu.py \
      -k "every_variant and l512_r64 or smem_size or T4096_q1_h8] or T4096_q33_h8] or T65536_q8_h8]"
    DD_PROFILE=2 step 15 profile python3 tests/plugins/profile_attention.py 4096,17,8 32768,17,8 \
      >> "$out/profile.txt"
    ;;
  final)
    sweep 25 "T=4096,32768,131072 q=1,2,4,8,17,33 parts"
    TEST_TIMEOUT=$(( deadline - SECONDS - 30 < 70 ? deadline - SECONDS - 30 : 70 )) \
      gpu_tests tests/plugins/test_mla_attention_gpu.py
    sweep 60 "T=4096,32768 q=8,17,33 form=tree warps=2,4,8 stages=2,3,4 scale=1,0.5,2" \
      "T=131072 q=8,17 form=tree warps=4,8 stages=2,3" "T=4096,32768,131072 q=4,8 form=decode" \
      "T=32768 q=17 l2" "T=4096,32768 q=1,2,4 form=decode scale=0.5"
    DD_PROFILE=2 step 15 profile python3 tests/plugins/profile_attention.py 4096,17,8 32768,17,8 > "$out/profile.txt"
    ;;
esac
grep -h "^T=" "$out/sweep.log" 2>/dev/null | head -120
