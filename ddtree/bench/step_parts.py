"""The rank step's parts (`ddtree bench step`): which family a launched kernel and a metered op belong to, and
each part's ideal and overhead (issue 22's definition, so that a target means the same to everyone):

    ideal    = max(bytes / copy ceiling, FLOPs / dense bf16 peak)   over the meter's records of the part
    overhead = the part's measured time - its ideal

The measured time of a part is the sum of its kernels timed alone (kernel_family); the ideal comes from the
meter (backends/meter.py) walking the same layer functions (meter_family mirrors kernel_family op by op). Every
kernel today does the work of one part (the SwiGLU epilogue is the dense GEMM's, the fused router the
router's, the query's rope in mla_absorb_q_rope the absorb's: its meter record holds both), so a kernel's time
goes to its part whole; a kernel doing the work of several parts would be split in proportion to their ideals
(KERNEL_PARTS, empty today: part_times applies it).
"""
from __future__ import annotations

SPLIT = ("attention", "moe", "router", "dense", "lm_head", "drafter", "tree", "allreduce_standin", "prefetch", "other")
TREE_OPS = ("vocab_winner", "vocab_topk", "tree_build", "accept_walk", "kv_compact")
DENSE_OPS = ("linear", "swiglu_mlp", "mla_absorb_q", "mla_absorb_q_rope", "mla_absorb_out", "moe.shared")
KERNEL_PARTS: dict[str, tuple[str, ...]] = {}      # kernel name prefix -> the parts whose work it does


def kernel_family(rec: dict, vocab_per_rank: int, experts: int) -> str:
    """The split's bucket of one recorded launch (runtime/step_profile.record_launches)."""
    k, fn = rec["kernel"], rec["fn"]
    if rec["tag"]:
        return "allreduce_standin"
    if k == "l2_prefetch":               # beside the attention in the step (timed alone here: the gaps hold the overlap)
        return "prefetch"
    if k.startswith("gemm_bf16"):
        n = int(rec["launch"][4][7])                            # the GEMM's N (SkinnyGemm.run's argument order)
        if n == vocab_per_rank:
            return "lm_head"
        if n == experts:
            return "router"
    if k.startswith(("draft_lse", "draft_topk", "draft_merge", "sample_", "step_", "ctx_window", "kv_compact")):
        return "tree"
    if k == "moe_route" or k.startswith("router_fused"):       # the route kernel, or the fused router (issue 22)
        return "router"
    if fn.startswith("draft"):
        return "drafter"
    if k.startswith(("mla_attention", "mla_decode", "mla_invariant", "kv_append")):
        return "attention"
    if k.startswith(("moe_gate_up", "moe_down", "moe_stream")):
        return "moe"
    if k.startswith(("gemm_bf16", "mla_absorb")):
        return "dense"
    return "other"


def meter_family(rec) -> str:
    """The part of one meter Record (backends/meter.py), by the same rules as kernel_family."""
    if rec.collective:
        return "allreduce_standin"
    if rec.op == "linear" and rec.kind in ("head", "draft_head"):
        return "lm_head"
    if rec.op == "moe.router":
        return "router"
    if rec.op in TREE_OPS:
        return "tree"
    if rec.kind.startswith("draft"):
        return "drafter"
    if rec.op in ("mla_tree_attention", "kv_append", "kv_append_normed"):
        return "attention"
    if rec.op == "moe.experts":
        return "moe"
    if rec.op in DENSE_OPS:
        return "dense"
    return "other"


def part_ideals(records, ceiling_gbps: float, peak_tflops: float | None) -> dict[str, dict]:
    """{part: {"bytes", "flops", "ideal_us"}} over the meter's records (peak None: bytes alone)."""
    parts = {name: {"bytes": 0, "flops": 0} for name in SPLIT}
    for r in records:
        p = parts[meter_family(r)]
        p["bytes"] += r.read + r.written
        p["flops"] += r.flops
    for p in parts.values():
        compute = p["flops"] / (peak_tflops * 1e6) if peak_tflops else 0.0
        p["ideal_us"] = max(p["bytes"] / (ceiling_gbps * 1e3), compute)
    return parts


def part_times(launches, times, vocab_per_rank: int, experts: int, ideals: dict) -> dict[str, float]:
    """Each part's measured us: its kernels' times, a kernel of several parts (KERNEL_PARTS) split in proportion
    to those parts' ideals."""
    split = dict.fromkeys(SPLIT, 0.0)
    for rec, us in zip(launches, times):
        shared = next((v for k, v in KERNEL_PARTS.items() if rec["kernel"].startswith(k)), None)
        if shared:
            total = sum(ideals[p]["ideal_us"] for p in shared) or len(shared)
            for p in shared:
                split[p] += us * (ideals[p]["ideal_us"] or 1) / total
        else:
            split[kernel_family(rec, vocab_per_rank, experts)] += us
    return split


def top_kernels(launches, times, vocab_per_rank: int, experts: int, top: int = 30) -> list[dict]:
    """The step's launches grouped by (kernel, layer function, grid, block), largest total us first: where a part's
    time goes, launch by launch (each timed alone, as in the split)."""
    groups: dict[tuple, dict] = {}
    for rec, us in zip(launches, times):
        kernel, grid, block, smem, _ = rec["launch"]
        grid = list(grid) if isinstance(grid, (tuple, list)) else [grid]                # launches take an int too
        block = list(block) if isinstance(block, (tuple, list)) else [block]
        key = (rec["kernel"], rec["fn"], str(grid), str(block))
        g = groups.setdefault(key, {"kernel": rec["kernel"], "fn": rec["fn"], "grid": grid, "block": block,
                                    "smem": smem, "part": kernel_family(rec, vocab_per_rank, experts),
                                    "launches": 0, "us_total": 0.0})
        g["launches"] += 1
        g["us_total"] += us
    rows = sorted(groups.values(), key=lambda g: -g["us_total"])[:top]
    for g in rows:
        g["us_each"] = g["us_total"] / g["launches"]
    return rows


def target_terms(step_us: float, ideal_us: float, parts: dict, layers: int) -> dict:
    """Issue 48's targets in a row's own numbers: overhead_us_per_layer = (step - its ideal) / the target's layers
    (the fixed cost a layer, target <= 10 us; the drafter's and head's overheads are in it too), dense_x_ideal = the
    dense part's kernels over their ideal (target <= 1.3; None without dense work)."""
    dense = parts.get("dense", {})
    return {"overhead_us_per_layer": (step_us - ideal_us) / layers,
            "dense_x_ideal": dense["us"] / dense["ideal_us"] if dense.get("ideal_us") else None}
