#!/usr/bin/env bash
# One device call for the MoE's two launches at 9..64 rows (issue 22; NOTES "MoE streaming"): knob sweep under uniform
# and tree routing, ncu stall sampling of gate_up and down, GPU tests, before/after benches. Trees under .cache (ignored):
#   .cache/moe_new   `git archive HEAD ddtree pyproject.toml tests/conftest.py tests/plugins tests/fixtures/plugins`
#                    + the changed files (other work in progress in the checkout is not measured with it)
#   .cache/moe_base  the baseline: `git archive <commit> ddtree`
# Every step's stdout in $OUT/<name>.out, stderr and status in log.txt; then one bundle.tgz of it all.
# Usage (repo root, on the device): STEPS=sweep,ncu,tests,base,new END_S=220 bash tests/plugins/moe_two_on_gpu.sh
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out/b"
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins
steps=,${STEPS:-sweep,ncu,tests},
end=${END_S:-220}
root=$PWD
new=$root/.cache/moe_new
[[ -d $new ]] || new=$root
ncu=/usr/local/cuda/bin/ncu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> "$out/b/log.txt"
source "$root/tests/plugins/gpu_lib.sh"          # gpu_step: each step under the call's time budget
step_out=$out/b
base=$root/.cache/moe_base
if [[ -d $base && ! -f $base/.bench_copied ]]; then   # the baseline's plans and kernels, this bench (--routing tree);
  cp "$new/ddtree/bench/kernels.py" "$base/ddtree/bench/kernels.py"   # its plans have no occupancy knob: 1
  sed -i 's/p\.gu_occ/1/; s/p\.dn_occ/1/' "$base/ddtree/bench/kernels.py"; touch "$base/.bench_copied"
fi
for tree in "$new" "$base"; do     # cubins compile once, before the timed steps need them
  [[ -d $tree ]] && (cd "$tree" && PYTHONPATH=$PWD python3 -c \
    "from ddtree.plugins.compile import compile_cubin; compile_cubin('moe.cu', 'sm_90')" >> "$out/b/log.txt" 2>&1 &)
done
wait
MS=${MS:-1,8,17,33,65}
for routing in uniform tree; do
  if [[ $steps == *,base,* && -d $base ]]; then
    gpu_step base_$routing 30 "$base" python3 -m ddtree bench moe --tp 8 --m $MS --no-router \
      --paths auto,two-kernel,stream --routing $routing --reuse 0.5 --json
  fi
  if [[ $steps == *,new,* ]]; then
    gpu_step new_$routing 30 "$new" python3 -m ddtree bench moe --tp 8 --m $MS --no-router \
      --paths auto,two-kernel,stream --routing $routing --reuse 0.5 --json
  fi
done
if [[ $steps == *,sweep,* ]]; then
  gpu_step sweep ${SWEEP_S:-90} "$new" python3 tests/plugins/sweep_moe_two.py 8 ${SWEEP_MS:-17,9,33} "${VARIANTS:-}"
fi
if [[ $steps == *,ncu,* ]]; then     # M = 17 uniform, the plan's kernels: launches 3-4 (gate_up, down of the 2nd run)
  gpu_step ncu ${NCU_S:-60} "$new" $ncu --clock-control none --section SourceCounters --section WarpStateStats \
    -k regex:"moe_(gate_up|down)_r" --launch-skip 2 -c 2 -f -o "$out/b/moe17" \
    python3 tests/plugins/profile_moe.py 8 17 uniform 3 ${NCU_KNOBS:-}
  if [[ -f $out/b/moe17.ncu-rep ]]; then
    $ncu -i "$out/b/moe17.ncu-rep" --page details > "$out/b/ncu_details.txt" 2>&1
    $ncu -i "$out/b/moe17.ncu-rep" --page source --csv --print-source sass > "$out/b/src.csv" 2>> "$out/b/log.txt"
    python3 "$new/tests/plugins/ncu_source_top.py" 45 < "$out/b/src.csv" > "$out/b/ncu_top.txt" 2>&1
    gzip -f "$out/b/src.csv"
  fi
fi
if [[ $steps == *,tests,* ]]; then
  gpu_step tests ${TEST_S:-90} "$new" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/plugins/test_moe_stream_gpu.py tests/plugins/test_kernels_gpu.py tests/plugins/test_batch_invariant_gpu.py -k moe
fi
tail -n 4 "$out"/b/*.out "$out/b/ncu_top.txt" 2>/dev/null | cut -c1-300 | tail -n 60
tar -czf "$out/bundle.tgz" -C "$out" b && rm -rf "$out/b"
