#!/usr/bin/env bash
# One device call for issue 23 (top-p's float32 path): the top-p GPU tests, `ddtree bench tree` after and
# before (BEFORE: a tree of the kernels before, e.g. `git archive <commit> ddtree` unpacked there), the
# per-kernel split of both (tests/plugins/profile_top_p.py), then the other sampler GPU tests. Every step
# is time-boxed (DEADLINE seconds in all) so that what finished comes back. Output under $OUT (or ./out).
#   BEFORE=.cache/topp_before DEADLINE=140 bash tests/plugins/top_p_on_gpu.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
end=$((SECONDS + ${DEADLINE:-140}))
left() { local s=$((end - SECONDS)); echo $((s < ${1} ? (s > 1 ? s : 1) : ${1})); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=${DDTREE_KERNEL_CACHE:-/tmp/ddtree-cubins}
mkdir -p "$DDTREE_KERNEL_CACHE"; cp -n .cache/topp_cubins/*.cubin "$DDTREE_KERNEL_CACHE"/ 2>/dev/null
bench() {  # tag, dir, args...
    local tag=$1 dir=$2; shift 2
    echo "== $tag" >>"$out/bench.txt"
    (cd "$dir" && PYTHONPATH=$PWD timeout "$(left 30)" python3 -m ddtree bench tree "$@" --json) >>"$out/bench.txt" 2>&1
}
timeout "$(left 45)" python3 -m pytest -q -p no:cacheprovider tests/plugins/test_top_p_gpu.py >"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
args="--vocab 163840,20480 --budget 16,64 --mode greedy,top_p0.95"
bench after "$PWD" $args
bench after-flat "$PWD" --vocab 163840,20480 --budget 64 --mode top_p0.95 --flat
if [ -n "${BEFORE:-}" ]; then
    bench before "$BEFORE" $args
    bench before-flat "$BEFORE" --vocab 163840,20480 --budget 64 --mode top_p0.95 --flat
fi
for what in peaked flat; do
    timeout "$(left 20)" python3 tests/plugins/profile_top_p.py 163840,20480 64 $what >>"$out/profile.txt" 2>&1
    [ -n "${BEFORE:-}" ] && (cd "$BEFORE" && PYTHONPATH=$PWD timeout "$(left 20)" python3 profile_top_p.py \
        163840,20480 64 $what) >>"$out/profile.txt" 2>&1
done
grep -h "^V\|us" "$out/bench.txt" | tail -24
cat "$out/profile.txt"
timeout "$(left 120)" python3 -m pytest -q -p no:cacheprovider tests/plugins/test_tree_gpu.py \
    -k "sampler or walk or captured or nan" tests/plugins/test_sampler_graph_gpu.py >>"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
