"""The op set's latent-cache ops in the cuda backend (CacheOps, mixed into CudaOps: backends/cuda_backend.py): the
kernels of kernels/kv_cache.cu on the op's cache [S, R + Dr] and its device length (cache_len), so a captured step
appends and compacts wherever the cache ends. kv_append_normed is the op set's pattern (description/opset.py) run as one
kernel: the bits of rms_norm + rope + kv_append."""
from __future__ import annotations

import numpy as np

from ddtree.plugins.compile import latent_defines
from ddtree.plugins.device import ptr
from ddtree.plugins.kv_cache import MAX_COMPACT, SOURCE, append_threads, normed_append_threads


class CacheOps:
    def kv_append(self, cache, cache_len, c_kv, k_pe):
        q, R, Dr = self._rows(c_kv, "kv_append"), c_kv.shape[1], k_pe.shape[1]
        if cache_len.host is not None and int(cache_len.host[0]) + q > cache.shape[0]:
            raise ValueError(f"{self.where}: {q} cache rows after {int(cache_len.host[0])} exceed its {cache.shape[0]}")
        g = self.gpu
        g.launch(g.kernel(SOURCE, "kv_append", latent_defines(R, Dr)), q, append_threads(R, Dr), 0,
                 ptr(cache.ptr), ptr(cache_len.ptr), ptr(c_kv.ptr), np.int32(c_kv.row_stride("kv_append c_kv")),
                 ptr(k_pe.ptr), np.int32(k_pe.row_stride("kv_append k_pe")), stream=self.stream, pdl=self.k.pdl)
        return cache

    def kv_append_normed(self, cache, cache_len, latent, norm_w, eps, pos, rope):
        q, R = self._rows(latent, "kv_append_normed"), norm_w.shape[0]
        Dr = latent.shape[1] - R
        if cache.shape[1] != R + Dr:
            raise ValueError(f"{self.where}: kv_append_normed of a [{q}, {R + Dr}] latent into a cache of "
                             f"{cache.shape}")
        if cache_len.host is not None and int(cache_len.host[0]) + q > cache.shape[0]:
            raise ValueError(f"{self.where}: {q} cache rows after {int(cache_len.host[0])} exceed its {cache.shape[0]}")
        table = self.store.rope_table("interleaved", rope, Dr)
        g = self.gpu
        g.launch(g.kernel(SOURCE, "kv_append_normed", latent_defines(R, Dr)), q, normed_append_threads(R, Dr), 0,
                 ptr(cache.ptr), ptr(cache_len.ptr), ptr(latent.ptr), np.int32(latent.row_stride("kv_append_normed")),
                 ptr(norm_w.ptr), np.float32(eps), ptr(pos.ptr), ptr(table.table), np.int32(table.max_pos),
                 stream=self.stream, pdl=self.k.pdl)
        return cache

    def kv_compact(self, cache, cache_len, accepted, accepted_count):
        if accepted_count.host is None:                        # on the device only (a captured step): the
            n, count = accepted.shape[0], ptr(accepted_count.ptr)  # kernel moves min(n, count[0]) rows
        else:
            n, count = int(accepted_count.host[0]), ptr(None)
        if not 0 <= n <= MAX_COMPACT:
            raise ValueError(f"{self.where}: kv_compact of {n} rows (at most {MAX_COMPACT})")
        if len(cache.shape) not in (2, 3) or not cache.contiguous:
            raise ValueError(f"{self.where}: kv_compact of a {cache.shape} cache with strides {cache.strides} "
                             "(expected a dense [S, W], or every layer's stacked: [L, S, W])")
        if n:                                                  # one launch for every layer of a stacked cache
            (S, entry), layers, g = cache.shape[-2:], int(np.prod(cache.shape[:-2])), self.gpu
            g.launch(g.kernel(SOURCE, "kv_compact", latent_defines(*self.store.latent)), (entry // 8, layers),
                     32 * -(-n // 32), 0, ptr(cache.ptr), np.uint64(S * entry), ptr(cache_len.ptr),
                     ptr(accepted.ptr), np.int32(n), count, stream=self.stream, pdl=self.k.pdl)
        return cache
