"""The op set's request ops in the cuda backend (RequestOps, mixed into CudaOps: backends/cuda_backend.py): the union
verify's append and tree attention (description/opset.py REQUEST_OPS) as one launch of the one-request kernels per
request, on its rows, its cache, its length (a [1] view of cache_len [Rq]) and its own tree mask. The row offsets
come from their host copy: each launch needs its rows on the host (a captured union verify fixes them per graph:
bench/step_requests.py feeds a device buffer that carries its host copy). The attention launches run in order on the stream: the launcher's split workspace is shared."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddtree.backends.numpy_math import request_spans


class RequestOps:
    def request_spans(self, caches, cache_len, row_offsets, rows: int, tree_masks=None) -> list[tuple]:
        """The union verify's requests [(request i's cache_len [1] view, first row, end row)]: the row offsets must
        be known on the host (each request is a launch of its own; a captured batched step would fix them per
        graph), the lengths may live on the device only."""
        if row_offsets.host is None:
            raise ValueError(f"{self.where}: the requests' row_offsets must be a host-fed array or a device buffer "
                             "carrying its host copy (one launch per request needs its rows on the host)")
        lens = cache_len.host if cache_len.host is not None else np.zeros(len(caches), np.int32)   # checked below
        shapes = None if tree_masks is None else [np.empty(m.shape, np.int8) for m in tree_masks]
        spans = request_spans(row_offsets.host, lens, len(caches), rows, shapes)
        return [(self.length_of(cache_len, i), a, b) for i, (_, a, b) in enumerate(spans)]

    def length_of(self, cache_len, i: int):
        """Request i's length: a [1] view of cache_len [Rq] (its host copy too, where cache_len has one)."""
        view = self.slice(cache_len, 0, i, i + 1)
        return view if cache_len.host is None else replace(view, host=cache_len.host[i: i + 1])

    def kv_append_requests(self, caches, cache_len, row_offsets, c_kv, k_pe):
        for cache, (length, a, b) in zip(caches, self.request_spans(caches, cache_len, row_offsets, c_kv.shape[0])):
            self.kv_append(cache, length, self.slice(c_kv, 0, a, b), self.slice(k_pe, 0, a, b))
        return caches

    def mla_tree_attention_requests(self, q_lat, q_rope, caches, cache_len, row_offsets, tree_masks, spec):
        q = self._rows(q_lat, "mla_tree_attention_requests")
        out = self.new((q, spec.heads, spec.kv_lora_rank), np.uint16)
        row = spec.heads * spec.kv_lora_rank * out.itemsize                                 # bytes of one out row
        for cache, mask, (length, a, b) in zip(caches, tree_masks,
                                               self.request_spans(caches, cache_len, row_offsets, q, tree_masks)):
            self._attend(self.slice(q_lat, 0, a, b), self.slice(q_rope, 0, a, b), cache, length, mask, spec,
                         out.ptr + a * row)
        return out
