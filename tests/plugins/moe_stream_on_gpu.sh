#!/usr/bin/env bash
# One device call for the streaming MoE launch (issue 22; ddtree/plugins/kernels/NOTES.md "MoE streaming"):
# its GPU tests, then before/after benchmarks in the same call: the baseline checkout in .cache/moe_base
# (`git archive <commit> ddtree | tar -x -C .cache/moe_base`, carried to the device) and this tree's two
# launches and streaming launch, then the variant sweep. JSON in $OUT (one .out a step, stderr in log.txt: the
# device returns at most 8 files). Usage (repo root, on the device):
#   bash tests/plugins/moe_stream_on_gpu.sh            STEPS=tests,bench,sweep,sweep1,old,engine (default all)
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins
steps=,${STEPS:-tests,bench,sweep,sweep1,old,engine},
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
run() {   # name, timeout, command...: stdout -> $out/<name>.out, stderr appended to $out/log.txt (the device
  local name=$1 limit=$2; shift 2      # returns a few files only: keep their count small)
  local t0=$SECONDS
  echo "== $name: $*" >> "$out/log.txt"
  timeout "$limit" "$@" > "$out/$name.out" 2> "$out/$name.err"; local rc=$?
  cat "$out/$name.err" >> "$out/log.txt"; rm -f "$out/$name.err"
  echo "$name rc=$rc in $((SECONDS - t0)) s"; tail -3 "$out/log.txt"
}
if [[ $steps == *,tests,* ]]; then
  run tests ${TEST_TIMEOUT:-40} python3 -m pytest -q -x -rf --tb=short -p no:cacheprovider tests/plugins/test_moe_stream_gpu.py
  tail -15 "$out/tests.out"
fi
if [[ $steps == *,bench,* ]]; then
  MS=${MS:-1,2,4,8,17,33,65}
  if [[ -d .cache/moe_base ]]; then
    (cd .cache/moe_base && PYTHONPATH=$PWD run base 25 python3 -m ddtree bench moe --tp 8 --m $MS --no-router --json)
  fi
  run new 25 python3 -m ddtree bench moe --tp 8 --m $MS --no-router --paths two-kernel,stream --json
fi
if [[ $steps == *,sweep,* ]]; then
  run sweep8 40 python3 tests/plugins/sweep_moe_stream.py 8 ${SWEEP_MS:-1,2,4,8,17,33,65} ${VARIANTS:-}
fi
if [[ $steps == *,sweep1,* ]]; then
  run sweep1 25 python3 tests/plugins/sweep_moe_stream.py 1 1,17 default,tpw1,tpw2,s4_tpw2,w8_s4_2bps
fi
if [[ $steps == *,old,* ]]; then       # the two launches after the refactor (stream_default off)
  run old ${OLD_TIMEOUT:-35} python3 -c "import sys, pytest, ddtree.plugins.moe as m; m.STREAM_MEASURED.clear()
sys.exit(pytest.main(['-q', '-rf', '--tb=short', '-p', 'no:cacheprovider', 'tests/plugins/test_kernels_gpu.py', '-k', 'moe']))"
  tail -5 "$out/old.out"
fi
if [[ $steps == *,engine,* ]]; then     # the engine's MoE on the plan's path (the streaming launch where measured)
  run engine $((${END_S:-190} - SECONDS)) python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/plugins/test_batch_invariant_gpu.py tests/runtime/test_batch_invariant_step_gpu.py \
    tests/runtime/test_cuda_moe_routing_gpu.py
  tail -5 "$out/engine.out"
fi
