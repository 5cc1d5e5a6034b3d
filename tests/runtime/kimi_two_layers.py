"""The float64 reference of `kimi-k2.6 --layers 2` on its hash model (ddtree/bench/hash_model.py, seed SEED), made on
the CPU and kept as a fixture (tests/fixtures/runtime/kimi_two_layers.npz) for the GPU tests of
tests/runtime/test_kimi_two_layers_gpu.py, which fill the same weights on the device.

    python -m tests.runtime.kimi_two_layers          # rebuild the fixture (~3 min, ~17 GB of memory at its peak)

Real dimensions (hidden 7168, 64 heads, latent 512 + 64, vocab 163840, 384 INT4 experts; layer 0 dense, layer 1
MoE): a PROMPT prefill (causal) and a tree verify after it (TREE: its parents and ids, each node at position
len(PROMPT) + depth, seeing the prompt and its ancestors). The reference is EngineExecutor over the hash
model's tp 1 tensors (the numpy backend in float64; experts made lazily: only the routed ones). Kept: the logits
of both calls (float16: its rounding, 2^-11 relative, is 1/80 of the tests' bound), the taps, every layer's
cache rows, and each row's smallest routing margin (the k-th minus the (k+1)-th expert's biased score).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

SEED = 0
PROMPT = [163584, 17, 99, 3, 140, 77, 120000, 12]           # ids from both ends of the vocab
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 4, 6]                   # depths 0 1 1 2 2 2 3 4
TREE_IDS = [5000, 61, 62, 163000, 700, 701, 9, 10]
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "runtime" / "kimi_two_layers.npz"


def config():
    from ddtree.model.presets import get_preset
    return get_preset("kimi-k2.6", 2)


def tree_visible(parents, T: int) -> np.ndarray:
    """visible [n, T + n]: the prefix, then each node's ancestors and itself (ddtree/tree/build.py Tree.visible)."""
    from ddtree.tree.build import Tree
    return np.concatenate([np.ones((len(parents), T), bool), Tree.from_parents(parents).visible()], axis=1)


def calls():
    """The two target_forward calls: (ids, pos, visible) of the prefill, then of the verify."""
    from ddtree.reference.model import causal_visible
    from ddtree.tree.build import Tree
    T = len(PROMPT)
    return [(np.array(PROMPT), np.arange(T), causal_visible(0, T)),
            (np.array(TREE_IDS), Tree.from_parents(TREE_PARENTS).positions(T), tree_visible(TREE_PARENTS, T))]


def build(path: Path = FIXTURE) -> Path:
    from ddtree.backends.numpy_backend import NumpyOps
    from ddtree.bench.hash_model import HashModel
    from ddtree.description.opset import ACC
    from ddtree.model.routing import sigmoid
    from ddtree.runtime.engine_executor import EngineExecutor
    cfg, dcfg = config()
    model = HashModel(cfg, dcfg, SEED)
    ex = EngineExecutor.of_weights(cfg, dcfg, model.plan.to_dict(), [model.tensors])
    margins, k, moe = [], cfg.num_experts_per_tok, NumpyOps.moe

    def recording(self, x, router, bias, experts, shared, spec):
        score = sigmoid(np.asarray(self.linear(x, router, out=ACC), np.float64)) + np.asarray(bias, np.float64)
        top = -np.sort(-score, axis=1)                                     # [q, E]
        margins.append(top[:, k - 1] - top[:, k])
        return moe(self, x, router, bias, experts, shared, spec)
    NumpyOps.moe = recording
    try:
        cache, taps = ex.new_target_cache(capacity=32), tuple(dcfg.target_layer_ids)
        out = [ex.target_forward(*call, cache, taps) for call in calls()]
    finally:
        NumpyOps.moe = moe
    rows = len(PROMPT) + len(TREE_IDS)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, seed=SEED, logits=np.concatenate([lg for lg, _ in out]).astype(np.float16),
             taps=np.stack([np.concatenate([tp[L] for _, tp in out]) for L in taps]).astype(np.float32),
             tap_layers=np.array(taps), cache=np.stack([cache.layers[0][L][:rows] for L in range(cfg.num_hidden_layers)]),
             route_margin=np.concatenate(margins))
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE))
