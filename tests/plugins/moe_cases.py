"""MoE test cases at the real per-rank shapes, shared by the fixture builder and the GPU tests.

Weights and activations come from ddtree.plugins.randfill streams (bit-identical on CPU and GPU), so
the GPU test fills them on the device and compares against references computed here once and stored
in tests/fixtures/plugins/moe_<case>.npz (regenerate: python tests/plugins/moe_cases.py).
Tokens are independent, so the M-token test uses the first M rows of the 256-token reference.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ddtree.plugins import randfill

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plugins"
SCALING = 2.827
TOKENS, TOPK = 256, 8
CASES = {
    # per-rank shapes: hidden 7168; TP8 intermediate 256, TP1 intermediate 2048 (fewer experts than
    # 384 to keep the reference cheap; with 256 tokens x top-8 most experts get several 8-slot tiles)
    "tp8": dict(experts=64, hidden=7168, inter=256, seed=8),
    "tp1": dict(experts=16, hidden=7168, inter=2048, seed=1),
}


def tensor_specs(experts: int, hidden: int, inter: int, seed: int) -> dict:
    """name -> (shape, dtype, stream seed, randfill preset), in the kernel layout."""
    E, H, I = experts, hidden, inter
    return {
        "gate_up": ((E, I // 16, H // 64, 2, 32, 4), np.int32, 16 * seed + 0, randfill.INT4_WORDS),
        "gate_up_scale": ((E, I // 16, H // 64, 2, 8, 4), np.uint16, 16 * seed + 1, randfill.SCALES_BF16),
        "down": ((E, H // 32, I // 64, 2, 32, 4), np.int32, 16 * seed + 2, randfill.INT4_WORDS),
        "down_scale": ((E, H // 32, I // 64, 2, 8, 4), np.uint16, 16 * seed + 3, randfill.SCALES_BF16),
        "x": ((TOKENS, H), np.uint16, 16 * seed + 4, randfill.ACT_BF16),
        "shared": ((TOKENS, H), np.uint16, 16 * seed + 5, randfill.ACT_BF16),
    }


def routing(experts: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform random distinct top-8 ids per token and positive weights summing to SCALING."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(experts)[:TOPK] for _ in range(TOKENS)]).astype(np.int32)
    w = rng.uniform(0.2, 1.0, size=(TOKENS, TOPK))
    w = (w / w.sum(axis=1, keepdims=True) * SCALING).astype(np.float32)
    return ids, w


def build(name: str) -> None:
    from ddtree.plugins.reference import moe_given_routing
    case = CASES[name]
    specs = tensor_specs(case["experts"], case["hidden"], case["inter"], case["seed"])
    arrays = {k: randfill.hash_array(shape, dt, s, preset) for k, (shape, dt, s, preset) in specs.items()}
    ids, w = routing(case["experts"], case["seed"])
    y = moe_given_routing(arrays["x"], ids, w.astype(np.float64), arrays)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(FIXTURES / f"moe_{name}.npz", ids=ids, weights=w, y_ref=y.astype(np.float16),
                        y_rms=np.sqrt(np.mean(y ** 2)))
    print(f"{name}: y rms {np.sqrt(np.mean(y ** 2)):.4f}, max {np.abs(y).max():.3f}")


if __name__ == "__main__":
    for case_name in CASES:
        build(case_name)


def random_experts(rng, E: int, H: int, I: int, std: float):
    """E experts of (gate [I, H], up [I, H], down [H, I]) as compressed-tensors triples (packed int4 words,
    scales, shape), for layout.repack_experts: a small checkpoint-format expert set."""
    from ddtree.model.int4 import pack_int4, quantize_int4
    experts = []
    for _ in range(E):
        triple = []
        for shp in ((I, H), (I, H), (H, I)):
            q, s = quantize_int4(rng.standard_normal(shp).astype(np.float32) * std)
            triple.append((pack_int4(q), s, np.array(shp, np.int32)))
        experts.append(tuple(triple))
    return experts


def route_only_weights(gpu, E: int, H: int) -> dict:
    """Expert buffers of the right shapes for FusedMoE(inter 64) whose route() never reads them."""
    return {"gate_up": gpu.alloc((E, 4, H // 64, 2, 32, 4), np.int32),
            "gate_up_scale": gpu.alloc((E, 4, H // 64, 2, 8, 4), np.uint16),
            "down": gpu.alloc((E, H // 32, 1, 2, 32, 4), np.int32),
            "down_scale": gpu.alloc((E, H // 32, 1, 2, 8, 4), np.uint16)}
