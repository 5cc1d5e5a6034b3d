"""The Kimi K2.x target in torch, for training: the same math as ddtree/reference/model.py.

    h = embed[ids]
    per layer: h += MLA(RMSNorm_in(h));  h += FFN(RMSNorm_post(h))   (dense SwiGLU on layer 0, MoE after)
    logits = lm_head(RMSNorm_final(h))

MLA runs in the expanded ("naive") form: per-head keys [k_nope | k_pe] and values from kv_b, a
causal softmax with the config's softmax scale (192^-1/2 * mscale^2 in Kimi). RoPE rotates
interleaved pairs (2i, 2i+1) of the rope dims with the reference's YaRN frequencies. The MoE
routes with sigmoid scores, selects the top-k of score + e_score_correction_bias, weights by the
unbiased scores renormalised and times routed_scaling_factor, and always adds the shared expert.

Training-only parts: `fake_quant` (INT4 group-32 quantisation with a straight-through gradient, so
the routed experts train onto the grid the checkpoint stores) and the aux-loss-free balancing of
the correction bias (`update_bias`, DeepSeek-V3 section 2.1.2: after each step, bias += u *
sign(mean load - expert load); the bias only steers selection, so it needs no gradient).

Letters: B batch, S sequence, H hidden, N heads, R kv_lora_rank, Dn/Dr/Dv head dims, E experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.model.config import KimiConfig
from ddtree.model.rope import rope_frequencies, rope_magnitude


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest bf16 (RNE), kept in float32: what the checkpoint stores."""
    return x.to(torch.bfloat16).to(torch.float32)


def fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] -> its INT4 group-`group` dequantised value (as int4.quantize_int4: scale = bf16(amax/7),
    q = clip(rint(w / scale), -7, 7)); the gradient passes straight through to w."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    amax = g.detach().abs().amax(dim=2, keepdim=True)
    scale = bf16_round(torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)))
    q = torch.clamp(torch.round(g / scale), -7, 7) * scale
    return (g + (q - g).detach()).reshape(n, k)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.quant_group = 0                       # > 0: forward through fake-quantised weights

    def forward(self, x):
        g, u, d = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        if self.quant_group:
            g, u, d = (fake_quant(w, self.quant_group) for w in (g, u, d))
        return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, heads?, Dr] with cos/sin broadcastable [..., S, 1?, Dr/2]: pairs (2i, 2i+1) turn."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class MLA(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        H, N = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, N * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(N * cfg.v_head_dim, H, bias=False)

    def project(self, x, cos, sin):
        """x [B, S, H] -> q [B, N, S, Dn+Dr], k [B, N, S, Dn+Dr], v [B, N, S, Dv]."""
        c = self.cfg
        B, S, _ = x.shape
        N, Dn, Dr, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, S, N, Dn + Dr)
        q_pe = rope_interleaved(q[..., Dn:], cos[:, None], sin[:, None])                 # [B, S, N, Dr]
        a = self.kv_a_proj_with_mqa(x)                                                    # [B, S, R + Dr]
        c_kv = self.kv_a_layernorm(a[..., :R])                                            # [B, S, R]
        k_pe = rope_interleaved(a[..., R:], cos, sin)                                     # [B, S, Dr] shared
        kv = self.kv_b_proj(c_kv).view(B, S, N, Dn + c.v_head_dim)
        k = torch.cat([kv[..., :Dn], k_pe[:, :, None].expand(B, S, N, Dr)], dim=-1)       # [B, S, N, Dn+Dr]
        q = torch.cat([q[..., :Dn], q_pe], dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), kv[..., Dn:].transpose(1, 2)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        o = causal_attention(q, k, v, self.cfg.softmax_scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))                           # [B, S, H]


def causal_attention(q, k, v, scale: float, is_causal: bool = True):
    """SDPA with v zero-padded to q/k's head dim (Dv < Dn + Dr in MLA): torch's fused CPU kernel
    needs equal head dims, and the math fallback materialises [B, N, S, S]. Returns [B, N, S, Dv]."""
    dv, dqk = v.shape[-1], q.shape[-1]
    if dv < dqk:
        v = F.pad(v, (0, dqk - dv))
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)[..., :dv]


class Router(nn.Module):
    """`mlp.gate`: the router weight [E, H] and the F32 correction bias [E] (selection only)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))


class MoE(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        H, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        if cfg.n_group != 1:
            raise ValueError("training supports n_group = 1 only (the embedded model's routing)")
        self.cfg = cfg
        self.gate = Router(H, E)
        self.experts = nn.ModuleList(SwiGLU(H, I) for _ in range(E))
        self.shared_experts = SwiGLU(H, I * cfg.n_shared_experts)
        self.register_buffer("load", torch.zeros(E), persistent=False)           # tokens per expert, last forward

    def forward(self, x):
        c = self.cfg
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                                      # [T, H]
        rdtype = torch.promote_types(x.dtype, torch.float32)                              # router >= fp32
        with torch.autocast("cpu", enabled=False):
            scores = torch.sigmoid(F.linear(x.to(rdtype), self.gate.weight.to(rdtype)))   # [T, E]
        bias = self.gate.e_score_correction_bias
        chosen = torch.topk(scores.detach() + bias, c.num_experts_per_tok, dim=-1).indices  # [T, k]
        picked = scores.gather(1, chosen)                                                 # [T, k] unbiased
        weights = picked / (picked.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        out = self.shared_experts(x)
        self.load = torch.bincount(chosen.flatten(), minlength=c.n_routed_experts).float()
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel():
                y = expert(x[rows]) * weights[rows, slot, None]
                out = out.index_add(0, rows, y.to(out.dtype))
        return out.reshape(shape)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
        self.gate.e_score_correction_bias += rate * torch.sign(self.load.mean() - self.load)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.dropout = 0.0                         # training-only residual dropout (not in the checkpoint)

    def forward(self, h, cos, sin):
        p = self.dropout if self.training else 0.0
        h = h + F.dropout(self.self_attn(self.input_layernorm(h), cos, sin), p)
        return h + F.dropout(self.mlp(self.post_attention_layernorm(h)), p)


class KimiModel(nn.Module):
    """`model.*` of the checkpoint: embed, layers, norm."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, L) for L in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiForCausalLM(nn.Module):
    """Parameter names equal the checkpoint's canonical names (`model.layers.3.self_attn.q_a_proj.weight`)."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        self.model = KimiModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        freqs = torch.from_numpy(rope_frequencies(cfg.rope, cfg.qk_rope_head_dim))      # [Dr/2] float64
        self.register_buffer("rope_freqs", freqs, persistent=False)
        self.rope_magnitude = rope_magnitude(cfg.rope)

    def rope_tables(self, pos: torch.Tensor):
        """pos [S] -> cos, sin [S, Dr/2] in the weights' dtype (angles in float64 like the reference)."""
        angle = pos.to(torch.float64)[:, None] * self.rope_freqs[None, :]
        dtype = self.lm_head.weight.dtype                          # float32 (float64 in equality tests)
        return (torch.cos(angle) * self.rope_magnitude).to(dtype), (torch.sin(angle) * self.rope_magnitude).to(dtype)

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def set_expert_quant(self, group: int) -> None:
        """group > 0: routed experts compute with INT4 fake-quantised weights (QAT); 0: off."""
        for moe in self.moe_layers():
            for expert in moe.experts:
                expert.quant_group = group

    def forward(self, ids: torch.Tensor, taps=()):
        """ids [B, S] (positions 0..S-1) -> logits [B, S, V], {L: h [B, S, H]} (output of layer L)."""
        cos, sin = self.rope_tables(torch.arange(ids.shape[1], device=ids.device))
        h = self.model.embed_tokens(ids)                                                  # [B, S, H]
        tapped = {}
        for L, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin)
            if L in taps:
                tapped[L] = h
        return self.lm_head(self.model.norm(h)), tapped


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) linears and embeddings; output projections scaled down by depth (GPT-2 style)."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = max(len(getattr(getattr(model, "model", model), "layers", [])), 1)
    for name, p in sorted(model.named_parameters()):
        if p.ndim == 2:
            s = std / (2 * n_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * s)
