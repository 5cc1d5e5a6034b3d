"""Held-out bits per byte of a target checkpoint, through the numpy float64 reference.

`python -m ddtree.training.evaluate [--target DIR] [--json]` (default: the embedded tiny model).
The held-out token stream (documents BOS + bytes + EOS of the held-out files) is cut into
non-overlapping chunks of `chunk` tokens; in each chunk, token i+1 is scored from tokens 0..i
(so a chunk's first tokens see little context: a conservative number). Only byte targets
(ids < 256) are counted: bits/byte = mean(-log2 p(byte)). numpy only.

`--context-curve` measures bits/byte against position instead: `--windows` windows of `--window`
tokens spread evenly over the held-out stream, each scored from position 0, the scored tokens
grouped by their position in buckets of `--bucket`. The context at which the model still works is
the end of the last bucket, counting from the start, whose bits/byte stays within `--tolerance`
(10 %) of the mean over the first 512 positions: the embedded model's max_position_embeddings.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from ddtree.data import tiny_model_dirs
from ddtree.jsonout import emit_json
from ddtree.reference.model import Target, causal_visible
from ddtree.training.corpus import load_corpus


def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))


def heldout_bits_per_byte(target: Target, stream: np.ndarray, chunk: int = 512) -> dict:
    """stream [n] token ids -> {"bits_per_byte", "bytes_scored", "chunks"}."""
    total_nats, scored, chunks = 0.0, 0, 0
    for s in range(0, len(stream) - 1, chunk):
        ids = stream[s: s + chunk]
        if len(ids) < 2:
            break
        logits, _ = target.forward(ids, np.arange(len(ids)), causal_visible(0, len(ids)), target.new_cache(len(ids)))
        logp = log_softmax(logits[:-1])                                  # [c-1, V] predicts ids[1:]
        nxt = ids[1:]
        is_byte = nxt < 256
        total_nats -= float(logp[np.arange(len(nxt)), nxt][is_byte].sum())
        scored += int(is_byte.sum())
        chunks += 1
    return {"bits_per_byte": total_nats / scored / math.log(2), "bytes_scored": scored, "chunks": chunks}


def context_curve(target: Target, stream: np.ndarray, window: int = 2048, windows: int = 16,
                  bucket: int = 128, reference: int = 512, tolerance: float = 0.10) -> dict:
    """Bits/byte by position: `windows` windows of `window` tokens spread evenly over `stream`, token
    i+1 of each scored from tokens 0..i, grouped by the position i+1 in buckets of `bucket`.
    `context` = the end of the last bucket (from the start, without a gap) whose bits/byte is at most
    (1 + tolerance) x the bits/byte over positions below `reference`."""
    if len(stream) < window or window < 2 or windows < 1 or bucket < 1 or reference < 2:
        raise ValueError(f"context_curve: need window {window} <= the stream's {len(stream)} tokens, "
                         f"windows >= 1, bucket >= 1, reference >= 2")
    starts = np.linspace(0, len(stream) - window, windows).astype(np.int64)
    n_buckets = -(-window // bucket)
    nats, counts = np.zeros(n_buckets), np.zeros(n_buckets, np.int64)
    ref_nats, ref_count = 0.0, 0
    for s in starts:
        ids = stream[s: s + window]
        logits, _ = target.forward(ids, np.arange(window), causal_visible(0, window), target.new_cache(window))
        logp = log_softmax(logits[:-1])                                  # row i predicts ids[i + 1]
        nxt = ids[1:]
        pos = np.arange(1, window)                                       # where each scored token sits
        is_byte = nxt < 256
        loss = -logp[np.arange(window - 1), nxt]
        np.add.at(nats, pos[is_byte] // bucket, loss[is_byte])
        np.add.at(counts, pos[is_byte] // bucket, 1)
        early = is_byte & (pos < reference)
        ref_nats += float(loss[early].sum())
        ref_count += int(early.sum())
    bpb = nats / np.maximum(counts, 1) / math.log(2)
    ref_bpb = ref_nats / ref_count / math.log(2)
    context = 0
    for k in range(n_buckets):
        if counts[k] == 0 or bpb[k] > (1 + tolerance) * ref_bpb:
            break
        context = min((k + 1) * bucket, window)
    return {"window": window, "windows": int(len(starts)), "window_starts": [int(s) for s in starts],
            "bucket": bucket, "reference_positions": reference, "tolerance": tolerance,
            "reference_bits_per_byte": round(ref_bpb, 4),
            "buckets": [{"positions": [k * bucket, min((k + 1) * bucket, window)], "bytes_scored": int(counts[k]),
                         "bits_per_byte": round(float(bpb[k]), 4)} for k in range(n_buckets)],
            "context": context}


def main(argv=None) -> dict:

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the embedded tiny model)")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--context-curve", action="store_true",
                   help="bits/byte against position (the model's usable context) instead of the one number")
    p.add_argument("--window", type=int, default=2048, help="--context-curve: tokens per window")
    p.add_argument("--windows", type=int, default=16, help="--context-curve: windows over the held-out stream")
    p.add_argument("--bucket", type=int, default=128, help="--context-curve: positions per bucket")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="--context-curve: allowed rise over the bits/byte of the first 512 positions")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    target_dir = args.target or tiny_model_dirs()[0]
    t0 = time.perf_counter()
    if args.context_curve:
        result = context_curve(Target.from_checkpoint(target_dir), load_corpus().heldout, args.window, args.windows,
                               args.bucket, tolerance=args.tolerance)
        result.update({"target": str(target_dir), "wall_s": round(time.perf_counter() - t0, 1)})
        if args.json:
            emit_json(result)
        else:
            print(f"{target_dir}: held-out bits/byte by position ({result['windows']} windows of {args.window}, "
                  f"numpy float64 reference, {result['wall_s']} s)")
            for b in result["buckets"]:
                print(f"  {b['positions'][0]:5d}-{b['positions'][1] - 1:5d}  {b['bits_per_byte']:.3f}")
            print(f"first 512 positions: {result['reference_bits_per_byte']:.3f}; within "
                  f"{100 * args.tolerance:.0f} % of it up to position {result['context']} (the usable context)")
        return result
    result = heldout_bits_per_byte(Target.from_checkpoint(target_dir), load_corpus().heldout, args.chunk)
    result.update({"target": str(target_dir), "wall_s": round(time.perf_counter() - t0, 1)})
    if args.json:
        emit_json(result)
    else:
        print(f"{target_dir}: held-out {result['bits_per_byte']:.4f} bits/byte over {result['bytes_scored']} bytes "
              f"({result['chunks']} chunks of {args.chunk}, numpy float64 reference, {result['wall_s']} s)")
    return result


if __name__ == "__main__":
    main()
