"""The latent KV cache on the GPU (kernels/kv_cache.cu), mirroring ddtree/reference/cache.py.

    cache = DeviceLatentCache(gpu, layers=61, capacity=131072, latent=512, rope=64)   # [layers, capacity, 576] bf16
    cache.set_length(T)                                           # committed prefix (device int32)
    cache.append(layer, c_kv, k_pe, q)                            # entries at T .. T + q - 1 of one layer
    cache.compact(keep, n)                                        # after acceptance, every layer
    cache.compact(keep, n, count=count)                           # count on the device: min(n, count[0]) move
    cache.set_length(T + n)

An entry is c_kv (latent = kv_lora_rank) then k_pe (rope = qk_rope_head_dim) in bf16; the kernels compile
for those dims (compile.latent_defines, the attention's constraints: a cache the attention cannot read is
refused at construction). The length lives on the device (`cache.lengths`, int32 [1]) so append,
attention and compaction read it inside a captured graph; the host only moves it between steps
(set_length). Appends do not change the length: the tree entries sit after it until compaction keeps the
accepted ones.
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.compile import latent_defines
from ddtree.plugins.device import DeviceArray, Gpu, _driver, check, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE = "kv_cache.cu"
MAX_COMPACT = 1024               # kv_compact: one thread per kept entry


def append_threads(latent: int, rope: int) -> int:
    """kv_append's block: one thread per 16-byte vector of an entry, rounded up to a warp (Kimi: 72 -> 96)."""
    return 32 * -(-(latent + rope) // 8 // 32)


def normed_append_threads(latent: int, rope: int) -> int:
    """kv_append_normed's block: a warp-rounded group of one thread per 16-byte vector of c_kv, then one thread
    per k_pe pair, rounded up to a warp (Kimi: 64 + 32 = 96)."""
    return 32 * -(-latent // 8 // 32) + 32 * -(-(rope // 2) // 32)


class DeviceLatentCache:
    def __init__(self, gpu: Gpu, layers: int, capacity: int, *, latent: int, rope: int, pdl: bool = True):
        self.defines = latent_defines(latent, rope)          # LatentDimsError before anything compiles
        if layers < 1 or capacity < 1:
            raise ValueError(f"DeviceLatentCache: layers ({layers}) and capacity ({capacity}) must be >= 1")
        self.latent, self.rope, self.entry = latent, rope, latent + rope
        nbytes = layers * capacity * self.entry * 2
        free, total = check(_driver().cuMemGetInfo(), "cuMemGetInfo")
        if nbytes > free:
            raise MemoryError(f"DeviceLatentCache: {layers} layers x {capacity} tokens x {self.entry * 2} B = "
                              f"{nbytes / 2**30:.2f} GiB does not fit in the {free / 2**30:.2f} GiB free on {gpu.name}")
        self.gpu, self.layers, self.capacity = gpu, layers, capacity
        self.pdl = pdl and supports_pdl(gpu)
        self.buf = gpu.alloc((layers, capacity, self.entry), np.uint16)
        self.lengths = gpu.zeros(1, np.int32)
        self.length = 0                  # host mirror of lengths[0]

    def layer(self, layer: int) -> DeviceArray:
        """[capacity, latent + rope] view of one layer (what the attention kernel reads)."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"DeviceLatentCache: layer {layer} outside [0, {self.layers})")
        return self.buf.view(layer * self.capacity * self.entry, (self.capacity, self.entry))

    def set_length(self, n: int) -> None:
        if not 0 <= n <= self.capacity:
            raise ValueError(f"DeviceLatentCache: length {n} outside [0, {self.capacity}]")
        self.gpu.copy_in(self.lengths, np.array([n], dtype=np.int32))
        self.length = n

    def append(self, layer: int, c_kv: DeviceArray | int, k_pe: DeviceArray | int, q: int,
               c_stride: int | None = None, k_stride: int | None = None, stream=None) -> None:
        """Write c_kv [q, latent] and k_pe [q, rope] (rows c_stride / k_stride elements apart, default dense)
        at length .. +q-1."""
        c_stride = self.latent if c_stride is None else c_stride
        k_stride = self.rope if k_stride is None else k_stride
        if q < 1 or self.length + q > self.capacity:
            raise ValueError(f"DeviceLatentCache.append: {q} entries after {self.length} exceed capacity {self.capacity}")
        if c_stride < self.latent or k_stride < self.rope or c_stride % 8 or k_stride % 8:
            raise ValueError(f"DeviceLatentCache.append: strides must be multiples of 8 with c_stride >= {self.latent} "
                             f"and k_stride >= {self.rope} (16-byte rows), got {c_stride}, {k_stride}")
        self.gpu.launch(self.gpu.kernel(SOURCE, "kv_append", self.defines), q, append_threads(self.latent, self.rope),
                        0, ptr(self.layer(layer)), ptr(self.lengths), ptr(c_kv), np.int32(c_stride), ptr(k_pe),
                        np.int32(k_stride), stream=stream, pdl=self.pdl)

    def compact(self, keep: DeviceArray | int, n: int, count: DeviceArray | int | None = None, stream=None) -> None:
        """Every layer: entry length + keep[i] -> length + i for i < n (keep int32, strictly increasing,
        on the device). The caller then sets the length to length + n.
        count: a device int32 [1] (e.g. the acceptance walk's count, inside a captured graph): then only
        the first min(n, count[0]) entries move, read at run time; n is the most a replay may move, and the
        length update (length + count) is the caller's, on the device."""
        if not 0 <= n <= MAX_COMPACT:
            raise ValueError(f"DeviceLatentCache.compact: n = {n} outside [0, {MAX_COMPACT}]")
        if n == 0:
            return
        threads = 32 * -(-n // 32)
        self.gpu.launch(self.gpu.kernel(SOURCE, "kv_compact", self.defines), (self.entry // 8, self.layers), threads,
                        0, ptr(self.buf), np.uint64(self.capacity * self.entry), ptr(self.lengths), ptr(keep),
                        np.int32(n), ptr(count), stream=stream, pdl=self.pdl)
