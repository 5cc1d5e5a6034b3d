"""The op set's sampling and tree ops in the cuda backend (VocabOps, mixed into CudaOps: backends/cuda_backend.py): the
node kernels of plugins/vocab_nodes.py at any tp, one launch each, outputs in the op sites' arena buffers (so the
TensorRT plugins' runners can hand their own buffers to those sites: backends/tensorrt/plugin_ops.py). Per-step scalars
(temperature, seed, positions, the root) are device tensors the kernels read."""
from __future__ import annotations

import numpy as np

from ddtree.plugins.vocab_nodes import AcceptWalk, TreeBuild, VocabTopK, VocabWinner


class VocabOps:
    def _dense(self, what: str, *pairs) -> None:
        """Each (tensor, dtype): dense and of that dtype (the node kernels read dense rows)."""
        for x, dtype in pairs:
            if not x.contiguous or x.dtype != np.dtype(dtype):
                raise ValueError(f"{self.where}: {what} needs dense {np.dtype(dtype).name} inputs, got "
                                 f"{x.dtype.name} {x.shape} {x.strides}")

    def vocab_winner(self, logits, sample_pos, temperature, seed):
        q, V = self._rows(logits, "vocab_winner"), logits.shape[1]
        self._dense("vocab_winner", (logits, np.float32), (sample_pos, np.int32), (temperature, np.float32),
                    (seed, np.int32))
        start = self.lay.vocab_start
        kernel = self.launcher(("vocab_winner", V, start), lambda: VocabWinner(self.gpu, V, start, self.max_tokens))
        value, winner = self.new((q,), np.float32), self.new((q,), np.int32)
        kernel.run(logits.ptr, sample_pos.ptr, temperature.ptr, seed.ptr, value.ptr, winner.ptr, q, stream=self.stream)
        return value, winner

    def vocab_topk(self, logits, k):
        D, V = self._rows(logits, "vocab_topk"), logits.shape[1]
        self._dense("vocab_topk", (logits, np.float32))
        start = self.lay.vocab_start
        kernel = self.launcher(("vocab_topk", V, k, start), lambda: VocabTopK(self.gpu, V, k, start, self.max_tokens))
        values, ids = self.new((D, k), np.float32), self.new((D, k), np.int32)
        row_max, row_sumexp = self.new((D,), np.float32), self.new((D,), np.float32)
        kernel.run(logits.ptr, values.ptr, ids.ptr, row_max.ptr, row_sumexp.ptr, D, stream=self.stream)
        return values, ids, row_max, row_sumexp

    def tree_build(self, root, values, ids, row_max, row_sumexp, budget):
        tp, D, k = values.shape
        self._dense("tree_build", (root, np.int32), (values, np.float32), (ids, np.int32), (row_max, np.float32),
                    (row_sumexp, np.float32))
        if ids.shape != values.shape or row_max.shape != (tp, D) or row_sumexp.shape != (tp, D):
            raise ValueError(f"{self.where}: tree_build of values {values.shape}, ids {ids.shape}, row_max "
                             f"{row_max.shape}, row_sumexp {row_sumexp.shape} ([tp, D, k] and [tp, D])")
        kernel = self.launcher(("tree_build", tp, D, k, budget), lambda: TreeBuild(self.gpu, tp, D, k, budget))
        n = budget + 1
        tokens, parents, depth = (self.new((n,), np.int32) for _ in range(3))
        visibility = self.new((n, -(-n // 32)), np.int32)
        kernel.run(root.ptr, values.ptr, ids.ptr, row_max.ptr, row_sumexp.ptr, tokens.ptr, parents.ptr, depth.ptr,
                   visibility.ptr, stream=self.stream)
        return tokens, parents, depth, visibility

    def accept_walk(self, tokens, parents, win_value, win_id):
        n, tp = tokens.shape[0], win_value.shape[0]
        self._dense("accept_walk", (tokens, np.int32), (parents, np.int32), (win_value, np.float32),
                    (win_id, np.int32))
        if parents.shape != (n,) or win_value.shape != (tp, n) or win_id.shape != (tp, n):
            raise ValueError(f"{self.where}: accept_walk of tokens {tokens.shape}, parents {parents.shape}, "
                             f"win_value {win_value.shape}, win_id {win_id.shape} ([n] and [tp, n])")
        kernel = self.launcher(("accept_walk", tp), lambda: AcceptWalk(self.gpu, tp, self.max_tokens))
        target, accepted = self.new((n,), np.int32), self.new((n,), np.int32)
        count, bonus = self.new((1,), np.int32), self.new((1,), np.int32)
        kernel.run(tokens.ptr, parents.ptr, win_value.ptr, win_id.ptr, target.ptr, accepted.ptr, count.ptr, bonus.ptr,
                   n, stream=self.stream)
        return target, accepted, count, bonus
