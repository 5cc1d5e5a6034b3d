#!/usr/bin/env bash
# Issue 25's 2-GPU run as one command (the `nvidia-h200-x2` kind): bash tests/runtime/tp2_on_gpus.sh
# 1. what the two GPUs allow (bench allreduce --probe: peer access, P2P attributes, the IPC flag round trip);
# 2. the 2-GPU GPU tests (one-shot push / pull bit-equal, NCCL identical on both ranks, a killed peer; the rank
#    processes of a tp 2 small-mla engine on GPUs 0 and 1, the killed worker);
# 3. tp 2 small-mla on two GPUs: tokens/s of DDTree and AR with each --allreduce, next to tp 1 (fast kernels);
# 4. tests/runtime/tp_ranks_on_gpus.sh with GPUS=0,1 (the batch-invariant DDTree == AR run on two rank processes,
#    bench step --ranks all, bench allreduce one-shot / pull / NCCL, alone and in a graph of 122).
# Each step runs under a time limit, so a hang (NCCL hung after init once) ends the step, not the call.
# Results under $OUT: probe.json, pytest.log, speed.log, tp/ (tp_ranks_on_gpus.sh's files), bundled by the caller.
set -uo pipefail
OUT=${OUT:-/tmp/tp2}; LIMIT=${LIMIT:-150}
export PYTHONPATH=${PYTHONPATH:-$PWD} DDTREE_KERNEL_CACHE=${DDTREE_KERNEL_CACHE:-/tmp/ddtree-cubins} NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
step() { echo "== $1 ($(date +%T))" >&2; }

step "1. probe"
timeout 60 python3 -m ddtree bench allreduce --gpu 0,1 --probe --json > "$OUT/probe.json" || echo "   probe exited $?" >&2

step "2. 2-GPU tests"
# NCCL's INFO lines a process into $WORK (unbuffered: a hung rank's last line survives the kill), appended to the log
DDTREE_TEST_GPUS=0,1 NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$WORK/nccl.%h.%p.log" timeout $((2 * LIMIT)) python3 -m pytest \
    -q -m gpu -rs tests/plugins/test_allreduce_gpu.py tests/parallel/test_cuda_collectives_gpu.py \
    tests/runtime/test_cuda_rank_processes_gpu.py -k "not one_gpu" > "$OUT/pytest.log" 2>&1
echo "   pytest exited $?: $(tail -1 "$OUT/pytest.log")" >&2
for f in "$WORK"/nccl.*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }; done >> "$OUT/pytest.log"

step "3. tp 2 on GPUs 0,1 next to tp 1, small-mla, fast kernels"
timeout 60 python3 -m ddtree synth --preset small-mla --out "$WORK/ckpt" --json > /dev/null
for TP in 1 2; do
  timeout "$LIMIT" python3 -m ddtree build --model "$WORK/ckpt/target" --drafter "$WORK/ckpt/drafter" --tp $TP \
      --arch sm_90 --out "$WORK/engine$TP" --no-graphs --jobs 8 --json > /dev/null
done
{
  for MODE in ar ddtree; do
    echo "tp 1 $MODE: $(timeout "$LIMIT" python3 -m ddtree run --model "$WORK/engine1" --device cuda --gpu 0 --mode $MODE \
        --max-new-tokens 128 --budget 16 "def fibonacci(n):" 2>&1 | grep -E 'tok/s|Error' | tail -1)"
    for AR in one-shot nccl auto; do
      echo "tp 2 $MODE --allreduce $AR: $(NCCL_DEBUG=WARN timeout "$LIMIT" python3 -m ddtree run --model "$WORK/engine2" \
          --device cuda --gpu 0,1 --allreduce $AR --mode $MODE --max-new-tokens 128 --budget 16 "def fibonacci(n):" \
          2>&1 | grep -E 'tok/s|Error|error' | tail -1)"
    done
  done
} > "$OUT/speed.log" 2>&1
cat "$OUT/speed.log" >&2

step "4. tp_ranks_on_gpus.sh on GPUs 0,1"
OUT="$OUT/tp" GPUS=0,1 TP=2 PRESET=small-mla LAYERS= CONTEXT=512 REPEATS=5 LIMIT="$LIMIT" \
    bash tests/runtime/tp_ranks_on_gpus.sh || echo "   tp_ranks_on_gpus.sh exited $?" >&2
step "done: $OUT"
