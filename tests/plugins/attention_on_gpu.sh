#!/usr/bin/env bash
# One device call for issue 7: the attention / KV-cache GPU tests, then `ddtree bench attention` runs
# (JSON lines in $OUT/attention.jsonl, tagged by the sweep knob), then a summary table.
# Usage (repo root, on the device; wheels as in the README's test set-up):
#   TESTS=1 BENCH="default" bash tests/plugins/attention_on_gpu.sh
#   BENCH="default stages warps splits" ...   also sweep the plan knobs
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup
gpu_tests tests/plugins/test_mla_attention_gpu.py
bench() { gpu_bench attention attention_command "$@"; }   # tag, args...
for what in ${BENCH:-default}; do
  case $what in
    default) bench default --context 4096,32768,131072 --q 1,4,8,16,64,256 --heads 8,64 ;;
    stages) for ws in 2,4 3,9 4,8; do
              bench decode-w${ws%,*}-s${ws#*,} --context 32768,131072 --q 1 --heads 8 --form decode --warps ${ws%,*} --stages ${ws#*,}
            done ;;
    groups) bench g2-w4 --context 32768,131072 --q 2 --heads 8 --form decode --row-groups 2 --warps 4 --stages 4
            bench g2-w6 --context 32768,131072 --q 2 --heads 8 --form decode --row-groups 2 --warps 6 --stages 9
            bench g4-w8 --context 32768,131072 --q 4 --heads 8 --form decode --row-groups 4 --warps 8 --stages 8
            bench g1-q4 --context 32768,131072 --q 4 --heads 8 --form decode --row-groups 1
            bench tree-q4 --context 32768,131072 --q 4 --heads 8 --form tree ;;
    l2) bench l2-decode --context 4096,32768 --q 1 --heads 8 --form decode --l2-resident
        bench l2-tree --context 4096,32768 --q 1,8,64 --heads 8 --form tree --l2-resident ;;
    forms) for q in 2 4 8; do bench tree-q$q --context 32768 --q $q --heads 8 --form tree; bench decode-q$q --context 32768 --q $q --heads 8 --form decode; done ;;
    warps) for w in 2 4 8; do bench tree-w$w --context 4096,32768 --q 64,256 --heads 8 --form tree --warps $w; done ;;
    splits) for s in 33 66 132 264 528; do bench splits$s --context 32768,131072 --q 1 --heads 8 --splits $s; done
            for s in 16 33 66 132; do bench tsplits$s --context 32768,131072 --q 8 --heads 8 --splits $s; done ;;
  esac
done
python3 - "$out/attention.jsonl" <<'PY'
import json, sys
try:
    lines = [json.loads(l) for l in open(sys.argv[1])]
except FileNotFoundError:
    sys.exit(0)
for run in lines:
    print(f"== {run['tag']}  {run['device']}  ceiling {run['ceiling']['gbps']:.0f} GB/s"
          + ("  (L2-resident diagnosis)" if run.get("l2_resident") else ""))
    for r in run["rows"]:
        p = r["plan"]
        print(f"H{r['heads']:3d} T{r['context']:7d} q{r['q']:4d} {r['latency_us']:9.2f} us {r['pct_of_ceiling']:5.1f} % "
              f"{r['tflops']:6.1f} TF ({r['pct_of_dense_bf16']} %)  {p['form']} w{p['warps']} s{p['stages']} "
              f"g{p['row_groups']} x{p['row_tiles']} "
              f"P{p['prefix_splits']}{'+t' if p['tree_own'] else ''}")
PY
