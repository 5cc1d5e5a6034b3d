#!/usr/bin/env bash
# One device call for issue 8: the tree build / sampler / walk GPU tests, then `ddtree bench tree`
# (JSON lines in $OUT/tree.jsonl, tagged), then a summary table.
# Usage (repo root, on the device; wheels as in the README's test set-up):
#   TESTS=1 BENCH="default flat" bash tests/plugins/tree_on_gpu.sh
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup
gpu_tests tests/plugins/test_tree_gpu.py
bench() { gpu_bench tree tree_command "$@"; }   # tag, args...
for what in ${BENCH:-default}; do
  case $what in
    default) bench default --vocab 32768,163840 --budget 16,64,255 ;;
    flat) bench flat --vocab 163840 --budget 64 --flat ;;
    none) ;;
  esac
done
tail -5 "$out/bench.err" 2>/dev/null
python3 - "$out/tree.jsonl" <<'PY'
import json, sys
try:
    lines = [json.loads(l) for l in open(sys.argv[1])]
except FileNotFoundError:
    sys.exit(0)
for run in lines:
    print(f"== {run['tag']}  {run['device']}  ceiling {run['ceiling']['gbps']:.0f} GB/s")
    for r in run["rows"]:
        print(f"V{r['vocab']:7d} B{r['budget']:4d} {r['mode']:>17s} {r['logits']:>6s}: build {r['build_us']:8.2f}  "
              f"walk {r['walk_us']:8.2f}  together {r['total_us']:8.2f} us  (read once {r['read_once_us']:.2f}, full-row rows {r['full_row_rows']})")
PY
