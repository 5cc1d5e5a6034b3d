#!/usr/bin/env bash
# One device call for issue 8: the tree build / sampler / walk GPU tests, then `ddtree bench tree`
# (JSON lines in $OUT/tree.jsonl, tagged), then a summary table.
# Usage (repo root, on the device; wheels as in the README's GPU section):
#   TESTS=1 BENCH="default flat" bash tests/plugins/tree_on_gpu.sh
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins PYTHONPATH=${PYTHONPATH:-}:.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [[ ${TESTS:-1} == 1 ]]; then
  start=$SECONDS
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rf --tb=short -p no:cacheprovider --maxfail=${MAXFAIL:-10} \
    tests/plugins/test_tree_gpu.py ${EXTRA_TESTS:-} > "$out/tests.log" 2>&1
  echo "tests rc=$? in $((SECONDS - start)) s"; grep -E "passed|failed|Error|error|assert" "$out/tests.log" | tail -40
fi
bench() {   # tag, args...
  local tag=$1; shift; local t0=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} python3 -c "from ddtree.bench.tree import tree_command as c; c()" \
    --json "$@" 2>>"$out/bench.err" \
    | python3 -c "import json,sys; [print(json.dumps({'tag': '$tag', **json.loads(l)})) for l in sys.stdin if l.strip()]" \
    >> "$out/tree.jsonl"
  echo "  $tag ($*): $((SECONDS - t0)) s"
}
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
