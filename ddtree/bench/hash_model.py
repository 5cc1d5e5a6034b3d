"""A whole model whose weights are hash streams (plugins/randfill.py): filled on the GPU, or read lazily on the CPU,
bit-identical either way. The GPU tests at real dimensions (kimi-k2.6 --layers 2: ~14 GB of weights) compare the
GPU forward with the numpy reference on such a model, with no checkpoint on disk and no host upload of it.

    model = HashModel(cfg, dcfg, seed=0)     # the tp 1 rank tensors of make_plan(cfg, dcfg, 1)
    w = model.tensors["lm_head.weight"]      # HashTensor [V, H] bf16 bits: w[a:b] made on the CPU (those rows only)
    host = model.on_device(gpu)              # {name: np.ndarray}: every tensor filled on the GPU, downloaded

Tensor i of rank_tensor_specs (in that order) is stream seed * 1_000_003 + i, word 0 first, in the layout the
engine stores: dense weights [out, in] bf16, routed experts stacked in the MoE kernel layout (their words are
uniform nibbles: any word is a valid INT4 expert). Value ranges (randfill presets): bf16 weights |w| in
[2^-11, 2^-7), the embedding |x| in [2^-3, 2), expert scales [2^-8, 2^-7), norms 1; activations stay finite.
The router bias is not random: +2 on `k` experts spread over the range (the routing margin is then >= 1 on every
token, so the GPU and the float64 reference pick the same experts: no routing near-ties, every row is held to
the test's bound), 0 elsewhere.
"""
from __future__ import annotations

import numpy as np

from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.plugins import randfill as rf
from ddtree.plugins.device import DeviceArray

ONES_BF16 = (0, 0x3F803F80)
ZEROS = (0, 0)
_DTYPES = {"BF16": np.dtype(np.uint16), "F32": np.dtype(np.float32), "I32": np.dtype(np.int32)}


def preset_of(name: str) -> tuple[int, int]:
    """The randfill (mask, bits_or) of a rank tensor, by name (the router bias: zeros; HashModel sets its own)."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return ONES_BF16
    if name.endswith("e_score_correction_bias"):
        return ZEROS
    if name.endswith(".words"):
        return rf.INT4_WORDS
    if name.endswith(".scales"):
        return rf.SCALES_BF16
    if name.endswith("embed_tokens.weight"):
        return rf.ACT_BF16
    return rf.WEIGHT_BF16


def decisive_experts(n_experts: int, k: int) -> np.ndarray:
    """k experts spread over 0..n_experts-1 (the stacked tensors' first, middle and last rows are all used)."""
    return np.array(sorted({(i * n_experts) // k + (n_experts // k) // 2 for i in range(k)}), np.int64)


class HashTensor:
    """One tensor as a hash stream: shape and dtype; rows of dim 0 generated on demand (word offset = row offset)."""

    def __init__(self, name: str, shape, dtype, seed: int, preset):
        self.name, self.shape, self.dtype = name, tuple(int(s) for s in shape), np.dtype(dtype)
        self.seed, self.preset = seed, preset
        self.ndim = len(self.shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if self.nbytes % 4:
            raise ValueError(f"{name}: {self.nbytes} B is not a whole number of 32-bit words")
        row_bytes = self.nbytes // max(self.shape[0], 1)
        self.row_words = row_bytes // 4 if row_bytes % 4 == 0 else None      # None: rows are not word-aligned

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows a .. b-1 -> [b - a, *shape[1:]] of dtype (only their words are made, when rows are word-aligned)."""
        if self.row_words is None:
            words = rf.hash_u32(self.nbytes // 4, self.seed, *self.preset)
            return words.view(self.dtype).reshape(self.shape)[a:b]
        words = rf.hash_u32((b - a) * self.row_words, self.seed, *self.preset, start=a * self.row_words)
        return words.view(self.dtype).reshape(b - a, *self.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            i = int(index) % self.shape[0]
            return self.rows(i, i + 1)[0]
        if isinstance(index, slice) and index.step in (None, 1):
            a, b, _ = index.indices(self.shape[0])
            return self.rows(a, max(a, b))
        return np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        a = self.rows(0, self.shape[0])
        return a if dtype is None else a.astype(dtype)


class HashModel:
    """The tp 1 rank tensors of (cfg, dcfg) as HashTensors (the router biases as arrays)."""

    def __init__(self, cfg, dcfg, seed: int = 0):
        self.cfg, self.dcfg, self.seed = cfg, dcfg, seed
        self.plan = make_plan(cfg, dcfg, 1)
        self.specs = rank_tensor_specs(self.plan)
        self.tensors: dict = {}
        for i, (name, spec) in enumerate(self.specs.items()):
            if name.endswith("e_score_correction_bias"):
                bias = np.zeros(spec.shape, np.float32)
                bias[decisive_experts(spec.shape[0], cfg.num_experts_per_tok)] = 2.0
                self.tensors[name] = bias
            else:
                self.tensors[name] = HashTensor(name, spec.shape, _DTYPES[spec.dtype], seed * 1_000_003 + i,
                                                preset_of(name))

    def on_device(self, gpu) -> dict[str, np.ndarray]:
        """Every tensor filled on the GPU (one scratch buffer, reused) and downloaded: the host arrays the
        executors load, equal bit for bit to the CPU's rows."""
        hashed = {k: t for k, t in self.tensors.items() if isinstance(t, HashTensor)}
        scratch = gpu.alloc(max(t.nbytes for t in hashed.values()) // 4, np.uint32)
        out = {}
        for name, t in self.tensors.items():
            if not isinstance(t, HashTensor):
                out[name] = t
                continue
            view = DeviceArray(gpu, scratch.ptr, t.shape, t.dtype)
            rf.fill_device(gpu, view, t.seed, t.preset)
            out[name] = gpu.download(view)
        return out
