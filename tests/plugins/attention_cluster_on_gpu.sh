#!/usr/bin/env bash
# One device call for issue 23's 4K x 17 fixed costs: the cluster-merged splits (_c4 / _c8) and the load-warp
# variants (_ld). The old code's bench from a baseline checkout ($BEFORE: `git archive <commit> ddtree`), the
# new code's default plans, a smoke test of the new kernels, the knob sweep (sweep_attention.py ->
# $out/sweep.jsonl), then the attention GPU tests. $CUBINS: a kernel cache compiled ahead on the CPU (copied to
# /tmp, used where its NVRTC key matches). Every step ends by the deadline ($BUDGET s, default 160).
# Usage (repo root, on the device): BEFORE=.s12attn/before CUBINS=.s12attn/cubins bash tests/plugins/attention_cluster_on_gpu.sh
set -uo pipefail
source tests/plugins/gpu_lib.sh
gpu_setup
if [[ -n ${CUBINS:-} && -d $CUBINS ]]; then mkdir -p "$DDTREE_KERNEL_CACHE"; cp -n "$CUBINS"/*.cubin "$DDTREE_KERNEL_CACHE"/; fi
python3 -c "from ddtree.plugins.compile import nvrtc_version; import cuda.core; print('nvrtc', nvrtc_version(), 'cuda.core', cuda.core.__version__)"
deadline=$((SECONDS + ${BUDGET:-160}))
step() {   # timeout, log name, command...: run it, say how long it took
  local limit=$1 name=$2 t0=$SECONDS; shift 2
  (( limit > deadline - SECONDS )) && limit=$((deadline - SECONDS))
  (( limit > 0 )) || { echo "  $name: no time left" >&2; return; }
  timeout "$limit" "$@" 2>>"$out/$name.log"; echo "  $name rc=$? $((SECONDS - t0)) s" >&2
}
SHAPES="--context 4096,32768 --q 1,2,8,17 --heads 8"
if [[ -n ${BEFORE:-} && -d $BEFORE ]]; then
  (cd "$BEFORE" && PYTHONPATH=. step 25 run python3 -m ddtree bench attention $SHAPES --json) > "$out/before.json"
fi
step 25 run python3 -m ddtree bench attention $SHAPES --json > "$out/after.json"
T=tests/plugins/test_mla_attention_gpu.py
step 20 smoke python3 -m pytest -q -x -p no:cacheprovider $T -k "cluster_merge_and_load_warp and 4096-17-8-l512_r64" \
  > "$out/smoke.log"
step 70 sweep python3 tests/plugins/sweep_attention.py \
  "T=4096,32768 q=8,17 form=tree cluster=1,4,8 loader=0,1 parts" \
  "T=4096 q=17 form=tree warps=2 stages=2 splits=7,15,23,31 cluster=8 loader=0,1" \
  "T=4096 q=17 form=tree warps=4 stages=2 splits=7,15,31 cluster=8 loader=0,1" \
  "T=32768 q=17 form=tree warps=4 stages=2 splits=31,47,63 cluster=8 loader=0,1" \
  "T=4096 q=17 form=tree warps=2 stages=2 splits=26 cluster=1 loader=0,1 l2" \
  "T=4096,32768 q=1,17 nopdl" \
  "T=131072 q=8,17 form=tree cluster=1,8 loader=0,1" >> "$out/sweep.jsonl"
grep -h "^T=" "$out/sweep.log" 2>/dev/null
TEST_TIMEOUT=$(( deadline - SECONDS - 3 )) gpu_tests $T -k "cluster_merge or every_variant or smem_size or T4096 or T100 or longer_context or root_row"
