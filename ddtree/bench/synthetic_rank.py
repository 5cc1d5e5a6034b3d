"""One rank of a model at real size on one GPU, weights generated on the device (ddtree bench step).

    rank = SyntheticRank(gpu, cfg, dcfg, plan, rank=0, max_context=32768 + 128, seed=0)
    steps = BenchSteps(rank)           # the real DDTree step graph of that rank (bench/bench_ops.py)

Every tensor of the rank (builder/weights.py rank_tensor_specs: the shapes the engine would hold) is allocated
in the kernels' layout and filled on the device by plugins/randfill.py (seeded, no host transfer): GEMM weights
tiled, [gate; up] stacked, W_UK^T, INT4 experts as random words with scales in [2^-8, 2^-7), bf16 weights with
|w| in [2^-11, 2^-7), norms 1, the router's bias 0. Random weights are a layout's permutation of random
weights, so a tiled buffer filled at random is as real as a tiled real one for timing; the values keep every
activation finite (checked by the benchmark on the logits). The collectives are stand-ins that move their bytes
once on this GPU (bench/bench_ops.py StandinCollective): rank r's own work, not the others'.
The KV caches are filled with random rows up to the context.
"""
from __future__ import annotations

import numpy as np

from ddtree.bench.bench_ops import BenchOps
from ddtree.bench.hash_model import preset_of
from ddtree.builder.weights import rank_tensor_specs
from ddtree.description.opset import RankLayout
from ddtree.plugins import randfill as rf
from ddtree.plugins.randfill import fill_device
from ddtree.runtime.cuda_model import device_caches
from ddtree.runtime.cuda_weights import GATE_UP, GEMM_SUFFIXES, CudaWeights, side_by_side


def _tiled_rows(n: int) -> int:
    return -(-n // 16) * 16


class SyntheticWeights(CudaWeights):
    """CudaWeights' interface (tensor, device, tiled, gate_up, uk_t, ones, rope_table) over buffers filled on
    the device instead of uploaded."""

    def __init__(self, gpu, specs: dict, cfg, max_pos: int, seed: int = 0):
        self.gpu, self.cfg, self.max_pos = gpu, cfg, max_pos
        self.latent = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.shapes = {k: tuple(v.shape) for k, v in specs.items()}
        self.raw, self._tiled, self._uk, self._ones, self._tables = {}, {}, {}, {}, {}
        dtypes = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32}

        def filled(shape, dtype, name, i):
            a = gpu.alloc(shape, dtype)
            fill_device(gpu, a, seed * 1_000_003 + i, preset_of(name))
            return a
        Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        self._groups = {}
        index = {name: i for i, name in enumerate(specs)}
        for group in side_by_side(self.shapes):
            tiles = [(_tiled_rows(self.shapes[n][0]) // 16, self.shapes[n][1] // 64, 4, 32, 8) for n in group]
            rows = sum(t[0] for t in tiles) * 16
            self._group(group, filled((rows * self.shapes[group[0]][1],), np.uint16, group[0], index[group[0]]),
                        tiles)
        for i, (name, spec) in enumerate(specs.items()):
            shape = tuple(spec.shape)
            if name in self._tiled:
                continue
            if name.endswith(GEMM_SUFFIXES):
                self._tiled[name] = filled((_tiled_rows(shape[0]) * shape[1],), np.uint16, name, i)
            elif name.endswith(GATE_UP[0]):
                self._tiled[name] = filled((_tiled_rows(2 * shape[0]) * shape[1],), np.uint16, name, i)
            elif not name.endswith(GATE_UP[1]):
                self.raw[name] = filled(shape, dtypes[spec.dtype], name, i)
            if name.endswith("kv_b_proj.weight"):
                heads = shape[0] // (Dn + Dv)
                self._uk[name] = filled((heads, shape[1], Dn), np.uint16, name, i + 7919)


class SyntheticRank:
    """What GpuSteps needs of an executor (gpu, ops, configs, layout, caches), for rank `rank` of a tp plan."""
    name = "cuda"

    def __init__(self, gpu, cfg, dcfg, plan, rank: int, max_context: int, seed: int = 0):
        self.gpu, self.config, self.drafter_config = gpu, cfg, dcfg
        self.max_context, self.moe_inter = max_context, plan.moe_inter
        self.plan_dict = plan.to_dict()
        self.lay = RankLayout.from_plan(self.plan_dict, rank)
        self.specs = rank_tensor_specs(plan)
        self.store = SyntheticWeights(gpu, self.specs, cfg, max_context, seed)
        self.ops = BenchOps(gpu, self.lay, self.store)
        self.target_cache, self.draft_cache = device_caches(gpu, cfg, dcfg, plan.tp, max_context)
        self.steps = None
        self.routing_buffers = None           # {MoE layer: (ids, weights)} for a given routing (bench step)

    def fill_caches(self, context: int, seed: int = 1) -> None:
        """Random rows in every cache up to `context` (the committed sequence the step reads)."""
        for L in range(self.config.num_hidden_layers):
            rf.fill_device(self.gpu, self.target_cache.dev.layer(L), seed + L, rf.ACT_BF16)
        for i, a in enumerate(self.draft_cache.k + self.draft_cache.v):
            rf.fill_device(self.gpu, a, seed + 1000 + i, rf.ACT_BF16)
        self.target_cache.length = self.draft_cache.length = context
