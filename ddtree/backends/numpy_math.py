"""The op set's math in numpy, float64: what each op computes, written against the kernels' contracts.

The numpy backend (backends/numpy_backend.py) calls these on a rank's arrays, and the onnx.reference node
implementations (backends/onnx_nodes.py) call the same functions on a graph's tensors, so the two CPU
executors cannot drift apart. Where a kernel exists its numpy twin in plugins/reference.py is reused
(MoE experts, MLA attention); the float64 oracle (ddtree/reference) is not imported: it checks this.

Letters as in description/opset.py.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.bf16 import as_float
from ddtree.model.rope import rope_frequencies, rope_magnitude
from ddtree.model.routing import route_logits
from ddtree.plugins import reference as twins
from ddtree.tree.build import Tree, build_tree, pack_visibility
from ddtree.tree.prune import absent_tree
from ddtree.tree.sampling import gumbel
from ddtree.tree.walk import accept_walk

NO_ID = np.iinfo(np.int64).max


def f64(a) -> np.ndarray:
    """Any tensor (bf16 bits, ml_dtypes bfloat16, floats) as float64."""
    a = np.asarray(a)
    return as_float(a.view(np.uint16) if a.dtype.name == "bfloat16" else a, np.float64)


def rms_norm(x, w, eps: float) -> np.ndarray:
    x = f64(x)
    return f64(w) * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def swiglu(x, gate, up, down) -> np.ndarray:
    """x [m, H] -> down(silu(x gate^T) * x up^T) [m, H]."""
    x = f64(x)
    g = x @ f64(gate).T
    return (twins.silu(g) * (x @ f64(up).T)) @ f64(down).T


def embed_rows(ids, table, vocab_start: int) -> np.ndarray:
    """ids [q] -> [q, H]: rows of the ids in this rank's slice of the table, zeros elsewhere."""
    local = np.asarray(ids, dtype=np.int64).reshape(-1) - vocab_start
    mine = (local >= 0) & (local < table.shape[0])
    out = np.zeros((len(local), table.shape[1]))
    out[mine] = f64(np.asarray(table)[local[mine]])
    return out


def rope_interleaved(x, pos, rope) -> np.ndarray:
    """x [q, n, d], pos [q] -> pairs (2i, 2i+1) turned by pos * phi_i (GPT-J style, YaRN table)."""
    x = f64(x)
    angle = np.asarray(pos, dtype=np.float64).reshape(-1)[:, None, None] * rope_frequencies(rope, x.shape[-1])
    cos, sin = np.cos(angle) * rope_magnitude(rope), np.sin(angle) * rope_magnitude(rope)   # [q, 1, d/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def rope_rotate_half(x, pos, freqs: np.ndarray, factor: float) -> np.ndarray:
    """x [n, heads, d], pos [n] -> halves (x1, x2) turned: (x1 c - x2 s, x2 c + x1 s) (the drafter's rope)."""
    x = f64(x)
    angle = np.asarray(pos, dtype=np.float64)[:, None, None] * freqs[None, None, :]
    cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def check_room(what: str, cache_rows: int, T: int, q: int) -> None:
    if T + q > cache_rows:
        raise ValueError(f"{what}: a cache of {cache_rows} entries cannot take {q} new entries after {T}")


def kv_append(cache: np.ndarray, T: int, c_kv, k_pe) -> np.ndarray:
    """cache [S, R + Dr] rows T.. <- (c_kv [q, R] | k_pe [q, Dr]), in place."""
    q, R = np.shape(c_kv)
    check_room("kv_append", cache.shape[0], T, q)
    cache[T: T + q, :R] = np.asarray(c_kv).astype(cache.dtype)
    cache[T: T + q, R:] = np.asarray(k_pe).astype(cache.dtype)
    return cache


def kv_compact(cache: np.ndarray, T: int, accepted, count: int) -> np.ndarray:
    """cache [S, W] (or every layer's, stacked: [L, S, W]) rows T + accepted[i] -> T + i for i < count, in place
    (fancy indexing reads before it writes)."""
    keep = np.asarray(accepted, dtype=np.int64).reshape(-1)[:count]
    S = cache.shape[-2]
    if count < 0 or len(keep) != count or np.any(np.diff(keep) <= 0) or (count and (keep[0] < 0 or
                                                                                    T + keep[-1] >= S)):
        raise ValueError(f"kv_compact: accepted {keep.tolist()} (count {count}) must be increasing rows after {T} "
                         f"inside a cache of {S}")
    cache[..., T: T + count, :] = cache[..., T + keep, :]
    return cache


def mla_absorb_q(q_nope, kv_b, spec) -> np.ndarray:
    """The absorb kernel's twin (plugins/reference.py): [q, N_r, Dn] -> [q, N_r, R]."""
    return twins.mla_absorb_q(f64(q_nope), f64(kv_b), spec.nope_dim, spec.v_dim)


def mla_absorb_out(o_lat, kv_b, spec) -> np.ndarray:
    """[q, N_r, R] -> [q, N_r Dv] (the twin)."""
    return twins.mla_absorb_out(f64(o_lat), f64(kv_b), spec.nope_dim, spec.v_dim)


def mla_tree_attention(q_lat, q_rope, cache, T: int, tree_mask, spec) -> np.ndarray:
    """The kernel's contract in float64 (its twin plugins/reference.mla_tree_attention at dtype float64)."""
    q = len(q_lat)
    check_room("mla_tree_attention", np.shape(cache)[0], T, 0)
    words = np.asarray(tree_mask).view(np.uint32)
    out, _ = twins.mla_tree_attention(f64(q_lat), f64(q_rope), f64(np.asarray(cache)[: T + q]), T, words,
                                      spec.softmax_scale, dtype=np.float64)
    return out                                                                                  # [q, N_r, R]


def request_spans(row_offsets, cache_len, requests: int, rows: int, tree_masks=None) -> list[tuple[int, int, int]]:
    """The union verify's requests (description/opset.py REQUEST_OPS): [(cache_len T_i, first row, end row)],
    checked: offsets from 0 to the call's rows, increasing, one cache length per request, and (tree_masks given)
    one mask [q_i, ceil(q_i / 32)] per request."""
    off = np.asarray(row_offsets, dtype=np.int64).reshape(-1)
    lens = np.asarray(cache_len, dtype=np.int64).reshape(-1)
    if len(off) != requests + 1 or len(lens) != requests or off[0] != 0 or off[-1] != rows or np.any(np.diff(off) <= 0):
        raise ValueError(f"requests: row_offsets {off.tolist()} must rise from 0 to the call's {rows} rows with one "
                         f"span per cache ({requests}), and cache_len {lens.tolist()} hold one length per cache")
    spans = [(int(T), int(a), int(b)) for T, a, b in zip(lens, off[:-1], off[1:])]
    for i, (mask, (_, a, b)) in enumerate(zip(tree_masks if tree_masks is not None else (), spans)):
        if len(tree_masks) != requests or np.shape(mask) != (b - a, -(-(b - a) // 32)):
            raise ValueError(f"requests: tree_mask.{i} must be [{b - a}, {-(-(b - a) // 32)}] (request {i}'s rows), "
                             f"got {list(np.shape(mask))} of {len(tree_masks)} masks")
    return spans


def union_feeds(ids: list, pos: list, cache_len: list, masks: list) -> dict:
    """The verify's host feeds of Rq requests (each its ids [q_i], positions [q_i], committed length and packed
    tree mask [q_i, W_i]): ids, pos [sum q_i], cache_len [Rq], and description/stack.py mask_feeds(Rq)'s (one
    request: tree_mask; more: row_offsets [Rq + 1] and tree_mask.<i>). request_spans above reads them back."""
    feeds = {"ids": np.concatenate(ids).astype(np.int32), "pos": np.concatenate(pos).astype(np.int32),
             "cache_len": np.asarray(cache_len, np.int32)}
    if len(masks) == 1:
        return {**feeds, "tree_mask": masks[0]}
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int32)
    return {**feeds, "row_offsets": offsets, **{f"tree_mask.{i}": m for i, m in enumerate(masks)}}


def moe(x, router_logits, bias, experts: dict, shared_out, spec, matrices=twins.expert_matrices) -> np.ndarray:
    """Routing by model/routing.py, then the fused MoE kernel's twin over this rank's experts (matrices: as
    plugins/reference.moe_given_routing's)."""
    return moe_routed(x, router_logits, bias, experts, shared_out, spec, matrices=matrices)[0]


def moe_routed(x, router_logits, bias, experts: dict, shared_out, spec, live=None,
               matrices=twins.expert_matrices) -> tuple:
    """moe, -> (y [q, H], the global routed ids [q, k]). live [q] (a pruned verify): rows with live 0 route to no
    expert (their routed part is zero)."""
    ids, gates, _ = route_logits(f64(router_logits), f64(bias), spec.topk, spec.n_group, spec.topk_group,
                                 spec.routed_scaling_factor)                                   # [q, k] global
    local = ids - spec.expert_start
    local[(local < 0) | (local >= spec.experts)] = -1                  # another rank's expert (expert parallel)
    if live is not None:
        local[np.asarray(live).reshape(-1) == 0] = -1                  # a dead row: no expert at all
    packed = {"gate_up": experts["gate_up.words"], "gate_up_scale": experts["gate_up.scales"],
              "down": experts["down.words"], "down_scale": experts["down.scales"]}
    return twins.moe_given_routing(f64(x), local, gates, packed, f64(shared_out), matrices), ids


def draft_attention(q, k, v, ctx_k, ctx_v, pos, cache_k: np.ndarray, cache_v: np.ndarray, T: int, rope,
                    spec) -> np.ndarray:
    """DFlash block attention; appends the roped context K/V at T.. of the caches (in place) -> o [b, Hq_r d]."""
    n = len(ctx_k)
    check_room("draft_attention", cache_k.shape[0], T, n)
    freqs, factor = rope_frequencies(rope, spec.head_dim), spec.attention_factor
    pos = np.asarray(pos, dtype=np.int64)
    cache_k[T: T + n] = rope_rotate_half(ctx_k, np.arange(T, T + n), freqs, factor).astype(cache_k.dtype)
    cache_v[T: T + n] = np.asarray(ctx_v).astype(cache_v.dtype)
    # the attention itself: the block kernel's twin (GQA groups are whole on a rank)
    q_roped, k_roped = rope_rotate_half(q, pos, freqs, factor), rope_rotate_half(k, pos, freqs, factor)
    return twins.draft_block_attention(q_roped, k_roped, f64(v), f64(cache_k[: T + n]), f64(cache_v[: T + n]),
                                       T + n, pos, spec.sliding_window, spec.head_dim ** -0.5)


# ----------------------------------------------------------------------------------------------
# vocab-parallel sampling and the tree (ids are global; ties -> the lower id everywhere)

def seed_of(words) -> int:
    """seed [2] int32 (low word, high word) -> the 64-bit sampling seed."""
    lo, hi = (int(w) & 0xFFFFFFFF for w in np.asarray(words).reshape(-1)[:2])
    return lo | hi << 32


def vocab_winner(logits, sample_pos, temperature: float, seed: int, vocab_start: int) -> tuple:
    """This rank's (value [q], global id [q] int32): the sampling definition's argmax over its slice."""
    x = f64(logits)
    if temperature > 0:
        ids = vocab_start + np.arange(x.shape[1])
        x = x / temperature + gumbel(seed, np.asarray(sample_pos, np.int64).reshape(-1)[:, None], ids[None, :])
    return x.max(axis=1), (vocab_start + x.argmax(axis=1)).astype(np.int32)   # first max: the lowest id


def vocab_topk(logits, k: int, vocab_start: int) -> tuple:
    """logits [D, V_r] float32 -> k largest per row (raw values), global ids, row max, sum of exp(x - max)."""
    x = np.asarray(logits, dtype=np.float32)
    if k > x.shape[1]:
        raise ValueError(f"vocab_topk: k {k} exceeds the rank's {x.shape[1]} vocab ids")
    row_max = x.max(axis=1, keepdims=True)                                # [D, 1]
    row_sum = np.exp(x - row_max).sum(axis=1, keepdims=True, dtype=np.float32)
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[1]), x.shape), -x), axis=1)[:, :k]
    return (np.take_along_axis(x, order, axis=1), (vocab_start + order).astype(np.int32), row_max[:, 0],
            row_sum[:, 0])


def tree_build(root: int, values, ids, row_max, row_sumexp, budget: int) -> Tree:
    """Gathered candidates [tp, D, k] -> per-depth top-B log-probabilities (the normaliser from the
    ranks' (max, sum exp) in fp32) -> tree/build.build_tree."""
    tp = values.shape[0]
    top = row_max.max(axis=0)                                             # [D]
    total = row_sumexp[0] * np.exp(row_max[0] - top)
    for r in range(1, tp):
        total = total + row_sumexp[r] * np.exp(row_max[r] - top)
    lse = top + np.log(total)                                             # [D] fp32
    logp = np.concatenate([(values[r] - lse[:, None]).astype(np.float32) for r in range(tp)], axis=1)
    cand = np.concatenate(list(ids), axis=1).astype(np.int64)             # [D, tp k]
    order = np.lexsort((cand, -logp), axis=1)[:, : min(budget, logp.shape[1])]
    tree = build_tree(root, np.take_along_axis(logp, order, axis=1), np.take_along_axis(cand, order, axis=1), budget)
    if tree.size != budget + 1:
        raise ValueError(f"tree_build: only {tree.size - 1} candidates for a budget of {budget}")
    return tree


def tree_tensors(tree: Tree) -> tuple:
    return tree.tokens, tree.parents, tree.depth, pack_visibility(tree.visible()).view(np.int32)


def accept_walk_winners(tokens, parents, win_value, win_id, live=None) -> tuple:
    """Merge the ranks' winners [tp, n] into the target's token at every node, then tree/walk.accept_walk
    -> (target [n] int32, accepted [n] (-1 after the path), count [1], bonus [1]). live [n] (a pruned verify):
    dead nodes are absent (tree/prune.py absent_tree)."""
    top = win_value.max(axis=0)                                           # [n]
    target = np.where(win_value == top, win_id.astype(np.int64), NO_ID).min(axis=0)
    n = len(tokens)
    tree = Tree.from_parents(parents, tokens)
    walk = accept_walk(tree if live is None else absent_tree(tree, live), target)
    accepted = np.full(n, -1, np.int32)
    accepted[: len(walk.accepted)] = walk.accepted
    return (target.astype(np.int32), accepted, np.array([len(walk.accepted)], np.int32),
            np.array([walk.bonus], np.int32))

