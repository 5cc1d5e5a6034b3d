#!/usr/bin/env bash
# One device call for the fused router (issue 22): its GPU tests (and moe_route's alignment, which shares
# route_common.cuh), `bench moe --parts` before / after alternated, and the plan sweep (SWEEP: its arguments,
# default "1,17,65"; e.g. "1,2,17 --few"). Usage (repo root, on the GPU machine):
#   BEFORE=DIR [CUBINS=DIR] [DEADLINE=s] bash tests/plugins/router_on_gpu.sh
# DIR holds the kernel files to compare against (router.cu, route_common.cuh, route_select.cuh, router.py, e.g.
# from `git show HEAD:...`); they replace this tree's in a copy under /tmp. MS: the bench's rows (default
# 1,9,17,33,65). CUBINS: cubins compiled ahead (same NVRTC; the cache key is the sources' hash) copied into the kernel
# cache first. Results under $OUT (at most 7 files).
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup                                             # sets $out
root=$PWD before=/tmp/router_before
deadline=${DEADLINE:-190}
[[ -n ${CUBINS:-} ]] && mkdir -p "$DDTREE_KERNEL_CACHE" && cp "$CUBINS"/*.cubin "$DDTREE_KERNEL_CACHE"/
rm -rf "$before" && mkdir -p "$before" && cp -r ddtree "$before/"
cp "$BEFORE/router.cu" "$BEFORE/route_common.cuh" "$BEFORE/route_select.cuh" "$before/ddtree/plugins/kernels/"
cp "$BEFORE/router.py" "$before/ddtree/plugins/"

in_tree() { local d=$1; shift; (cd "$d" && PYTHONPATH="$d" "$@"); }
for d in "$root" "$before"; do                        # NVRTC in parallel: 8 cubins instead of one after another
  for s in router.cu moe.cu gemm.cu fill.cu; do
    in_tree "$d" python3 -c "from ddtree.plugins.compile import compile_cubin; compile_cubin('$s', 'sm_90')" &
  done
done >> "$out/log.txt" 2>&1
wait
echo "compiled at $SECONDS s" >> "$out/log.txt"

TEST_TIMEOUT=${TEST_TIMEOUT:-70} gpu_tests tests/plugins/test_router_gpu.py tests/plugins/test_kernels_gpu.py -k "router or alignment" \
  >> "$out/log.txt" 2>&1

bench() {                                             # bench TAG ROUND
  local d=$root; [[ $1 == before ]] && d=$before
  in_tree "$d" timeout 40 python3 -m ddtree bench moe --parts --tp 8 --m "${MS:-1,9,17,33,65}" --json \
    > "$out/moe_$1_$2.json" 2>> "$out/log.txt"
  echo "bench $1 round $2 done at $SECONDS s" >> "$out/log.txt"
}
bench before 1; bench after 1
left=$((deadline - 15 - SECONDS)); (( left > 60 )) && left=60
(( left > 5 )) && timeout $left python3 tests/plugins/sweep_router.py ${SWEEP:-1,17,65} > "$out/sweep.json" \
  2>> "$out/log.txt"
echo "sweep done at $SECONDS s" >> "$out/log.txt"
(( SECONDS < deadline - 45 )) && { bench after 2; bench before 2; }

echo "end at $SECONDS s" >> "$out/log.txt"
