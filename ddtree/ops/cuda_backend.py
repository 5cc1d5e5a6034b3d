"""The cuda backend's op table: which launcher of ddtree/plugins backs each op, and typed stubs.

The GPU executor (the CUDA backend issues) implements every op of ops/opset.py with these launchers
on DeviceArray buffers (plugins/device.py) and captures a whole step into a CUDA graph; the op
signatures are the op set's, so the layer functions run unchanged. Until then each op raises
NotImplementedError naming the launcher it will call (or the kernel still to be written); the loop
never falls back to another backend silently.
"""
from __future__ import annotations

import functools

from ddtree.ops.opset import OP_NAMES, Ops

# op -> the launcher that implements it ("missing: ..." where the kernel is still to be written)
LAUNCHERS = {
    "input": "a DeviceArray bound per call (captured graphs read fixed addresses)",
    "weight": "a DeviceArray of the rank's tensor in the kernels' layout (plugins/layout.py)",
    "output": "a DeviceArray the caller reads",
    "shape": "DeviceArray.shape",
    "reshape": "a view of a DeviceArray", "slice": "a strided view of a DeviceArray",
    "cast": "plugins/layer_ops.py LayerOps.cast_f32_bf16 (fp32 -> bf16; other pairs missing)",
    "add": "missing: fused into the previous GEMM's epilogue (plugins/gemm.py residual)",
    "rms_norm": "plugins/layer_ops.py LayerOps.rms_norm (rows, strided) / head_rms_norm (the drafter's q/k norms)",
    "all_reduce_add_rms_norm": "plugins/layer_ops.py LayerOps.add_rms_norm (tp 1; after the all-reduce at tp > 1, "
                               "the all-reduce fused with it: missing)",
    "linear": "plugins/gemm.py SkinnyGemm.run",
    "swiglu_mlp": "plugins/gemm.py SkinnyGemm.run ([gate; up] stacked, down) + plugins/layer_ops.py LayerOps.silu_mul",
    "embed": "plugins/layer_ops.py LayerOps.embed",
    "rope": "plugins/layer_ops.py LayerOps.rope_interleaved (RopeTable.interleaved: cos/sin built in float64)",
    "kv_append": "plugins/kv_cache.py DeviceLatentCache.append",
    "kv_compact": "plugins/kv_cache.py DeviceLatentCache.compact (every layer in one launch; its count is a "
                  "host int today, a device scalar for capture)",
    "mla_absorb_q": "plugins/mla_absorb.py MlaAbsorb.q (W_UK^T prepared at load: uk_transposed)",
    "mla_tree_attention": "plugins/mla_attention.py MlaTreeAttention.run",
    "mla_absorb_out": "plugins/mla_absorb.py MlaAbsorb.out (kv_b as stored)",
    "moe": "plugins/moe.py FusedMoE.run (router GEMM, routing, gate/up, down + shared)",
    "draft_attention": "plugins/draft_attention.py DraftAttention.run after the rope + append of the new context "
                       "(missing: that rope/append launch)",
    "all_reduce": "identity at tp 1; one-shot peer-to-peer or NCCL (the rank-process issues)",
    "all_gather": "identity at tp 1; one-shot peer-to-peer or NCCL (the rank-process issues)",
    "vocab_winner": "plugins/tree_sample.py TreeSampler.run (per-rank winners: missing)",
    "vocab_topk": "plugins/tree_build.py DraftTreeBuilder (draft_lse_parts, draft_topk)",
    "tree_build": "plugins/tree_build.py DraftTreeBuilder.build (draft_merge)",
    "accept_walk": "plugins/tree_sample.py TreeSampler.run(tree=...) (the walk)",
}


def _stub(name: str):
    @functools.wraps(getattr(Ops, name))
    def op(self, *args, **kwargs):
        raise NotImplementedError(f"cuda backend: op '{name}' is not implemented yet ({LAUNCHERS[name]})")
    op.__isabstractmethod__ = False
    return op


class CudaOps(Ops):
    """One rank's ops on one GPU. Every op is a stub until the CUDA backend lands."""

    def __init__(self, gpu, lay):
        self.gpu, self.lay = gpu, lay


for _name in OP_NAMES:
    setattr(CudaOps, _name, _stub(_name))
CudaOps.__abstractmethods__ = frozenset()
if set(LAUNCHERS) != set(OP_NAMES):
    raise ImportError(f"ops/cuda_backend.py: LAUNCHERS {sorted(set(LAUNCHERS) ^ set(OP_NAMES))} differ from the op set")
