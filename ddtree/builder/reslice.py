"""Rank r of a tp N engine cut out of a tp 1 engine's tensors, bit-equal to what the builder writes.

For tests that run every rank slice of a model whose tp 1 tensors exist only in memory (generated on
the device, no checkpoint to build from). Input: rank 0 of a tp 1 engine as load_rank_tensors(convert=
STORED) returns it (or any object with numpy basic slicing); output: the same names, rank r's slice.
Letters: N ranks, r the rank, E experts, I the routed intermediate size, I_r = I / N, H hidden.

Dense tensors, the split axis of builder/weights.py file_plan (plan.target_split / drafter_split, as
_stream_dense cuts them):
  ROWS        [n, ...] -> [n/N, ...]   rows [r n/N, (r+1) n/N)      q_b, kv_b, gate/up, embed, lm_head
  COLS        [m, n]   -> [m, n/N]     columns [r n/N, (r+1) n/N)   o_proj, down, drafter fc
  replicated  as is                                                  norms, q_a, kv_a, router, bias
Routed experts, experts="tp" (every expert, its intermediate rows [r I_r, (r+1) I_r)):
  gate_up.words   [E, 2I/32, H/64, 2, 32, 4] -> [E, 2I_r/32, H/64, 2, 32, 4]   dim 1 [r I_r/16, (r+1) I_r/16)
  gate_up.scales  [E, 2I/32, H/64, 2,  8, 4] -> [E, 2I_r/32, H/64, 2,  8, 4]   same
  down.words      [E, H/32, I/64,  2, 32, 4] -> [E, H/32, I_r/64,  2, 32, 4]   dim 2 [r I_r/64, (r+1) I_r/64)
  down.scales     [E, H/32, I/64,  2,  8, 4] -> [E, H/32, I_r/64,  2,  8, 4]   same
  Why these are ranges: the fused gate/up matrix [2I, H] is built 8 rows at a time (fused tile f = gate
  rows 8f..8f+7, then up rows 8f..8f+7, layout.fuse_gate_up), and dim 1 of the layout is a pair of
  16-row tiles, so entry p holds gate and up of intermediate rows 16p .. 16p+15 and nothing else.
  Rank r's rows are entries [r I_r/16, (r+1) I_r/16) in order, which is what repacking the rank's own
  [2 I_r, H] gives (I_r % 16 == 0). down [H, I] is laid out in 64-wide chunks of its K = I (dim 2),
  each holding its own columns and their two 32-groups of scales, so rank r's columns [r I_r,
  (r+1) I_r) are chunks [r I_r/64, (r+1) I_r/64) (I_r % 64 == 0). Rows (H) are untouched.
Routed experts, experts="ep": all four, dim 0 [r E/N, (r+1) E/N) (whole experts).
Anything else (an unknown or missing name, a shape that is not tp 1's, a split that does not divide)
is a ValueError naming the tensor.
"""
from __future__ import annotations

import numpy as np

from ddtree.builder.experts import EXPERT_TENSORS
from ddtree.builder.plan import TPPlan, make_plan
from ddtree.builder.weights import Experts, file_plan, file_specs

GATE_UP_ROWS = 16       # intermediate rows per step of gate_up's dim 1 (one pair of fused 16-row tiles)
DOWN_COLS = 64          # intermediate columns per step of down's dim 2 (one k chunk)
EXPERT_AXES = {         # plan.experts -> stacked expert tensor suffix -> the axis rank slices cut
    "tp": {"gate_up.words": 1, "gate_up.scales": 1, "down.words": 2, "down.scales": 2},
    "ep": {suffix: 0 for suffix in EXPERT_TENSORS.values()},
}


def take(a, axis: int, rank: int, tp: int, name: str = "tensor") -> np.ndarray:
    """Chunk `rank` of `tp` equal contiguous chunks of a along `axis` (basic slicing, then contiguous)."""
    n = a.shape[axis]
    if n % tp:
        raise ValueError(f"{name}: dim {axis} of {list(a.shape)} is not divisible by tp {tp}")
    step = n // tp
    return np.ascontiguousarray(a[(slice(None),) * axis + (slice(rank * step, (rank + 1) * step),)])


def split_axes(plan: TPPlan) -> dict[str, int | None]:
    """Every rank tensor name of the plan -> the axis its rank slices are cut along (None: replicated)."""
    I = plan.cfg.moe_intermediate_size
    if plan.experts == "tp" and I % (plan.tp * DOWN_COLS):       # GATE_UP_ROWS divides DOWN_COLS
        raise ValueError(
            f"model.layers.*.mlp.experts.*: experts='tp' over tp {plan.tp} gives I_r = "
            f"{I} / {plan.tp} = {I / plan.tp:g}, expected a multiple of {DOWN_COLS} (the kernel layout slices "
            f"gate_up in steps of {GATE_UP_ROWS} intermediate rows, down in steps of {DOWN_COLS} columns)")
    axes = {}
    for _, entries in file_plan(plan):
        for e in entries:
            if isinstance(e, Experts):
                for name in e.specs:
                    axes[name] = EXPERT_AXES[plan.experts][name.split(".mlp.experts.")[1]]
            else:
                axes[e.name] = e.axis
    return axes


def reslice_rank(tensors: dict, plan: TPPlan, rank: int) -> dict[str, np.ndarray]:
    """A tp 1 engine's rank-0 tensors -> rank `rank`'s tensors of `plan` (same names, bit-equal to the
    builder's rank<rank>/*.safetensors for that plan). Replicated numpy inputs come back as views of them."""
    if not 0 <= rank < plan.tp:
        raise ValueError(f"rank {rank}: the plan has ranks 0..{plan.tp - 1}")
    axes = split_axes(plan)
    one = make_plan(plan.cfg, plan.dcfg, 1, plan.experts)
    full = {name: spec for _, entries in file_plan(one) for name, spec in file_specs(entries).items()}
    unknown = sorted(set(tensors) - set(axes))
    missing = sorted(set(axes) - set(tensors))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a tensor of the tp {plan.tp} plan "
                         f"({len(unknown)} unknown name(s): {', '.join(unknown[:4])})")
    if missing:
        raise ValueError(f"{missing[0]}: the tp {plan.tp} plan needs it, the tp 1 tensors lack it "
                         f"({len(missing)} missing: {', '.join(missing[:4])})")
    out = {}
    for name, axis in axes.items():
        a = tensors[name]
        if tuple(a.shape) != tuple(full[name].shape):
            raise ValueError(f"{name}: expected the tp 1 shape {list(full[name].shape)}, got {list(a.shape)}")
        out[name] = np.ascontiguousarray(a[...]) if axis is None else take(a, axis, rank, plan.tp, name)
    return out
