"""A CPU executor seen through one request's logit_bias, remembering the target's logits at the committed rows.

    ex = ObservedExecutor(executor, logit_bias={token_id: bias})
    for chunk in ddtree_steps(ex, ...):          # or ar_steps
        ex.rows[:len(chunk)]                      # [len(chunk), V] float64: the raw target logits each token
                                                  # of the chunk was sampled from, in commit order

logit_bias adds bias[v] to every target logits row before sampling (section 5 then runs on l + bias). It
depends only on the token id, never on the position or the path, so DDTree and AR still sample from the
same values at the same position and commit the same tokens (lossless; tests/runtime/test_observed.py).
The drafter does not see the bias: it only proposes, and the verify decides.

Which rows were committed: every chunk the loops yield is the output of exactly one `sample` call (the
prefill's one row, an AR step's one row, or a DDTree verify over the tree's n nodes), and a verify is
followed by its `accept_walk`, whose accepted nodes [a] are the rows whose samples were committed, in
order (the sample at accepted node i is the token of accepted node i + 1, the last one the bonus). A
chunk cut at EOS / max_new_tokens holds a prefix of those tokens, hence `rows[:len(chunk)]`.

Only the composed steps go through `sample` and `accept_walk`, so the fused steps of a GPU executor are
switched off here (ar_step / ddtree_step None: the loops fall back to the composition). The server uses this
on the CPU executors only (runtime/engine.py refuses it elsewhere, naming the parameter).
"""
from __future__ import annotations

import numpy as np


class ObservedExecutor:
    ar_step = ddtree_step = drafter_prefill = verify_requests = None     # the loops compose the primitives below

    def __init__(self, inner, logit_bias: dict[int, float] | None = None):
        self.inner = inner
        self.bias = None                                  # [V] float64, or None
        if logit_bias:
            V = inner.config.vocab_size
            self.bias = np.zeros(V)
            for token, bias in logit_bias.items():
                if not 0 <= int(token) < V:
                    raise ValueError(f"logit_bias: token id {token} is outside the vocabulary 0..{V - 1}")
                self.bias[int(token)] = float(bias)
        self.rows: np.ndarray | None = None               # [k, V] the raw logits of the last committed rows

    def __getattr__(self, name):                          # every other primitive and attribute: the inner one's
        return getattr(self.inner, name)

    def sample(self, logits, positions, params) -> np.ndarray:
        logits = np.asarray(logits, dtype=np.float64)     # [n, V]
        self.rows = logits
        return self.inner.sample(logits if self.bias is None else logits + self.bias, positions, params)

    def accept_walk(self, tree, target_tokens):
        walk = self.inner.accept_walk(tree, target_tokens)
        self.rows = self.rows[np.asarray(walk.accepted)]  # [a, V]: accepted nodes, root first
        return walk


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """[k, V] logits -> [k, V] float64 log-probabilities (max-shifted log-sum-exp)."""
    rows = np.asarray(rows, dtype=np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
