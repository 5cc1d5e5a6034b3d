"""The tensor-parallel plan: how a Kimi K2.x target and its DFlash drafter split over N ranks.

Every split is an equal, contiguous chunk along one axis of a checkpoint tensor, so rank r holds
rows (or columns) [r * n / N, (r + 1) * n / N). Ranks are processes (one per GPU); between them the
only collective in a forward is the all-reduce (a sum of [q, H] partials), plus the small gathers of
the vocab-parallel head. Letters: N ranks (tp), q tokens in a call, H hidden.

Target, per decoder layer
  input_layernorm, post_attention_layernorm   replicated
  q_a_proj, q_a_layernorm                     replicated: every rank computes the full query latent
                                              c_q [q, 1536] itself. Splitting q_a would need an
                                              all-gather before q_a_layernorm (an RMSNorm over all
                                              1536 dims); replicated costs 22 MB per layer per rank
                                              (1.3 GB over 61 layers at bf16) and no message.
  kv_a_proj_with_mqa, kv_a_layernorm          replicated: every rank computes c_kv and k_pe and keeps
                                              the whole latent cache (576 values per token and layer),
                                              as vLLM does. MLA decode is MQA with one shared latent
                                              key, so splitting heads does not split the cache; a split
                                              kv_a would need an all-gather of [q, 576] per layer.
  q_b_proj, kv_b_proj                         split by head (rows): N/tp heads per rank
  o_proj                                      split by head (columns), row-parallel:
                                              partial [q, H] -> ALL-REDUCE #1
  dense MLP (layers < first_k_dense_replace)  gate/up rows, down columns -> ALL-REDUCE #2
  MoE router (gate.weight, bias)              replicated: every rank routes the same tokens to the same
                                              experts (the all-reduced input is bitwise equal on every
                                              rank with a one-shot all-reduce)
  routed experts, experts="tp" (default)      every rank holds every expert, its intermediate dim split:
                                              gate/up rows, down columns, I/tp per rank. Each rank runs
                                              the same top-k experts on its slice; no token exchange.
                Mode "ep" (expert parallel)   rank r holds whole experts [r E/tp, (r+1) E/tp); a rank
                                              contributes only for the tokens routed to its experts.
                                              Same one all-reduce, but the load depends on the routing.
  shared experts                              gate/up rows, down columns (both modes)
                                              routed + shared partials -> ALL-REDUCE #2 (one per layer)
Target, outside the layers
  embed_tokens                                split by vocab (rows): a rank looks up the ids it owns and
                                              writes zeros for the rest -> ALL-REDUCE #0 ([q, H], exact:
                                              the other ranks add zeros). Saves 2.05 GB per rank at TP8
                                              over a replicated table, for one small all-reduce per call.
  norm                                        replicated
  lm_head                                     split by vocab (rows): rank r computes logits for its
                                              V/tp ids; logits are never all-gathered on the GPU.
Sampling on vocab-split logits (docs/interfaces.md section 5; ddtree/runtime/vocab_parallel.py)
  greedy, and Gumbel-max with no top-k/top-p: exact. Each rank reduces its slice to one (value, id)
  winner per row (value = logit, or z + g(seed, p, v) with the global id v); the winners are
  gathered ([tp, q] pairs) and the largest value wins, ties -> the lower id (= the lower rank).
  top-k: exact. Each rank sends its local top-k (value, id); the global top-k is contained in their
  union (tp * k candidates), merged with the same tie rule.
  top-p: needs a global threshold. With top-k on, the softmax runs over the gathered top-k
  candidates, so it is exact. With top-k off, ranks also send (local max, local sum of exp) so the
  softmax normaliser is global, and send their local top-C candidates; the merged list is the exact
  global order down to the largest of the ranks' C-th values, and if the cumulative probability
  reaches top_p inside that certified prefix the kept set is exact; otherwise C doubles (a second
  gather round) until it does. The only approximation: the normaliser is summed in a different
  order than on one device (relative error ~1e-16), which can flip the kept set only when the
  cumulative probability lands within that of top_p.
  The drafter's tree build takes per-depth top-k log-probabilities: ranks gather (max, sum exp) for
  the log-softmax normaliser, then local top-k of (logp, id), merged: ids exact, log-probabilities
  equal to one device's up to the fp32 rounding of the normaliser.
Drafter (DFlash), planned the same way
  fc [H, K H]                                 split along its input (columns) = over the K tapped
                                              hidden states: partial [n, H] -> ALL-REDUCE, then
                                              hidden_norm (replicated) on the full context vector
  q_proj rows by head, k_proj/v_proj rows by kv head (GQA groups stay on one rank), q_norm/k_norm
  replicated, o_proj columns -> ALL-REDUCE; MLP gate/up rows, down columns -> ALL-REDUCE;
  it borrows the target's vocab-split embedding (ALL-REDUCE) and lm_head (vocab-parallel top-k).
  Each rank keeps the context K/V cache of its own kv heads.

Count per call: target 1 + 2 L all-reduces of [q, H]; drafter 2 + 2 L_d of [b or n, H]; plus the
vocab-parallel gathers, tp * q (value, id) pairs for sampling and tp * k candidates for the tree.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.engine_dir import EXPERT_MODES, plan_all_reduce_counts, plan_per_rank
from ddtree.errors import InputError
from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.plugins import layout

TP_SIZES = (1, 2, 4, 8)
KERNEL_K_MULTIPLE = 64       # kernel layout: K % 64 == 0 for every matrix (hidden for gate/up, I for down)


class PlanError(InputError):
    """The model cannot be split over the requested ranks; the message names the field and --tp."""


REPLICATED, ROWS, COLS = None, 0, 1      # the split axis of one tensor (None: every rank holds it whole)


def _target_split(name: str) -> int | None:
    """Split axis of a dense (non-routed-expert) target tensor, by canonical name."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ROWS
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")):
        return ROWS
    if name.endswith("self_attn.o_proj.weight"):
        return COLS
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight",
                      "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
        return ROWS
    if name.endswith(("mlp.down_proj.weight", "shared_experts.down_proj.weight")):
        return COLS
    return REPLICATED      # norms, q_a_proj, kv_a_proj_with_mqa, the router and its bias


def _drafter_split(name: str) -> int | None:
    """Split axis of a drafter tensor, by its (unprefixed) DFlash name."""
    if name == "fc.weight" or name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        return COLS
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return ROWS
    return REPLICATED      # input/post/final norms, hidden_norm, q_norm, k_norm


@dataclass(frozen=True)
class TPPlan:
    cfg: KimiConfig
    dcfg: DrafterConfig
    tp: int
    experts: str = "tp"

    # per-rank sizes ------------------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp

    @property
    def vocab(self) -> int:
        return self.cfg.vocab_size // self.tp

    @property
    def moe_inter(self) -> int:
        """Routed-expert intermediate size on one rank (I / tp with experts="tp", I with "ep")."""
        I = self.cfg.moe_intermediate_size
        return I // self.tp if self.experts == "tp" else I

    @property
    def experts_per_rank(self) -> int:
        E = self.cfg.n_routed_experts
        return E if self.experts == "tp" else E // self.tp

    def expert_range(self, rank: int) -> tuple[int, int]:
        """Global ids [start, stop) of the routed experts rank `rank` holds."""
        if self.experts == "tp":
            return 0, self.cfg.n_routed_experts
        return rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank

    def vocab_range(self, rank: int) -> tuple[int, int]:
        return rank * self.vocab, (rank + 1) * self.vocab

    def target_split(self, name: str) -> int | None:
        return _target_split(name)

    def drafter_split(self, name: str) -> int | None:
        return _drafter_split(name)

    def all_reduce_counts(self) -> dict[str, int]:
        """All-reduces per forward: the target's (embedding + attention and MLP of every layer) and the
        drafter's (the borrowed embedding, fc, then attention and MLP of every drafter layer)."""
        return plan_all_reduce_counts(self.cfg, self.dcfg)

    def to_dict(self) -> dict:
        """The plan as recorded in the engine's config.json; the runtime reads its ranges from here (and
        recomputes per_rank and all_reduce_count with the same engine_dir functions to check them at load)."""
        return {
            "tp": self.tp, "experts": self.experts,
            "split": "equal contiguous chunks; rank r holds [r * n / tp, (r + 1) * n / tp)",
            "per_rank": plan_per_rank(self.cfg, self.dcfg, self.tp, self.experts),
            "replicated": ["norms", "q_a_proj", "kv_a_proj_with_mqa", "router", "latent KV cache"],
            "all_reduce": ["embedding", "per layer: attention o_proj", "per layer: MLP / MoE down",
                           "drafter: embedding, fc, per layer: o_proj and MLP down"],
            "all_reduce_count": self.all_reduce_counts(),
            "vocab_parallel": "lm_head logits stay split; sampling gathers per-rank winners/candidates",
        }


def _need(value: int, divisor: int, field: str, why: str, where: str) -> None:
    if value % divisor:
        raise PlanError(f"{where}: {field} {value} is not divisible by {divisor} ({why})")


def make_plan(cfg: KimiConfig, dcfg: DrafterConfig, tp: int, experts: str = "tp") -> TPPlan:
    """Check that every split dimension divides and return the plan (PlanError names the field)."""
    if tp not in TP_SIZES:
        raise PlanError(f"--tp {tp}: must be one of {', '.join(map(str, TP_SIZES))}")
    if experts not in EXPERT_MODES:
        raise PlanError(f"--experts {experts!r}: must be one of {', '.join(EXPERT_MODES)}")
    t, dr, by = "config.json", "drafter config.json", f"--tp {tp}"
    _need(cfg.num_attention_heads, tp, "num_attention_heads", f"{by} splits the MLA heads", t)
    _need(cfg.vocab_size, tp, "vocab_size", f"{by} splits embed_tokens and lm_head by vocab", t)
    if cfg.first_k_dense_replace > 0:
        _need(cfg.intermediate_size, tp, "intermediate_size", f"{by} splits the dense MLP", t)
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    _need(shared, tp, "moe_intermediate_size * n_shared_experts", f"{by} splits the shared expert", t)
    if cfg.quant is None:
        raise PlanError(f"{t}: no quantization_config; the engine needs INT4 routed experts "
                        "(compressed-tensors pack-quantized, group 32)")
    if cfg.quant.group_size != layout.GROUP:          # the INT4 scale group the MoE kernel layout is built for
        raise PlanError(f"{t}: quantization_config group_size {cfg.quant.group_size} is not supported; "
                        f"the MoE kernel layout uses group {layout.GROUP}")
    _need(cfg.hidden_size, KERNEL_K_MULTIPLE, "hidden_size", "the MoE kernel layout needs K % 64 == 0", t)
    I = cfg.moe_intermediate_size
    if experts == "tp":
        _need(I, tp, "moe_intermediate_size", f"{by} splits every routed expert", t)
        _need(I // tp, KERNEL_K_MULTIPLE, f"moe_intermediate_size / tp = {I} / {tp}",
              "the MoE kernel layout needs each rank's slice to be a multiple of 64", t)
    else:
        _need(cfg.n_routed_experts, tp, "n_routed_experts", f"{by} with --experts ep places whole experts", t)
        _need(I, KERNEL_K_MULTIPLE, "moe_intermediate_size", "the MoE kernel layout needs K % 64 == 0", t)
    _need(dcfg.num_attention_heads, tp, "num_attention_heads", f"{by} splits the drafter's heads", dr)
    _need(dcfg.num_key_value_heads, tp, "num_key_value_heads", f"{by} splits the drafter's kv heads", dr)
    _need(dcfg.intermediate_size, tp, "intermediate_size", f"{by} splits the drafter's MLP", dr)
    _need(dcfg.num_taps * dcfg.hidden_size, tp, "num taps * hidden_size", f"{by} splits fc's input", dr)
    return TPPlan(cfg, dcfg, tp, experts)
