"""The op set: every operation one rank of the model performs, with its shapes and dtypes.

The layer functions (description/layers.py) are written once over these ops; a backend implements them:
    numpy  (backends/numpy_backend.py)  eager float64 (or float32) arrays, ranks in threads or processes
    onnx   (backends/onnx_backend.py)   emits the per-rank ONNX graphs (`ddtree` plugin nodes, TensorRT-RTX)
    meter  (backends/meter.py)          shapes only: bytes read/written, FLOPs, kernels, collectives per op
    cuda   (backends/cuda_backend.py)   the kernels of ddtree/plugins on one GPU (tp 1 or one rank of tp N)
    torch  (backends/torch_backend.py) torch tensors at tp 1, differentiable: training's target forward
A tensor is whatever the backend returns (an ndarray, a graph variable, a shape record); layer code
never looks inside it except through `shape`.

Granularity is the kernels' (docs/interfaces.md section 6 and the launchers in ddtree/plugins): the
MLA attention takes the absorbed query and a cache that already holds the new entries (rope and the
cache append are ops of their own, as the kernels are); the MoE op is router + routing + experts +
shared expert; the all-reduce of a partial fuses with the residual add and the next norm
(`all_reduce_add_rms_norm`, one kernel on a GPU as in TensorRT-LLM's all-reduce + RMSNorm). State that changes in place (the
latent cache, the drafter's context cache) is an op's input and its returned output: the same buffer.
Per-step scalars (positions, cache length, sampling parameters) are tensors, never constants, so a
captured graph serves every step.

Dtypes: ACT is the activation dtype (bf16 on a GPU, float64 in the CPU tests), ACC the accumulation
dtype of precision-sensitive outputs (router and lm_head logits; float32 where ACT is bf16), I32/F32
fixed. Dims are ints or names bound per call: q tokens, W = ceil(q / 32) mask words, S cache capacity,
n new drafter context tokens, nodes tree nodes.

Letters: H hidden, N_r heads on this rank, R kv_lora_rank, Dn/Dr/Dv nope/rope/value head dims,
E router experts, V_r this rank's vocab ids, b drafter block, D = b - 1 draft depths, k candidates
per rank, B tree budget, tp ranks, Rq requests in one call (the union verify).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass

ACT, ACC, I32, F32 = "act", "acc", "int32", "float32"
DTYPES = (ACT, ACC, I32, F32)


@dataclass(frozen=True)
class RankLayout:
    """Which slice of each split dimension rank `rank` holds (equal contiguous chunks, builder/plan.py)."""
    rank: int
    tp: int
    vocab_start: int
    vocab_stop: int
    expert_start: int       # global id of the rank's first routed expert (0 unless experts="ep")
    expert_stop: int
    fc_start: int           # the drafter fc's input columns (over the concatenated taps)
    fc_stop: int

    @staticmethod
    def from_plan(plan: dict, rank: int) -> "RankLayout":
        """From the "plan" entry of an engine's config.json (builder/plan.py TPPlan.to_dict)."""
        per = plan["per_rank"]
        v, e, f = per["vocab"], per["routed_experts"], per["drafter_fc_in"]
        e0 = rank * e if plan["experts"] == "ep" else 0
        return RankLayout(rank, plan["tp"], rank * v, (rank + 1) * v, e0, e0 + e, rank * f, (rank + 1) * f)


@dataclass(frozen=True)
class MlaSpec:
    heads: int              # N_r
    kv_lora_rank: int       # R
    nope_dim: int           # Dn
    rope_dim: int           # Dr
    v_dim: int              # Dv
    softmax_scale: float


@dataclass(frozen=True)
class MoESpec:
    hidden: int
    inter: int              # I_r: a routed expert's intermediate rows on this rank
    experts: int            # E_r experts held by this rank
    n_routed_experts: int   # E
    expert_start: int
    topk: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    group_size: int         # INT4 scale group of the kernel layout


@dataclass(frozen=True)
class DraftAttentionSpec:
    heads: int              # Hq_r
    kv_heads: int           # Hk_r
    head_dim: int
    sliding_window: int     # 0: full attention
    attention_factor: float


class Ops(ABC):
    """One rank's op set. `lay` says which slices the rank holds; `act`/`acc` name its dtypes."""
    lay: RankLayout

    # graph boundary ------------------------------------------------------------------------------
    @abstractmethod
    def input(self, name: str, shape: list, dtype: str):
        """A per-call tensor fed by the caller (ids, positions, caches, per-step scalars)."""

    @abstractmethod
    def weight(self, name: str):
        """One of the rank's tensors by its rank-file name (builder/weights.py), dtype as stored."""

    @abstractmethod
    def output(self, name: str, x, shape: list, dtype: str) -> None:
        """Expose x as the call's output `name`."""

    @abstractmethod
    def shape(self, x) -> tuple:
        """x's shape (ints, or dim names where the backend is symbolic)."""

    # layout ----------------------------------------------------------------------------------------
    @abstractmethod
    def reshape(self, x, shape: list):
        """0 keeps that input dim (so token dims stay symbolic)."""

    @abstractmethod
    def slice(self, x, axis: int, start: int, stop: int):
        ...

    @abstractmethod
    def cast(self, x, dtype: str):
        ...

    # dense math --------------------------------------------------------------------------------------
    @abstractmethod
    def add(self, a, b):
        """a + b [m, H] in ACT."""

    @abstractmethod
    def rms_norm(self, x, w, eps: float):
        """w * x / sqrt(mean(x^2) + eps) over the last axis, in ACC, returned in ACT."""

    @abstractmethod
    def all_reduce_add_rms_norm(self, partial, h, w, eps: float, tag: str) -> tuple:
        """(h1, rms_norm(h1)) with h1 = h + the sum of every rank's partial [m, H]: the all-reduce fused with
        the residual add and the next norm; every rank receives identical bits."""

    @abstractmethod
    def linear(self, x, w, out: str = ACT):
        """x [m, K] @ w [N, K]^T -> [m, N] in `out` (ACT, or ACC for logits)."""

    def linears(self, x, ws) -> tuple:
        """(x @ w^T for w in ws): several weights over the same x [m, K]. A backend that holds them side by side
        runs one GEMM (the cuda backend: one launch's ramp and tail instead of one a weight, issue 48); the
        others run one linear each, which this default does."""
        return tuple(self.linear(x, w) for w in ws)

    @abstractmethod
    def swiglu_mlp(self, x, gate, up, down):
        """down(silu(x gate^T) * x up^T): x [m, H] -> [m, H] (a rank's slice of a dense MLP: a partial)."""

    @abstractmethod
    def embed(self, ids, table):
        """ids [q] int32 (global) -> [q, H]: rows of the ids in [vocab_start, vocab_stop), zeros elsewhere."""

    # MLA ---------------------------------------------------------------------------------------------
    @abstractmethod
    def rope(self, x, pos, rope):
        """x [q, n, Dr], pos [q] int32 -> interleaved-pair rotary embedding (YaRN table of `rope`)."""

    @abstractmethod
    def kv_append(self, cache, cache_len, c_kv, k_pe):
        """cache [S, R + Dr] <- rows cache_len.. = (c_kv [q, R] | k_pe [q, Dr]); returns the cache (in place)."""

    def kv_append_normed(self, cache, cache_len, latent, norm_w, eps: float, pos, rope):
        """The MLA's kv_a output latent [q, R + Dr] appended as (rms_norm(latent[:, :R]) | rope(latent[:, R:])):
        a pattern of the ops above, composed here; a backend with one kernel for it overrides it (cuda: one
        launch instead of three, the same bits). Returns the cache (in place)."""
        R = self.shape(norm_w)[0]
        Dr = self.shape(cache)[1] - R                     # the cache's entry width (a graph's latent has no shape)
        c_kv = self.rms_norm(self.slice(latent, 1, 0, R), norm_w, eps)                        # [q, R]
        k_pe = self.rope(self.reshape(self.slice(latent, 1, R, R + Dr), [0, 1, Dr]), pos, rope)   # [q, 1, Dr]
        return self.kv_append(cache, cache_len, c_kv, self.reshape(k_pe, [0, Dr]))

    @abstractmethod
    def kv_compact(self, cache, cache_len, accepted, accepted_count):
        """After a verify at T = cache_len: cache rows T + accepted[i] -> T + i for i < accepted_count
        (accepted increasing, -1 after); returns the cache (in place). The caller's length becomes T + count.
        cache [S, W], or [L, S, W]: every layer's cache stacked (one buffer), compacted by one call."""

    @abstractmethod
    def mla_absorb_q(self, q_nope, kv_b, spec: MlaSpec):
        """q_nope [q, N_r, Dn] -> q_lat [q, N_r, R] = per head q_nope W_UK (W_UK = kv_b's first Dn rows per head)."""

    def mla_absorb_q_rope(self, q_all, kv_b, pos, rope, spec: MlaSpec) -> tuple:
        """q_all [q, N_r, Dn + Dr] (q_b's output) -> (q_lat = mla_absorb_q(q_nope), q_rope = rope(q_pe, pos)): the
        query side of the attention, a pattern of the ops above composed here; a backend with one kernel for it
        overrides it (cuda: one launch instead of two, the same bits: one kernel boundary fewer on the query path)."""
        Dn, Dr = spec.nope_dim, spec.rope_dim
        q_nope, q_pe = self.slice(q_all, 2, 0, Dn), self.slice(q_all, 2, Dn, Dn + Dr)
        return self.mla_absorb_q(q_nope, kv_b, spec), self.rope(q_pe, pos, rope)

    @abstractmethod
    def mla_tree_attention(self, q_lat, q_rope, cache, cache_len, tree_mask, spec: MlaSpec):
        """Absorbed MLA over cache rows [0, T + q) (T = cache_len, the q new rows already appended): the
        prefix all visible, the new rows by tree_mask [q, W] bits -> o_lat [q, N_r, R] (before W_UV)."""

    # several requests in one call (the union verify) --------------------------------------------------
    # Rows [offsets[i], offsets[i + 1]) of the call are request i's; request i has its own cache (caches[i], a
    # tuple of Rq tensors) and length cache_len[i]. Not abstract: a backend without them (onnx, torch) refuses
    # them by name (REQUEST_OPS); a layer over one request never calls them, so its graphs are unchanged.
    def kv_append_requests(self, caches: tuple, cache_len, row_offsets, c_kv, k_pe) -> tuple:
        """caches[i] [S_i, R + Dr] <- rows cache_len[i].. = request i's rows of (c_kv [q, R] | k_pe [q, Dr]);
        cache_len [Rq], row_offsets [Rq + 1] int32. Returns the caches (in place)."""
        raise NotImplementedError(f"{type(self).__name__} has no kv_append_requests (several requests in one call "
                                  "run on the numpy, meter and cuda backends)")

    def mla_tree_attention_requests(self, q_lat, q_rope, caches: tuple, cache_len, row_offsets, tree_masks: tuple,
                                    spec: MlaSpec):
        """mla_tree_attention per request: request i's rows see caches[i]'s rows [0, cache_len[i]) and, by its own
        tree mask tree_masks[i] [q_i, ceil(q_i / 32)], its new rows -> o_lat [q, N_r, R]. Each request's rows are
        exactly its own mla_tree_attention (a backend may launch the one-request kernel per request)."""
        raise NotImplementedError(f"{type(self).__name__} has no mla_tree_attention_requests (several requests in "
                                  "one call run on the numpy, meter and cuda backends)")

    @abstractmethod
    def mla_absorb_out(self, o_lat, kv_b, spec: MlaSpec):
        """o_lat [q, N_r, R] -> [q, N_r Dv] = per head o_lat W_UV^T (W_UV = kv_b's last Dv rows per head)."""

    # MoE ---------------------------------------------------------------------------------------------
    @abstractmethod
    def moe(self, x, router, bias, experts: dict, shared: tuple, spec: MoESpec):
        """Normed x [q, H] -> partial [q, H]: router logits (ACC) -> noaux_tc routing -> the rank's routed
        experts (INT4 kernel layout: experts = {"gate_up.words", "gate_up.scales", "down.words",
        "down.scales"}) + its slice of the shared expert (shared = (gate, up, down))."""

    # drafter -----------------------------------------------------------------------------------------
    @abstractmethod
    def draft_attention(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, rope,
                        spec: DraftAttentionSpec) -> tuple:
        """Block q/k/v [b, H*, d] (normed, not roped), new context ctx_k/ctx_v [n, Hk_r, d] -> (o [b, Hq_r d],
        cache_k, cache_v) with the roped context appended at cache_len.. (in place); non-causal over
        the cache, the new context and the block, sliding window if set."""

    # collectives -------------------------------------------------------------------------------------
    @abstractmethod
    def all_reduce(self, x, tag: str):
        """Sum of every rank's x [m, H]; every rank receives identical bits."""

    @abstractmethod
    def all_gather(self, x, tag: str):
        """Every rank's x [...] stacked in rank order -> [tp, ...] (the vocab-parallel winners and candidates)."""

    # scheduling: independent ops ---------------------------------------------------------------------
    @contextmanager
    def branch(self):
        """The ops inside read nothing that the ops after the block write, up to join(b) (b: what this yields):
        a backend may run them beside those (cuda: a parallel branch of the step's graph, backends/cuda_branch.py).
        Here, and in every backend that does not override it, they simply run in order."""
        yield None

    def join(self, b) -> None:
        """After this, ops may read what the ops of branch b wrote (in order: nothing to do)."""

    def prefetch(self, *names: str, beside: str = "attention") -> None:
        """A hint: the weights of these names are read soon, after the op that runs next (a backend may stage
        them in cache while that op runs, finishing by the end of the call: cuda, beside the tree attention or a
        collective, backends/cuda_branch.py). `beside` says which: "attention", "collective", or "experts" (the
        routed experts of the MoE that follows, once it is routed; where no MoE follows, the end of the call). No
        value depends on it; here, and in every backend that does not override it, nothing happens."""

    # vocab-parallel sampling and the tree ------------------------------------------------------------
    @abstractmethod
    def vocab_winner(self, logits, sample_pos, temperature, seed) -> tuple:
        """This rank's (value [q], global id [q]) winner: argmax of logits (T = 0) or z + Gumbel (T > 0)."""

    @abstractmethod
    def vocab_topk(self, logits, k: int) -> tuple:
        """logits [D, V_r] float32 -> (values [D, k], global ids [D, k], row_max [D], row_sumexp [D])."""

    @abstractmethod
    def tree_build(self, root, values, ids, row_max, row_sumexp, budget: int) -> tuple:
        """Gathered candidates [tp, D, k] -> (tokens, parents, depth [B + 1], visibility [B + 1, words])."""

    @abstractmethod
    def accept_walk(self, tokens, parents, win_value, win_id) -> tuple:
        """Gathered winners [tp, n] -> (target_tokens [n], accepted [n] (-1 after the path), count [1], bonus [1])."""

    # pruning a tree inside its verify (issue 53; a backend that prunes overrides these, the others refuse) ------
    def moe_live(self, x, router, bias, experts: dict, shared: tuple, spec: MoESpec, live) -> tuple:
        """moe over the live rows only (live [q] I32): a dead row routes to no expert (its routed part is zero, the
        shared expert still runs) -> (partial [q, H], the routed ids [q, topk] I32: global, every row's)."""
        raise NotImplementedError(f"{type(self).__name__} cannot prune a tree inside its verify (moe_live)")

    def tree_prune(self, live, parents, path_prob, routed_ids, rate, expert_bytes, horizon: int):
        """live [q] I32, parents [q] I32, path_prob [q] F32, routed_ids [q, topk] I32 (global), rate [1] F32 (tokens
        per expert byte), expert_bytes [1] I32, horizon a python int (an attribute, not a feed: the MoE layers after
        this one, description/layers.py moe_horizon) -> live_out [q] I32: tree/prune.py prune_nodes (the kernel
        kernels/tree_prune.cu)."""
        raise NotImplementedError(f"{type(self).__name__} cannot prune a tree inside its verify (tree_prune)")

    def accept_walk_live(self, tokens, parents, win_value, win_id, live) -> tuple:
        """accept_walk with dead nodes (live [n] I32 == 0) absent: the walk never enters them."""
        raise NotImplementedError(f"{type(self).__name__} cannot prune a tree inside its verify (accept_walk_live)")


OP_NAMES = tuple(sorted(name for name, fn in vars(Ops).items() if getattr(fn, "__isabstractmethod__", False)))
# patterns: Ops methods composed of the ops above, which a backend may run as one kernel instead
PATTERNS = ("kv_append_normed", "mla_absorb_q_rope")
# ops over several requests' caches at once (the union verify, description/layers.py decoder_layer(requests=R)):
# a backend implements them or refuses them by name (the onnx graphs and torch run one request a call)
REQUEST_OPS = ("kv_append_requests", "mla_tree_attention_requests")
