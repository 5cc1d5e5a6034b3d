"""Held-out bits per byte of a target checkpoint, through the numpy float64 reference.

`python -m ddtree.training.evaluate [--target DIR] [--json]` (default: the embedded tiny model).
The held-out token stream (documents BOS + bytes + EOS of the held-out files) is cut into
non-overlapping chunks of `chunk` tokens; in each chunk, token i+1 is scored from tokens 0..i
(so a chunk's first tokens see little context: a conservative number). Only byte targets
(ids < 256) are counted: bits/byte = mean(-log2 p(byte)). numpy only.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from ddtree.jsonout import emit_json
from ddtree.reference.model import Target, causal_visible


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


def main(argv=None) -> dict:
    from ddtree.data import tiny_model_dirs
    from ddtree.training.corpus import load_corpus

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the embedded tiny model)")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    target_dir = args.target or tiny_model_dirs()[0]
    t0 = time.perf_counter()
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
