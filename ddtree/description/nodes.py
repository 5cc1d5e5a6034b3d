"""The `ddtree` custom-domain ONNX nodes: their typed attributes, inputs, outputs and in-place outputs.

One table serves three consumers: the onnx backend (backends/onnx_backend.py) writes these nodes, the numpy
implementations (backends/onnx_nodes.py) run them under onnx.reference, and the TensorRT-RTX plugin
creators (backends/tensorrt/) turn the attributes into plugin fields. The TensorRT ONNX parser maps a node
to a plugin by op type = plugin name and domain = plugin namespace, and passes every attribute as a
PluginField typed by the creator's declared fields: int -> INT32, float -> FLOAT32, str -> CHAR
(NUL-terminated), ints -> INT32 array. So float attributes are float32 everywhere (ONNX stores them
so, the kernels use them so), and the numpy implementations use exactly those float32 values.

Every node carries `rank` and `world_size`. Letters: q new tokens, S cache capacity (tokens),
W = ceil(q / 32) mask words, N_r heads on this rank, R kv_lora_rank, Dn/Dr/Dv nope/rope/value head
dims, H hidden, E router experts, b drafter block, n new context tokens, D = b - 1 draft depths,
k candidates per rank, V_r vocab ids on this rank, B tree budget, tp = world_size.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.model.config import RopeConfig

DOMAIN = "ddtree"
PLUGIN_VERSION = "1"
FIELD_KINDS = ("int", "float", "str", "ints")


@dataclass(frozen=True)
class NodeSpec:
    op: str
    fields: dict[str, str]            # attribute name -> kind (FIELD_KINDS), in plugin-field order
    inputs: tuple[str, ...]           # input names with shapes (documentation and arity)
    outputs: tuple[str, ...]
    aliases: dict[int, int]           # output index -> input index it updates in place (TensorRT aliasing)
    kernel: str                       # what the plugin launches (or will), in words
    kernel_files: tuple[str, ...]     # its CUDA sources under ddtree/plugins/kernels/ (empty: none written yet)
    wired: bool                       # the plugin's enqueue launches it (backends/tensorrt/kernels.py node_runner)

    def check_attrs(self, attrs: dict, where: str) -> None:
        """Every declared field present with a value of its kind, and nothing else."""
        missing = [f for f in self.fields if f not in attrs]
        extra = [a for a in attrs if a not in self.fields]
        if missing or extra:
            raise ValueError(f"{where}: ddtree::{self.op} attributes: missing {missing}, unexpected {extra}")
        for name, kind in self.fields.items():
            v = attrs[name]
            ok = {"int": isinstance(v, int) and not isinstance(v, bool), "float": isinstance(v, float),
                  "str": isinstance(v, str), "ints": isinstance(v, (list, tuple))
                  and all(isinstance(x, int) for x in v)}[kind]
            if not ok:
                raise ValueError(f"{where}: ddtree::{self.op} attribute {name}={v!r} must be of kind {kind}")


RANKS = {"rank": "int", "world_size": "int"}
ROPE = {"rope_type": "str", "rope_theta": "float", "rope_factor": "float", "rope_original_max_position": "int",
        "rope_beta_fast": "float", "rope_beta_slow": "float", "rope_mscale": "float", "rope_mscale_all_dim": "float"}

NODES: dict[str, NodeSpec] = {s.op: s for s in (
    NodeSpec(
        "AllReduce", dict(RANKS),
        inputs=("partial [q, H]",), outputs=("sum [q, H]",), aliases={},
        kernel="cross-rank all-reduce: the rank's registered collective (one-shot peer-to-peer or NCCL); "
               "world_size 1 is a device copy", kernel_files=("allreduce.cu",), wired=True),
    NodeSpec(
        "AllGather", dict(RANKS),
        inputs=("x [...]",), outputs=("gathered [tp, ...] (rank order)",), aliases={},
        kernel="cross-rank all-gather: the rank's registered collective (NCCL); world_size 1 is a device copy",
        kernel_files=(), wired=True),
    NodeSpec(
        "Rope", {**RANKS, "style": "str", **ROPE},
        inputs=("x [q, n, Dr]", "pos [q] int32"), outputs=("roped [q, n, Dr]",), aliases={},
        kernel="rotary embedding of interleaved pairs with the YaRN table (style 'interleaved': rope_interleaved)",
        kernel_files=("layer_ops.cu",), wired=True),
    NodeSpec(
        "KvAppend", dict(RANKS),
        inputs=("c_kv [q, R] (normed)", "k_pe [q, Dr] (roped)", "cache [S, R + Dr]", "cache_len [1] int32 (T)"),
        outputs=("cache_out [S, R + Dr]: rows T..T+q-1 written",), aliases={0: 2},
        kernel="latent-cache append (kv_append)", kernel_files=("kv_cache.cu",), wired=True),
    NodeSpec(
        "KvCompact", dict(RANKS),
        inputs=("cache [S, R + Dr]", "cache_len [1] int32 (T: the length before the verify)",
                "accepted [nodes] int32 (kept node indices, increasing, then -1)", "accepted_count [1] int32"),
        outputs=("cache_out [S, R + Dr]: rows T + accepted[i] moved to T + i",), aliases={0: 0},
        kernel="latent-cache compaction to the accepted path (kv_compact)", kernel_files=("kv_cache.cu",),
        wired=True),
    NodeSpec(
        "MlaTreeAttention",
        {**RANKS, "heads": "int", "kv_lora_rank": "int", "qk_rope_head_dim": "int", "softmax_scale": "float"},
        inputs=("q_lat [q, N_r, R] (q_nope W_UK)", "q_rope [q, N_r, Dr] (roped)",
                "cache [S, R + Dr] (the q new rows already appended at T..)", "cache_len [1] int32 (T)",
                "tree_mask [q, W] int32 bits"),
        outputs=("o_lat [q, N_r, R] (before W_UV)",), aliases={},
        kernel="tree-masked absorbed MLA attention (tree form; decode form for q * heads <= 64)",
        kernel_files=("mla_attention.cu", "mla_decode.cu"), wired=True),
    NodeSpec(
        "MarlinMoE",
        {**RANKS, "hidden": "int", "inter": "int", "experts": "int", "n_routed_experts": "int",
         "expert_start": "int", "topk": "int", "n_group": "int", "topk_group": "int",
         "routed_scaling_factor": "float", "group_size": "int"},
        inputs=("x [q, H] (post-attention normed)", "router_logits [q, E] (float32 in plans)", "bias [E] float32",
                "gate_up.words [E_r, ...] int32", "gate_up.scales [E_r, ...] bf16", "down.words [E_r, ...] int32",
                "down.scales [E_r, ...] bf16", "shared [q, H] (shared expert output, added)"),
        outputs=("y [q, H]",), aliases={},
        kernel="fused W4A16 MoE: moe_route, moe_gate_up, moe_down", kernel_files=("moe.cu",), wired=True),
    NodeSpec(
        "DraftAttention",
        {**RANKS, "heads": "int", "kv_heads": "int", "head_dim": "int", "sliding_window": "int",
         "attention_factor": "float", **ROPE},
        inputs=("q [b, Hq_r, d] (q-normed, not yet roped)", "k [b, Hk_r, d] (k-normed, not yet roped)",
                "v [b, Hk_r, d]", "ctx_k [n, Hk_r, d] (k-normed, not yet roped)", "ctx_v [n, Hk_r, d]",
                "pos [b] int32", "cache_k [S, Hk_r, d]", "cache_v [S, Hk_r, d]", "cache_len [1] int32 (T)"),
        outputs=("o [b, Hq_r d]", "cache_k_out [S, Hk_r, d]", "cache_v_out [S, Hk_r, d]"), aliases={1: 6, 2: 7},
        kernel="DFlash draft attention over the context cache and the block (the context rows roped and written "
               "at cache_len, then draft_attention)", kernel_files=("layer_ops.cu", "draft_attention.cu"),
        wired=True),
    NodeSpec(
        "VocabWinner", {**RANKS, "vocab_start": "int", "vocab_size": "int"},
        inputs=("logits [q, V_r] (float32 in plans)", "sample_pos [q] int32", "temperature [1] float32",
                "seed [2] int32 (low word, high word)"),
        outputs=("value [q]", "id [q] int32 (global id)"), aliases={},
        kernel="sampling winner over the rank's vocab slice (node_vocab_winner: greedy at temperature 0, else the "
               "Gumbel argmax, the temperature read on the device)", kernel_files=("sample.cu",), wired=True),
    NodeSpec(
        "VocabTopK", {**RANKS, "vocab_start": "int", "vocab_size": "int", "k": "int"},
        inputs=("logits [D, V_r] float32",),
        outputs=("values [D, k] float32 (raw logits)", "ids [D, k] int32 (global)", "row_max [D] float32",
                 "row_sumexp [D] float32 (sum of exp(x - row_max))"), aliases={},
        kernel="per-depth top-k over the rank's vocab slice with its max and sum of exp (node_vocab_topk)",
        kernel_files=("tree_build.cu",), wired=True),
    NodeSpec(
        "TreeBuild", {**RANKS, "budget": "int"},
        inputs=("root [1] int32", "values [tp, D, k] float32", "ids [tp, D, k] int32", "row_max [tp, D] float32",
                "row_sumexp [tp, D] float32"),
        outputs=("tokens [B + 1] int32", "parents [B + 1] int32", "depth [B + 1] int32",
                 "visibility [B + 1, ceil((B + 1) / 32)] int32 bits"), aliases={},
        kernel="the ranks' normaliser, merge of their candidates and the best-first tree build (node_tree_build)",
        kernel_files=("tree_build.cu",), wired=True),
    NodeSpec(
        "AcceptWalk", dict(RANKS),
        inputs=("tokens [n] int32", "parents [n] int32", "win_value [tp, n]", "win_id [tp, n] int32"),
        outputs=("target_tokens [n] int32", "accepted [n] int32 (node indices, -1 after the path)",
                 "accepted_count [1] int32", "bonus [1] int32"), aliases={},
        kernel="the ranks' winners merged, then the acceptance walk (node_accept_walk: sample_common.cuh accept_walk)",
        kernel_files=("sample.cu",), wired=True),
)}


def node_spec(op: str) -> NodeSpec:
    if op not in NODES:
        raise KeyError(f"ddtree::{op} is not a ddtree node (known: {', '.join(NODES)})")
    return NODES[op]


def rope_attrs(rope) -> dict:
    """A RopeConfig as node attributes (floats are stored as float32 by ONNX)."""
    return {"rope_type": rope.type, "rope_theta": float(rope.theta), "rope_factor": float(rope.factor),
            "rope_original_max_position": int(rope.original_max_position_embeddings),
            "rope_beta_fast": float(rope.beta_fast), "rope_beta_slow": float(rope.beta_slow),
            "rope_mscale": float(rope.mscale), "rope_mscale_all_dim": float(rope.mscale_all_dim)}


def rope_config(attrs: dict):
    """Node attributes -> RopeConfig (the numpy ops' view of the float32 attribute values)."""
    return RopeConfig(theta=float(attrs["rope_theta"]), type=str(attrs["rope_type"]),
                      factor=float(attrs["rope_factor"]),
                      original_max_position_embeddings=int(attrs["rope_original_max_position"]),
                      beta_fast=float(attrs["rope_beta_fast"]), beta_slow=float(attrs["rope_beta_slow"]),
                      mscale=float(attrs["rope_mscale"]), mscale_all_dim=float(attrs["rope_mscale_all_dim"]))
