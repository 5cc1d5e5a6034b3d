#!/usr/bin/env bash
# One device call for issue 7: the attention / KV-cache GPU tests, then `ddtree bench attention` runs
# (JSON lines in $OUT/attention.jsonl, tagged by the sweep knob), then a summary table.
# Usage (repo root, on the device; wheels as in the README's GPU section):
#   TESTS=1 BENCH="default" bash tests/plugins/attention_on_gpu.sh
#   BENCH="default stages pairs splits" ...   also sweep the plan knobs
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins PYTHONPATH=${PYTHONPATH:-}:.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [[ ${TESTS:-1} == 1 ]]; then
  start=$SECONDS
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rf --tb=short -p no:cacheprovider --maxfail=10 \
    tests/plugins/test_mla_attention_gpu.py ${EXTRA_TESTS:-} > "$out/tests.log" 2>&1
  echo "tests rc=$? in $((SECONDS - start)) s"; grep -E "passed|failed|Error|error" "$out/tests.log" | tail -30
fi
bench() {   # tag, args...
  local tag=$1; shift; local t0=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} python3 -c "from ddtree.bench.attention import attention_command as c; c()" \
    --json "$@" 2>>"$out/bench.err" \
    | python3 -c "import json,sys; [print(json.dumps({'tag': '$tag', **json.loads(l)})) for l in sys.stdin if l.strip()]" \
    >> "$out/attention.jsonl"
  echo "  $tag ($*): $((SECONDS - t0)) s"
}
for what in ${BENCH:-default}; do
  case $what in
    default) bench default --context 4096,32768,131072 --q 1,4,8,16,64,256 --heads 8,64 ;;
    stages) for s in 2 3 4; do bench stages$s --context 32768,131072 --q 1,4 --heads 8 --pairs 1 --stages $s; done ;;
    pairs) for p in 1 2 4; do bench pairs$p --context 4096,32768 --q 64,256 --heads 8,64 --pairs $p; done ;;
    splits) for s in 32 64 128 256 512; do bench splits$s --context 32768,131072 --q 1 --heads 8 --splits $s; done ;;
  esac
done
python3 - "$out/attention.jsonl" <<'PY'
import json, sys
try:
    lines = [json.loads(l) for l in open(sys.argv[1])]
except FileNotFoundError:
    sys.exit(0)
for run in lines:
    print(f"== {run['tag']}  {run['device']}  ceiling {run['ceiling']['gbps']:.0f} GB/s")
    for r in run["rows"]:
        p = r["plan"]
        print(f"H{r['heads']:3d} T{r['context']:7d} q{r['q']:4d} {r['latency_us']:9.2f} us {r['pct_of_ceiling']:5.1f} % "
              f"{r['tflops']:6.1f} TF ({r['pct_of_dense_bf16']} %)  p{p['pairs']} s{p['stages']} x{p['row_tiles']} "
              f"P{p['prefix_splits']}{'+t' if p['tree_own'] else ''}")
PY
