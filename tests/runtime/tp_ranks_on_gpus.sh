#!/usr/bin/env bash
# Issue 29's run as one command: the tp N step on N GPUs (needs the 8-GPU kind for the real thing). Rehearse it on
# fewer GPUs first (ranks may share a GPU; the step numbers are then time-sliced, the checks are not):
#   GPUS=0,0 TP=2 PRESET=small-mla LAYERS= bash tests/runtime/tp_ranks_on_gpus.sh          # one H200
#   GPUS=0,1,2,3,4,5,6,7 TP=8 PRESET=kimi-k2.6 LAYERS=3 bash tests/runtime/tp_ranks_on_gpus.sh  # the 8-GPU call
# Writes its results under $OUT (default /tmp/tp-ranks; eight files at most, what the device returns):
# build.json; run_both.json + run_both.err (DDTree and AR on N rank processes with the batch-invariant kernels:
# identical expected); step_ranks.json (`bench step --ranks all`: every rank with the real collectives next to its
# single-rank figure, the skew); step_rank0.json (rank 0 alone, stand-in collectives, with the split);
# allreduce.json (one-shot push / pull) and allreduce_nccl.json + .err (NCCL), only with distinct GPUs. A step that
# fails stops the script (set -e), except the DDTree-vs-AR run and NCCL's bench, whose exit codes are said.
set -euo pipefail
GPUS=${GPUS:-0,1,2,3,4,5,6,7}; TP=${TP:-8}; PRESET=${PRESET:-kimi-k2.6}; LAYERS=${LAYERS-3}
OUT=${OUT:-/tmp/tp-ranks}; CONTEXT=${CONTEXT:-4096}; BUDGETS=${BUDGETS:-16}; REPEATS=${REPEATS:-10}
LIMIT=${LIMIT:-900}          # seconds each step may take (a hang, e.g. in NCCL, ends that step, not the call)
export PYTHONPATH=${PYTHONPATH:-$PWD} DDTREE_KERNEL_CACHE=${DDTREE_KERNEL_CACHE:-/tmp/ddtree-cubins} NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LAYER_FLAG=(); [ -n "$LAYERS" ] && LAYER_FLAG=(--layers "$LAYERS")
step() { echo "== $1 ($(date +%T))" >&2; }

step "1. a tp $TP engine of $PRESET ${LAYERS:+($LAYERS layers)}, built here"
timeout "$LIMIT" python3 -m ddtree synth --preset "$PRESET" "${LAYER_FLAG[@]}" --out "$WORK/ckpt" --json > "$WORK/synth.json"
timeout "$LIMIT" python3 -m ddtree build --model "$WORK/ckpt/target" --drafter "$WORK/ckpt/drafter" --tp "$TP" --arch sm_90 \
    --out "$WORK/engine" --no-graphs --jobs 8 --json > "$OUT/build.json"
step "   DDTree and AR on $TP rank processes (--gpu $GPUS), batch-invariant kernels: identical tokens expected"
# Random weights leave near-ties everywhere, and rank processes cannot classify a departure (run --mode both says
# so); the batch-invariant plan makes DDTree commit AR's tokens bitwise. Every worker checks each step's control
# record, which carries a digest of the committed tokens: a rank that committed other tokens stops the run.
timeout "$LIMIT" python3 -m ddtree run --model "$WORK/engine" --device cuda --gpu "$GPUS" --kernel-plan batch-invariant --mode both \
    --max-new-tokens 48 --budget 16 --json "def fibonacci(n):" > "$OUT/run_both.json" 2> "$OUT/run_both.err" \
  || echo "   run --mode both exited $? (run_both.err says why)" >&2

step "2. bench step --ranks all (the real collectives) and rank 0 alone"
timeout "$LIMIT" python3 -m ddtree bench step --preset "$PRESET" "${LAYER_FLAG[@]}" --tp "$TP" --ranks all --gpu "$GPUS" \
    --context "$CONTEXT" --budget "$BUDGETS" --routing uniform,tree --reuse 0.5 --ar --repeats "$REPEATS" \
    --json > "$OUT/step_ranks.json"
timeout "$LIMIT" python3 -m ddtree bench step --preset "$PRESET" "${LAYER_FLAG[@]}" --tp "$TP" --rank 0 --context "$CONTEXT" \
    --budget "$BUDGETS" --routing uniform,tree --reuse 0.5 --ar --repeats "$REPEATS" --json > "$OUT/step_rank0.json"

if [ "$(tr ',' '\n' <<< "$GPUS" | sort -u | wc -l)" -eq "$TP" ]; then
  step "3. bench allreduce on $TP ranks"
  # NCCL has hung after init on the 2-GPU kind before: its rows run last and apart, with NCCL's warnings kept
  timeout "$LIMIT" python3 -m ddtree bench allreduce --gpu "$GPUS" --impl one-shot,one-shot-pull --json \
      > "$OUT/allreduce.json"
  # --timeout-s before the step's limit: a hung rank prints its Python stacks into the .err (where NCCL waits).
  # NCCL's INFO lines go to a file a process (NCCL_DEBUG_FILE: unbuffered, so a killed rank's last line is kept;
  # on stdout C stdio held them back), appended to the .err after the run
  nccl_logs=$(mktemp -d)
  NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$nccl_logs/nccl.%h.%p.log" timeout "$LIMIT" python3 -m ddtree bench allreduce \
      --gpu "$GPUS" --impl nccl --timeout-s $((LIMIT - 20)) --json \
      > "$OUT/allreduce_nccl.json" 2> "$OUT/allreduce_nccl.err" || echo "   NCCL bench exited $?" >&2
  for f in "$nccl_logs"/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 60 "$f"; }; done >> "$OUT/allreduce_nccl.err"
  rm -rf "$nccl_logs"
else
  step "3. bench allreduce skipped: ranks share a GPU ($GPUS)"
fi
step "done: $OUT"
