# Shared by the one-call device scripts (attention_on_gpu.sh, tree_on_gpu.sh, gemm_on_gpu.sh, moe_*_on_gpu.sh): source
# it from the repo root.
#   gpu_setup                      $out (absolute; $OUT or ./gpu-out), environment, the GPU's name and clocks
#   gpu_tests FILE...              pytest on the files -> $out/tests.log, a summary ($TESTS=0 skips)
#   gpu_bench MODULE CMD TAG ARGS  `ddtree.bench.MODULE.CMD --json ARGS` -> one tagged line of $out/MODULE.jsonl
#   gpu_step NAME LIMIT DIR CMD    CMD under the call's time budget $end -> $step_out/NAME.out (below)
#   gpu_compile DIR [SOURCES...]   sm_90 cubins of DIR's kernels (default all of them), one NVRTC process a source
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

# gpu_step NAME LIMIT DIR CMD...: CMD in DIR (PYTHONPATH=DIR) under LIMIT s, capped by what is left of the call's
# budget $end (seconds since the script started) -> $step_out/NAME.out; its stderr and the step's lines go to
# $step_out/log.txt ($step_out defaults to $out). Skipped, and said so, when under 5 s are left.
gpu_step() {
  local name=$1 limit=$2 dir=$3; shift 3
  local to=${step_out:-$out}
  local left=$((end - SECONDS)); ((limit > left)) && limit=$left
  ((limit < 5)) && { echo "== $name skipped (time)" >> "$to/log.txt"; return; }
  local t0=$SECONDS
  echo "== $name (${limit} s): $*" >> "$to/log.txt"
  (cd "$dir" && PYTHONPATH=$PWD timeout "$limit" "$@") > "$to/$name.out" 2>> "$to/log.txt"
  echo "== $name rc=$? in $((SECONDS - t0)) s" >> "$to/log.txt"
}

# gpu_compile DIR [SOURCES...]: compile DIR's kernel sources for sm_90 into the shared cache, in parallel (the latent
# ones at Kimi's dims); default every source of ddtree/plugins/compile.py SOURCES.
gpu_compile() {
  local d=$1; shift
  local sources=("$@")
  ((${#sources[@]})) || sources=($(cd "$d" && PYTHONPATH=$d python3 -c \
    "import ddtree.plugins.compile as kc; print(' '.join(kc.SOURCES))"))
  for s in "${sources[@]}"; do
    (cd "$d" && PYTHONPATH=$d python3 -c "
import ddtree.plugins.compile as kc
s = '$s'
kc.compile_cubin(s, 'sm_90', kc.latent_defines(kc.KIMI_LATENT, kc.KIMI_ROPE) if s in kc.LATENT_SOURCES else None)") &
  done
  wait
}
