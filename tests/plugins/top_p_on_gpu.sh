#!/usr/bin/env bash
# One device call for issue 23 (top-p alone): the top-p GPU tests and the other sampler / tree GPU tests, then
# `ddtree bench tree` after and before (BEFORE: a tree of the kernels before, e.g. `git archive <commit>
# ddtree` unpacked there, with profile_top_p.py copied in), the per-kernel split of both
# (tests/plugins/profile_top_p.py, walk alone and the build + walk step; after: with the per-phase clock64
# cycles of a DD_PROFILE build), and NCU=1: ncu warp-state / source counters of draft_topk, sample_mass,
# sample_kept (one launch each). Every step is time-boxed (DEADLINE seconds in all) so that what finished
# comes back. Output under $OUT (or ./out): tests.txt, bench.txt, profile.txt, ncu.txt.
#   BEFORE=.cache/topp_before DEADLINE=220 NCU=1 bash tests/plugins/top_p_on_gpu.sh
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
    (cd "$dir" && PYTHONPATH=$PWD timeout "$(left 30)" python3 "$script" "$@") >>"$out/profile.txt" 2>&1
}
T=tests/plugins
timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider $T/test_top_p_gpu.py $T/test_top_p_ranks_gpu.py \
    >"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider $T/test_tree_gpu.py $T/test_sampler_graph_gpu.py \
    >>"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
args="--vocab 163840,20480 --budget 16,64 --mode greedy,top_p0.95"
bench after "$PWD" $args
bench after-flat "$PWD" --vocab 163840 --budget 64 --mode top_p0.95 --flat
if [ -n "${BEFORE:-}" ]; then
    bench before "$BEFORE" $args
    bench before-flat "$BEFORE" --vocab 163840 --budget 64 --mode top_p0.95 --flat
fi
P=$T/profile_top_p.py
prof "after peaked" "$PWD" $P 163840,20480 64 peaked stamps step
[ -n "${BEFORE:-}" ] && prof "before peaked" "$BEFORE" profile_top_p.py 163840,20480 64 peaked stamps step
prof "after flat" "$PWD" $P 163840 64 flat
[ -n "${BEFORE:-}" ] && prof "before flat" "$BEFORE" profile_top_p.py 163840 64 flat
if [ -n "${NCU:-}" ]; then
    timeout "$(left 60)" /usr/local/cuda/bin/ncu -k regex:"draft_topk|sample_mass|sample_kept" -c 3 \
        --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
        --section SourceCounters python3 $T/profile_tree.py 163840 64 top_p0.95 2>&1 | head -c 60000 >"$out/ncu.txt"
fi
grep -h "^==\|us" "$out/bench.txt" | tail -40
cat "$out/profile.txt"
