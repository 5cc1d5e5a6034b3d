#!/usr/bin/env bash
# One device call for the kernel performance work (issue 6 follow-up): GPU tests, then benchmark runs
# appended to $OUT/bench.jsonl (one JSON object per run, tagged), then a summary table (last in the output).
# A baseline checkout (e.g. `git archive <commit> ddtree | tar -x -C .base`) in .base is benchmarked too.
# Usage (repo root, on the device): bash tests/plugins/sweep_on_gpu.sh   (SWEEP=final,rings: also the ring sweep)
set -uo pipefail
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 DDTREE_KERNEL_CACHE=/tmp/ddtree-cubins
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import cuda.core, cuda.bindings, numpy; print('cuda.core', cuda.core.__version__, 'numpy', numpy.__version__)"
start=$SECONDS
PYTHONPATH=. timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q -rf --tb=short -p no:cacheprovider tests/plugins \
  > "$out/tests.log" 2>&1; echo "tests rc=$? in $((SECONDS - start)) s"; tail -4 "$out/tests.log"

MS=${MS:-1,2,4,8,16,64}
GEMM_NAMES=${GEMM_NAMES:-q_a,q_b,o_proj,shared_gate_up,dense_gate_up,dense_down,lm_head}
bench() {   # tag, root, moe|gemm, args...
  local tag=$1 root=$2 what=$3; shift 3
  local t0=$SECONDS
  (cd "$root" && PYTHONPATH=. timeout ${BENCH_TIMEOUT:-120} python3 -c \
    "from ddtree.bench.kernels import ${what}_command as c; c()" --json "$@" 2>>"$out/bench.err") \
    | python3 -c "import json,sys; [print(json.dumps({'tag': '$tag', **json.loads(l)})) for l in sys.stdin if l.strip()]" \
    >> "$out/bench.jsonl"
  echo "  $tag ($what $*): $((SECONDS - t0)) s"
}
bench new . moe --m $MS --no-router --parts
[[ -d .base ]] && bench base .base moe --m $MS --no-router
bench new . gemm --m 1,16 --names $GEMM_NAMES
[[ -d .base ]] && bench base .base gemm --m 1,16 --names $GEMM_NAMES
if [[ ,${SWEEP:-final}, == *,final,* ]]; then       # the spread: the same runs again
  bench new2 . moe --m $MS --no-router
  [[ -d .base ]] && bench base2 .base moe --m $MS --no-router
  bench new2 . gemm --m 1,16 --names $GEMM_NAMES
fi
if [[ ,${SWEEP:-final}, == *,rings,* ]]; then       # ring / block-shape sweep (ddtree/plugins/kernels/NOTES.md has the earlier ones)
  M1="--tp 1 --m 1,2,4,8,16 --no-router"
  bench r6x1 . moe --m $MS --no-router --gu-ring 6x1 --down-ring 6x1
  bench r3x2 . moe $M1 --gu-ring 3x2 --down-ring 3x2
  bench gu2x4 . moe $M1 --gu-ring 2x4
  bench dn2x4 . moe $M1 --down-ring 2x4
  bench gu_tpw2 . moe $M1 --gu-tpw 2
  bench nopdl . moe --m 1,4,16 --no-router --no-pdl
  bench gemm_tpw1 . gemm --m 16 --names $GEMM_NAMES --tpw 1
  bench gemm_tpw2 . gemm --m 1,16 --names $GEMM_NAMES --tpw 2
fi
echo "total $((SECONDS - start)) s"
python3 - "$out/bench.jsonl" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
for r in runs:
    for row in r["rows"]:
        if r["bench"] == "moe" and row.get("part") == "experts":
            p = row["plan"]
            print(f"{r['tag']:12s} moe tp{row['tp']} M={row['M']:<3d} {row['latency_us']:8.1f} us {row['pct_of_ceiling']:5.1f}%"
                  f"  dn s{p.get('down_splits', 1)} w{p['down_warps']}")
        elif r["bench"] == "moe":
            print(f"{r['tag']:12s} moe tp{row['tp']} M={row['M']:<3d} {row['part']} {row['latency_us']:.1f} us")
        else:
            print(f"{r['tag']:12s} gemm tp{row['tp']} {row['name']:14s} M={row['M']:<3d} {row['latency_us']:8.1f} us "
                  f"{row['pct_of_ceiling']:5.1f}%  {row['plan']}")
PY
