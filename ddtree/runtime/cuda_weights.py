"""A rank's weights on one GPU for the cuda backend (CudaWeights): raw uploads and the kernels' layouts, each
prepared once at load (runtime/cuda_executor.py builds one per rank)."""
from __future__ import annotations

import numpy as np

from ddtree.backends.cuda_tensor import Tensor
from ddtree.plugins.layer_ops import RopeTable
from ddtree.plugins.layout import fuse_gate_up, tile_bf16
from ddtree.plugins.mla_absorb import uk_transposed

GEMM_SUFFIXES = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight",
                 "q_proj.weight", "k_proj.weight", "v_proj.weight", "down_proj.weight", "mlp.gate.weight",
                 "lm_head.weight", "drafter.fc.weight")
GATE_UP = ("gate_proj.weight", "up_proj.weight")
# GEMM weights over the same x, stored side by side (their tile rows concatenated, in this order) so that
# ops.linears runs them as one GEMM: one launch's ramp and tail instead of two (issue 48)
# The drafter's q, k and v over the block's x (one GEMM), whose k and v run again over the new context: the tail
# of the same buffer (a run of consecutive members is a group too: CudaWeights._group).
SIDE_BY_SIDE = (("kv_a_proj_with_mqa.weight", "q_a_proj.weight"),
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))


def side_by_side(shapes: dict) -> list[tuple]:
    """The weight-name groups of `shapes` ({name: shape}) stored side by side: every prefix holding all of a
    SIDE_BY_SIDE group with equal K, and every weight but the last of whole 16-row tiles (a padded tile would
    put zero columns between the outputs)."""
    groups = []
    for suffixes in SIDE_BY_SIDE:
        for name in shapes:
            if not name.endswith(suffixes[0]):
                continue
            group = tuple(name[: -len(suffixes[0])] + s for s in suffixes)
            if all(n in shapes for n in group) and len({shapes[n][1] for n in group}) == 1 \
                    and all(shapes[n][0] % 16 == 0 for n in group[:-1]):
                groups.append(group)
    return groups



def _tiled_bytes(shape) -> int:
    return -(-shape[0] // 16) * 16 * shape[1] * 2


class CudaWeights:
    """A rank's tensors on the device: raw uploads (norms, embeddings, kv_b, experts, bias) and the kernels'
    layouts (tiled GEMM weights, [gate; up] interleaved per 8 rows and tiled, W_UK^T), each prepared once at load."""

    def __init__(self, gpu, tensors: dict[str, np.ndarray], cfg, max_pos: int):
        self.gpu, self.cfg, self.max_pos = gpu, cfg, max_pos
        self.latent = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        self.raw, self._tiled, self._ones, self._tables = {}, {}, {}, {}
        self._groups = {}
        for group in side_by_side(self.shapes):
            tiles = [tile_bf16(tensors[n], n) for n in group]
            self._group(group, gpu.upload(np.concatenate(tiles)), [t.shape for t in tiles])
        for name, a in tensors.items():
            if name in self._tiled:
                continue
            if name.endswith(GEMM_SUFFIXES):
                self._tiled[name] = gpu.upload(tile_bf16(a, name))
            elif name.endswith(GATE_UP[0]):
                up = tensors[name[: -len(GATE_UP[0])] + GATE_UP[1]]
                # gate and up rows interleaved per 8: the GEMM's epilogue applies the SwiGLU (gemm.cu swiglu)
                self._tiled[name] = gpu.upload(tile_bf16(fuse_gate_up(a, up), name))
            elif not name.endswith(GATE_UP[1]):
                self.raw[name] = gpu.upload(a)
        self._uk = {}
        Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        for name, a in tensors.items():
            if name.endswith("kv_b_proj.weight"):
                self._uk[name] = gpu.upload(uk_transposed(a, a.shape[0] // (Dn + Dv), Dn, Dv))

    @staticmethod
    def plan_bytes(tensors: dict) -> int:
        """Device bytes CudaWeights will hold for these tensors (arrays, or TensorSpecs: shape and nbytes)."""
        total = 0
        for name, a in tensors.items():
            if name.endswith(GEMM_SUFFIXES) or name.endswith(GATE_UP):
                total += _tiled_bytes(a.shape)
            else:
                total += a.nbytes
            if name.endswith("kv_b_proj.weight"):
                total += a.nbytes // 2              # W_UK^T: half of kv_b's rows (Dn = Dv in Kimi and tiny)
        return total

    def tensor(self, name: str) -> Tensor:
        if name not in self.shapes:
            raise KeyError(f"cuda executor: tensor '{name}' is not among the rank's weights")
        if name in self.raw:
            return Tensor.of(self.raw[name], name=name)
        shape = self.shapes[name]             # held only in a kernel layout: its shape, no raw address
        return Tensor(0, shape, np.dtype(np.uint16), (shape[1], 1), name)

    def device(self, name: str):
        return self.raw[name]

    def tiled(self, name: str):
        if name not in self._tiled:
            raise KeyError(f"cuda executor: '{name}' has no tiled GEMM layout (GEMM_SUFFIXES)")
        return self._tiled[name]

    def _group(self, group: tuple, buf, tile_shapes: list) -> None:
        """group's weights as views of one buffer `buf` holding their tiles in order; every run of two or more
        consecutive members is a group of its own (a view from its first member's tiles)."""
        starts = np.cumsum([0] + [int(np.prod(shape)) for shape in tile_shapes])
        for name, shape, offset in zip(group, tile_shapes, starts):
            self._tiled[name] = buf.view(int(offset), shape)
        for i in range(len(group)):
            for j in range(i + 2, len(group) + 1):
                rows = sum(shape[0] for shape in tile_shapes[i:j])
                self._groups[group[i:j]] = buf.view(int(starts[i]), (rows, *tile_shapes[i][1:]))

    def tiled_group(self, names: tuple):
        """The one tiled buffer holding `names` side by side in this order, or None where they are not."""
        return self._groups.get(tuple(names))

    def gate_up(self, gate: str, up: str):
        return self._tiled[gate]

    def layouts(self, name: str) -> list:
        """The device buffers the kernels read for weight `name` (its tiled layout, the fused [gate; up] for a
        gate (none for an up: it lives there), or the raw upload): what an L2 prefetch of it stages."""
        if name in self._tiled:
            return [self._tiled[name]]
        if name in self.raw:
            return [self.raw[name]]
        if name.endswith(GATE_UP[1]) and name[: -len(GATE_UP[1])] + GATE_UP[0] in self._tiled:
            return []
        raise KeyError(f"cuda executor: tensor '{name}' is not among the rank's weights")

    def uk_t(self, kv_b: str, spec):
        return self._uk[kv_b]

    def ones(self, D: int):
        if D not in self._ones:
            self._ones[D] = self.gpu.upload(np.full(D, 0x3F80, np.uint16))        # bf16 1.0
        return self._ones[D]

    def rope_table(self, kind: str, rope, dim: int, factor: float | None = None):
        key = (kind, rope, dim, factor)
        if key not in self._tables:
            self._tables[key] = RopeTable.of(self.gpu, kind, rope, dim, factor, self.max_pos)
        return self._tables[key]
