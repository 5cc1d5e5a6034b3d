"""The Kimi K2.x target for training: the checkpoint's parameters, and a forward that is the one description.

    logits, taps = model(ids)      ids [B, S] at positions 0..S-1 -> logits [B, S, V], {L: h [B, S, H]}

The modules below only hold the parameters, under the checkpoint's canonical names
(`model.layers.3.self_attn.q_a_proj.weight`); the forward runs description/layers.py's embed, decoder layers and head
on the torch backend (backends/torch_backend.py: target_forward over fresh latent caches, a causal tree
mask), so training computes the layer every executor runs: absorbed MLA over the latent cache, interleaved
YaRN rope, noaux_tc routing (sigmoid scores, top-k of score + e_score_correction_bias, unbiased weights
renormalised times routed_scaling_factor, plus the shared expert). Gradients flow through every op.

Training-only parts, carried by the backend:
  expert_quant  > 0: the routed experts compute through `fake_quant` (INT4 group quantisation with a
                straight-through gradient), so they train onto the grid the checkpoint stores (QAT)
  dropout       residual dropout on the attention and MLP outputs where they join the residual stream
                (the backend's all-reduces tagged "attn" and "mlp"), while `training`; not in the checkpoint
  update_bias   the aux-loss-free balancing of the correction bias (DeepSeek-V3 section 2.1.2: after each
                step, bias += u * sign(mean load - expert load), from the loads the last forward routed;
                the bias only steers selection, so it needs no gradient)
A training step of the description measured as fast as the previous hand-written torch module's (tiny config,
batch 16 x 512, bf16 autocast, 2 threads, this CPU: best of 3, 1903 against 1711 tokens/s; the absorbed
attention's single key head folds the heads into the query rows, one SDPA call per layer).

`RMSNorm` and `SwiGLU` keep a forward for the drafter's training module (drafter_model.py).
Letters: B batch, S sequence, H hidden, N heads, R kv_lora_rank, Dn/Dr/Dv head dims, E experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.backends.torch_backend import (
    TorchOps,
    causal_mask,
    fake_quant,
    new_target_caches,
    target_forward,
    tp1_layout,
)
from ddtree.description.layers import router_weight
from ddtree.model.config import KimiConfig

__all__ = ["KimiForCausalLM", "MoE", "RMSNorm", "SwiGLU", "fake_quant", "init_weights"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLA(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        H, N = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, N * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(N * cfg.v_head_dim, H, bias=False)


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
        self.gate = Router(H, E)
        self.experts = nn.ModuleList(SwiGLU(H, I) for _ in range(E))
        self.shared_experts = SwiGLU(H, I * cfg.n_shared_experts)
        self.register_buffer("load", torch.zeros(E), persistent=False)           # tokens per expert, last forward

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


class KimiModel(nn.Module):
    """`model.*` of the checkpoint: embed, layers, norm."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, L) for L in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiForCausalLM(nn.Module):
    """Parameter names equal the checkpoint's canonical names; forward = the description on TorchOps."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        self.model = KimiModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.expert_quant = 0               # > 0: routed experts through fake_quant of this group (QAT)
        self.dropout = 0.0                  # residual dropout while training (not in the checkpoint)

    def ops(self) -> TorchOps:
        """The torch backend over this model's parameters and buffers (built per call: `.double()` replaces
        the buffers), in the parameters' dtype."""
        weights = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return TorchOps(weights, tp1_layout(self.cfg), act=self.lm_head.weight.dtype, expert_quant=self.expert_quant,
                        dropout=self.dropout if self.training else 0.0)

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def set_expert_quant(self, group: int) -> None:
        """group > 0: routed experts compute with INT4 fake-quantised weights (QAT); 0: off."""
        self.expert_quant = group

    def forward(self, ids: torch.Tensor, taps=()):
        """ids [B, S] (positions 0..S-1, causal) -> logits [B, S, V] (float32 or the weights' float64),
        {L: h [B, S, H]} (output of layer L); each MoE's `load` is what this call routed."""
        B, S = ids.shape
        ops = self.ops()
        logits, tapped = target_forward(ops, self.cfg, ids, torch.arange(S, dtype=torch.int32),
                                        new_target_caches(self.cfg, B, S, ops.act), torch.zeros(1, dtype=torch.int32),
                                        causal_mask(S), taps)
        for L, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE):
                layer.mlp.load = ops.loads[router_weight(L)].float()
        return logits, tapped


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) linears and embeddings; output projections scaled down by depth (GPT-2 style)."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = max(len(getattr(getattr(model, "model", model), "layers", [])), 1)
    for name, p in sorted(model.named_parameters()):
        if p.ndim == 2:
            s = std / (2 * n_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * s)
