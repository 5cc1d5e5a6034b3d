"""The DFlash drafter in torch, for training: the same math as ddtree/reference/drafter.py.

    ctx   = hidden_norm(fc(concat(target taps)))                    one row per committed token
    h     = target.embed[block]            block = [anchor, MASK x (b-1)] at positions a .. a+b-1
    per layer: K/V of ctx through this layer's k_proj -> k_norm -> rope and v_proj (KV injection);
               q/k/v of RMSNorm_in(h) (q_norm, k_norm, rope); non-causal attention over
               [ctx ; block] with GQA; h += o_proj(.); h += SwiGLU(RMSNorm_post(h))
    logits = target.lm_head(norm(h))[1:]                            block positions 1 .. b-1
RoPE: rotate-half over the whole head dim with the reference's YaRN frequencies, cos/sin times
`attention_factor` (docs/ddtree.md 1.7). Softmax scale head_dim^-1/2.

Training runs many blocks per sequence at once (DFlash objective, docs/ddtree.md 1.5): the context K/V
of all S positions are computed once, and block j (anchor position a_j) sees context positions
< a_j plus its own b block positions, never another block's.

Why this module keeps its own forward instead of running description/layers.py's draft_fc / draft_layer / draft_logits on
the torch backend (as the target does): the op contract gives a drafting call one context length (cache_len),
so the description can train only as DDTree drafts, one call per anchor with the context cache growing to it,
A calls per sequence, while this module runs a sequence's A blocks in one pass under a mask. Both compute the
same loss (checked), but a step of train.py's defaults (16 sequences x 32 anchors x block 8, 512 context rows,
bf16 autocast) measured 3.65 s here against 34.8 s through the description on 2 threads, 3.1 s against 26.6 s on
1 (tests/training/bench_drafter_description.py 16 32 2; this 2-core CPU, shared). A per-block context bound in
draft_attention would let one call carry every block of a sequence.

Letters: B batch, S sequence, A anchors per sequence, b block size, H hidden, K taps,
Hq/Hk query/kv heads, d head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.model.config import DrafterConfig
from ddtree.model.rope import rope_frequencies
from ddtree.training.target_model import RMSNorm, SwiGLU


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d], cos/sin broadcastable [..., d/2]: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        H, d = c.hidden_size, c.head_dim
        self.c = c
        self.q_proj = nn.Linear(H, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(H, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(H, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps)
        self.k_norm = RMSNorm(d, c.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [B, n, H] -> roped, k-normed keys and values [B, Hk, n, d]."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.c.num_key_value_heads, self.c.head_dim))
        k = rotate_half_rope(k, cos[:, :, None], sin[:, :, None])
        v = self.v_proj(x).view(B, n, self.c.num_key_value_heads, self.c.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [B, m, H] block rows, ctx_k/ctx_v [B, Hk, S, d], mask [B, 1, m, S + m] bool -> [B, m, H]."""
        c = self.c
        B, m, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, m, c.num_attention_heads, c.head_dim))
        q = rotate_half_rope(q, cos[:, :, None], sin[:, :, None]).transpose(1, 2)         # [B, Hq, m, d]
        k_blk, v_blk = self.kv(x, cos, sin)                                                # [B, Hk, m, d]
        group = c.num_attention_heads // c.num_key_value_heads
        k = torch.cat([ctx_k, k_blk], dim=2).repeat_interleave(group, dim=1)               # [B, Hq, S+m, d]
        v = torch.cat([ctx_v, v_blk], dim=2).repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.head_dim ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, m, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)


class DFlashDrafter(nn.Module):
    """Parameter names equal the drafter checkpoint's (`layers.0.self_attn.q_proj.weight`, `fc.weight`)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(c.num_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("rope_freqs", torch.from_numpy(rope_frequencies(c.rope, c.head_dim)),
                             persistent=False)                                             # [d/2] float64

    def rope_tables(self, pos: torch.Tensor):
        """pos [B, n] -> cos, sin [B, n, d/2] in the weights' dtype, times attention_factor."""
        angle = pos.to(torch.float64)[..., None] * self.rope_freqs
        f = self.c.attention_factor
        dtype = self.fc.weight.dtype
        return (torch.cos(angle) * f).to(dtype), (torch.sin(angle) * f).to(dtype)

    def forward(self, taps: torch.Tensor, block_embed: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """taps [B, S, K*H] (target layer outputs at positions 0..S-1), block_embed [B, A, b, H]
        (target embeddings of [anchor, MASK...]), anchors [B, A] anchor positions
        -> hidden [B, A, b, H] after the final norm (apply the target lm_head to positions 1..b-1)."""
        B, S, _ = taps.shape
        _, A, b, H = block_embed.shape
        ctx = self.hidden_norm(self.fc(taps))                                              # [B, S, H]
        ctx_cos, ctx_sin = self.rope_tables(torch.arange(S).expand(B, S))
        blk_pos = (anchors[..., None] + torch.arange(b)).reshape(B, A * b)                 # [B, A*b]
        cos, sin = self.rope_tables(blk_pos)
        # block row (j, i) sees context positions < a_j and the rows of its own block j
        sees_ctx = torch.arange(S)[None, None, :] < anchors.repeat_interleave(b, dim=1)[..., None]
        block_id = torch.arange(A).repeat_interleave(b)
        sees_blk = (block_id[:, None] == block_id[None, :]).expand(B, A * b, A * b)
        mask = torch.cat([sees_ctx, sees_blk], dim=2)[:, None]                             # [B, 1, A*b, S+A*b]
        h = block_embed.reshape(B, A * b, H)
        for layer in self.layers:
            attn = layer.self_attn
            ctx_k, ctx_v = attn.kv(ctx, ctx_cos, ctx_sin)                                  # [B, Hk, S, d]
            h = h + attn(layer.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h).reshape(B, A, b, H)
