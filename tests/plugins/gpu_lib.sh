# Shared by the one-call device scripts (attention_on_gpu.sh, tree_on_gpu.sh): source it from the repo root.
#   gpu_setup                      $out (absolute; $OUT or ./gpu-out), environment, the GPU's name and clocks
#   gpu_tests FILE...              pytest on the files -> $out/tests.log, a summary ($TESTS=0 skips)
#   gpu_bench MODULE CMD TAG ARGS  `ddtree.bench.MODULE.CMD --json ARGS` -> one tagged line of $out/MODULE.jsonl
gpu_setup() {
  out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
  export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins PYTHONPATH=${PYTHONPATH:-}:.
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
}

gpu_tests() {
  [[ ${TESTS:-1} == 1 ]] || return 0
  local start=$SECONDS
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rf --tb=short -p no:cacheprovider --maxfail=${MAXFAIL:-10} \
    "$@" ${EXTRA_TESTS:-} > "$out/tests.log" 2>&1
  echo "tests rc=$? in $((SECONDS - start)) s"; grep -E "passed|failed|Error|error|assert" "$out/tests.log" | tail -40
}

gpu_bench() {
  local module=$1 cmd=$2 tag=$3; shift 3; local t0=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} python3 -c "from ddtree.bench.$module import $cmd as c; c()" \
    --json "$@" 2>>"$out/bench.err" \
    | python3 -c "import json,sys; [print(json.dumps({'tag': '$tag', **json.loads(l)})) for l in sys.stdin if l.strip()]" \
    >> "$out/$module.jsonl"
  echo "  $tag ($*): $((SECONDS - t0)) s"
}
