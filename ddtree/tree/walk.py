"""Target-only acceptance walk (docs/ddtree.md 2.4) and the KV compaction indices (2.5).

At every node i the target's token y[i] is drawn with the shared sampling definition at position
start + depth[i] + 1 (the position the *next* token occupies). From the root, while y[cur] is the
token of a child c of cur, move to c. Committed: the root and every accepted node; the new bonus
token is y at the node where the walk stopped. Because the sample at a node depends only on the
target's logits there and on (seed, position, token), the committed tokens are exactly those
plain autoregressive decoding would produce: lossless at any temperature.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.tree.build import Tree


@dataclass
class WalkResult:
    accepted: np.ndarray     # [a] int32 node indices, strictly increasing, starts with 0 (the root)
    bonus: int               # the target's token after the last accepted node

    @property
    def committed_tree_tokens(self) -> int:
        """tau: tree tokens committed this step, root included."""
        return len(self.accepted)


def accept_walk(tree: Tree, target_tokens: np.ndarray) -> WalkResult:
    """target_tokens [n]: the sampled target token at every node (from `sampling.sample`)."""
    y = np.asarray(target_tokens)
    if y.shape != (tree.size,):
        raise ValueError(f"accept_walk: target_tokens shape {y.shape} != ({tree.size},)")
    kids = tree.children()
    cur, accepted = 0, [0]
    while int(y[cur]) in kids[cur]:
        cur = kids[cur][int(y[cur])]
        accepted.append(cur)
    return WalkResult(np.array(accepted, dtype=np.int32), int(y[cur]))


def sample_positions(tree: Tree, start: int) -> np.ndarray:
    """[n] int64: the absolute position of the token sampled at each node (its own position + 1)."""
    return tree.positions(start) + 1
