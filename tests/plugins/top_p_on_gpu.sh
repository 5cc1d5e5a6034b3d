#!/usr/bin/env bash
# One device call for issue 23 (top-p alone): the top-p GPU tests and the other sampler GPU tests, then
# `ddtree bench tree` after and before (BEFORE: a tree of the kernels before, e.g. `git archive <commit>
# ddtree` unpacked there, with profile_top_p.py copied in), the per-kernel split of both
# (tests/plugins/profile_top_p.py; after: with the per-phase clock64 cycles of a DD_PROFILE build, and an
# SP_ABLATE timing variant). Every step is time-boxed (DEADLINE seconds in all) so that what finished comes
# back. Output under $OUT (or ./out).
#   BEFORE=.cache/topp_before DEADLINE=160 bash tests/plugins/top_p_on_gpu.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
end=$((SECONDS + ${DEADLINE:-140}))
left() { local s=$((end - SECONDS)); echo $((s < ${1} ? (s > 1 ? s : 1) : ${1})); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=${DDTREE_KERNEL_CACHE:-/tmp/ddtree-cubins}
mkdir -p "$DDTREE_KERNEL_CACHE"; cp -n .cache/topp_cubins/*.cubin "$DDTREE_KERNEL_CACHE"/ 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >"$out/profile.txt" 2>&1
bench() {  # tag, dir, args...
    local tag=$1 dir=$2; shift 2
    echo "== $tag" >>"$out/bench.txt"
    (cd "$dir" && PYTHONPATH=$PWD timeout "$(left 30)" python3 -m ddtree bench tree "$@" --json) >>"$out/bench.txt" 2>&1
}
prof() {  # tag, dir, script, args...
    local tag=$1 dir=$2 script=$3; shift 3
    echo "== $tag" >>"$out/profile.txt"
    (cd "$dir" && PYTHONPATH=$PWD timeout "$(left 25)" python3 "$script" "$@") >>"$out/profile.txt" 2>&1
}
timeout "$(left 45)" python3 -m pytest -q -p no:cacheprovider tests/plugins/test_top_p_gpu.py >"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
timeout "$(left 40)" python3 -m pytest -q -p no:cacheprovider tests/plugins/test_tree_gpu.py \
    -k "sampler or walk or captured or nan" tests/plugins/test_sampler_graph_gpu.py >>"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
args="--vocab 163840,20480 --budget 16,64 --mode greedy,top_p0.95"
bench after "$PWD" $args
bench after-flat "$PWD" --vocab 163840,20480 --budget 64 --mode top_p0.95 --flat
if [ -n "${BEFORE:-}" ]; then
    bench before "$BEFORE" $args
    bench before-flat "$BEFORE" --vocab 163840,20480 --budget 64 --mode top_p0.95 --flat
fi
P=tests/plugins/profile_top_p.py
for what in peaked flat; do
    prof "after $what" "$PWD" $P 163840,20480 64 $what stamps
    [ -n "${BEFORE:-}" ] && prof "before $what" "$BEFORE" profile_top_p.py 163840,20480 64 $what
done
prof "after SP_ABLATE=1 (no Gumbel in the slice loop)" "$PWD" $P 163840,20480 64 peaked SP_ABLATE=1
grep -h "^==\|us" "$out/bench.txt" | tail -40
cat "$out/profile.txt"
