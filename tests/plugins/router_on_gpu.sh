#!/usr/bin/env bash
# One device call for the fused router (issue 22): its GPU tests (and moe_route's alignment, which shares
# route_common.cuh), `bench moe --parts` before / after alternated, the plan sweep, and which plans of 129..145 rows
# launch. Usage (repo root, on the GPU machine):
#   BEFORE=DIR bash tests/plugins/router_on_gpu.sh
# DIR holds the kernel files to compare against (router.cu, route_common.cuh, router.py, e.g. from `git show
# HEAD:...`); they replace this tree's in a copy under /tmp. Results under $OUT (at most 7 files).
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup                                             # sets $out
root=$PWD before=/tmp/router_before
deadline=${DEADLINE:-190}
rm -rf "$before" && mkdir -p "$before" && cp -r ddtree "$before/"
cp "$BEFORE/router.cu" "$BEFORE/route_common.cuh" "$before/ddtree/plugins/kernels/"
cp "$BEFORE/router.py" "$before/ddtree/plugins/"

in_tree() { local d=$1; shift; (cd "$d" && PYTHONPATH="$d" "$@"); }
for d in "$root" "$before"; do                        # NVRTC in parallel: 8 cubins instead of one after another
  for s in router.cu moe.cu gemm.cu fill.cu; do
    in_tree "$d" python3 -c "from ddtree.plugins.compile import compile_cubin; compile_cubin('$s', 'sm_90')" &
  done
done >> "$out/log.txt" 2>&1
wait
echo "compiled at $SECONDS s" >> "$out/log.txt"

TEST_TIMEOUT=70 gpu_tests tests/plugins/test_router_gpu.py tests/plugins/test_kernels_gpu.py -k "router or alignment" \
  >> "$out/log.txt" 2>&1

bench() {                                             # bench TAG ROUND
  local d=$root; [[ $1 == before ]] && d=$before
  in_tree "$d" timeout 40 python3 -m ddtree bench moe --parts --tp 8 --m 1,17,65 --json > "$out/moe_$1_$2.json" \
    2>> "$out/log.txt"
  echo "bench $1 round $2 done at $SECONDS s" >> "$out/log.txt"
}
bench before 1; bench after 1
(( SECONDS < deadline - 60 )) && timeout $((deadline - 60 - SECONDS)) python3 tests/plugins/sweep_router.py 1,17,65 \
  > "$out/sweep.json" 2>> "$out/log.txt"
echo "sweep done at $SECONDS s" >> "$out/log.txt"
(( SECONDS < deadline - 45 )) && { bench after 2; bench before 2; }

fits() {
  in_tree "$1" timeout 20 python3 - <<'EOF'
import numpy as np
from ddtree.plugins.device import Gpu
from ddtree.plugins.router import FusedRouter, RouterShape
g, E, H, k, M = Gpu(0), 384, 7168, 8, 145
r = FusedRouter(g, RouterShape(E, H, k, scaling=2.827), g.zeros((E // 16, H // 64, 4, 32, 8), np.uint16), None)
outs = (g.zeros((M, E), np.float32), g.zeros((M, k), np.int32), g.zeros((M, k), np.float32))
tiles = (g.zeros(M * k + 7 * E, np.int32), g.zeros((M * k + 7 * E, 8), np.int32), g.zeros(1, np.int32))
x = g.zeros((M, H), np.uint16)
for m in (128, 129, 136, 144, 145):
    try:
        r.run(x, m, *outs, tiles)
        g.sync()
        print(m, r.plan(m), "ran")
    except Exception as e:                            # noqa: BLE001  (the report is the point)
        print(m, r.plan(m), "failed:", type(e).__name__, str(e)[:200])
EOF
}
(( SECONDS < deadline - 15 )) && { echo "plans of 128..145 rows, before:"; fits "$before"; echo "after:"; fits "$root"; } \
  >> "$out/log.txt" 2>&1
echo "end at $SECONDS s" >> "$out/log.txt"
