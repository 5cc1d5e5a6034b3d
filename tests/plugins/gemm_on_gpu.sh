#!/usr/bin/env bash
# One device call for the skinny GEMM past 16 rows (issue 22): its GPU tests, before/after `bench gemm` in the
# same call (base: another tree; mt: this tree's 8-row kernels, `--form mt`), the tile sweep (sweep_gemm_tiles.py),
# Nsight Compute stall sampling (profile_gemm.py), and `ddtree bench step` here and in the base tree ($STEP_ARGS).
#   .cache/gemm_base   the baseline: `git archive <commit> ddtree | tar -x -C .cache/gemm_base` (carried, ignored)
#   .cache/gemm_cubins cubins compiled here for sm_90 (optional; NVRTC recompiles on a version mismatch)
# Outputs in $OUT: one file a step and log.txt (each step's command, stderr, exit status and seconds).
# Usage (repo root, on the device):
#   bash tests/plugins/gemm_on_gpu.sh     STEPS=tests,base,mt,fitted,tm,new,sweep,ncu,step (default: tests,base,mt,new,sweep,ncu)  END_S=225
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
root=$PWD
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=$root/.cache/gemm_cubins
steps=,${STEPS:-tests,base,mt,new,sweep,ncu},
end=${END_S:-225}
MS=${MS:-1,17,33,65}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> "$out/log.txt"
source "$root/tests/plugins/gpu_lib.sh"          # gpu_step: each step under the call's time budget
if [[ $steps == *,step,* ]]; then                     # every kernel of this tree, the base's gemm.cu (shared cache)
  (gpu_compile "$root"; [[ -d $root/.cache/gemm_base ]] && gpu_compile "$root/.cache/gemm_base" gemm.cu) \
    >> "$out/log.txt" 2>&1 &
else
  for tree in "$root" "$root/.cache/gemm_base"; do      # compile both trees' gemm.cu beside the tests
    [[ -d $tree ]] && (cd "$tree" && PYTHONPATH=$PWD python3 -c \
      "from ddtree.plugins.compile import compile_cubin as c; c('gemm.cu', 'sm_90'); c('fill.cu', 'sm_90')" \
      >> "$out/log.txt" 2>&1 &)
  done
fi
if [[ $steps == *,tests,* ]]; then
  gpu_step tests ${TEST_S:-80} "$root" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/plugins/test_kernels_gpu.py tests/plugins/test_gemm_swiglu_gpu.py tests/plugins/test_batch_invariant_gpu.py \
    tests/plugins/test_gemm_tm_gpu.py tests/plugins/test_gemm_dsmem_gpu.py tests/plugins/test_gemm_measured_gpu.py \
    -k "gemm or swiglu"
  [[ -n ${RUNTIME_TESTS:-} ]] && gpu_step runtime_tests ${RUNTIME_S:-90} "$root" python3 -m pytest -q -rf --tb=short \
    -p no:cacheprovider $RUNTIME_TESTS                 # e.g. the DDTree == AR step tests the GEMM plans reach
fi
wait
if [[ $steps == *,base,* && -d $root/.cache/gemm_base ]]; then
  gpu_step base 25 "$root/.cache/gemm_base" python3 -m ddtree bench gemm --tp 8 --m $MS --json
fi
if [[ $steps == *,mt,* ]]; then                         # the 8-row kernels with global split-K partials (before dsmem)
  gpu_step mt 25 "$root" python3 -m ddtree bench gemm --tp 8 --m $MS --form mt --no-dsmem --json
fi
if [[ $steps == *,fitted,* ]]; then                     # this tree without the measured table (gemm_measured.py)
  gpu_step fitted 25 "$root" python3 -m ddtree bench gemm --tp 8 --m $MS --fitted --json
fi
if [[ $steps == *,tm,* ]]; then
  gpu_step tm 25 "$root" python3 -m ddtree bench gemm --tp 8 --m $MS --form tm --json
fi
if [[ $steps == *,new,* ]]; then
  gpu_step new 25 "$root" python3 -m ddtree bench gemm --tp 8 --m $MS --json
fi
if [[ $steps == *,sweep,* ]]; then
  gpu_step sweep ${SWEEP_S:-60} "$root" python3 tests/plugins/sweep_gemm_tiles.py 8 ${SWEEP_MS:-17,33,65}
fi
if [[ $steps == *,ncu,* ]]; then
  gpu_step ncu ${NCU_S:-50} "$root" /usr/local/cuda/bin/ncu --kernel-name regex:gemm_bf16 --section WarpStateStats \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    python3 tests/plugins/profile_gemm.py ${NCU_CASES:-lm_head:65 lm_head:65:tpw=4,warps=4,max_mt=9}
fi
STEP_ARGS=${STEP_ARGS:---context 4096 --budget 16 --routing uniform,tree --reuse 0.5 --accept 4 --repeats 10 --json}
if [[ $steps == *,step,* ]]; then
  gpu_step step_new ${STEP_S:-150} "$root" python3 -m ddtree bench step $STEP_ARGS
  [[ -d $root/.cache/gemm_base ]] && gpu_step step_base ${STEP_S:-150} "$root/.cache/gemm_base" \
    python3 -m ddtree bench step $STEP_ARGS
fi
tail -n 4 "$out"/*.out 2>/dev/null | tail -n 40
