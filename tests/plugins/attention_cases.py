"""Tree-attention test cases, shared by the fixture builder and the GPU tests.

Every input is bit-reproducible on any machine: the prefix cache is a ddtree.plugins.randfill stream
(filled on the device, recomputed here), queries, tree entries and tree shapes come from hash words
and exact float32 arithmetic. References for the 65536-key cases are computed here once and stored in
tests/fixtures/plugins/attention_<case>.npz (regenerate: python tests/plugins/attention_cases.py) with a
digest of the inputs; smaller cases are computed in the test.

Shaping: prefix scores have a standard deviation near 1; every tree entry carries a common direction u
that the queries share, lifting tree scores by about ln(T + 1) nats, so the tree keys hold roughly
as much attention mass as the whole prefix. A wrong mask, a wrong split boundary or a lost merge then
moves the output by O(1), far above the tolerance, at any context.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.presets import get_preset
from ddtree.plugins import randfill

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plugins"
SCALE = get_preset("kimi-k2.6", layers=2)[0].softmax_scale    # 192^-1/2 x YaRN mscale^2 = 0.14468
CONTEXTS = (1, 100, 4096, 65536)
QS = (1, 8, 33, 65, 256)
CASES = [(T, q, 8) for T in CONTEXTS for q in QS] + [(4096, 1, 64), (4096, 33, 64), (100, 65, 64), (65536, 1, 64)]
FIXTURE_CONTEXT = 65536            # cases at this context carry their reference as a fixture
QUERY_SCALE = np.float32(0.25)     # prefix score std near 1 at the Kimi scale
COMMON = np.float32(0.2)          # the queries' share of the common direction u


def case_name(T: int, q: int, heads: int) -> str:
    return f"T{T}_q{q}_h{heads}"


def case_seed(T: int, q: int, heads: int) -> int:
    return (T * 7919 + q * 131 + heads) & 0xFFFFFF


def _unit_floats(n: int, seed: int) -> np.ndarray:
    """n float32 values in [0, 1) from hash words."""
    return (randfill.hash_u32(n, seed) >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


def random_tree(q: int, seed: int) -> np.ndarray:
    """parents [q] int32 (root -1, parents[i] < i): half chain steps, half uniform earlier nodes."""
    words = randfill.hash_u32(2 * q, seed)
    parents = np.full(q, -1, dtype=np.int32)
    for i in range(1, q):
        parents[i] = i - 1 if words[2 * i] & 1 else int(words[2 * i + 1] % i)
    return parents


def visibility(parents: np.ndarray) -> np.ndarray:
    """[q, q] bool ancestor-or-self matrix -> packed words via ddtree.tree.build (the format's owner)."""
    from ddtree.tree.build import pack_visibility
    q = len(parents)
    vis = np.zeros((q, q), dtype=bool)
    for i in range(q):
        if parents[i] >= 0:
            vis[i] = vis[parents[i]]
        vis[i, i] = True
    return pack_visibility(vis)


def prefix_spec(T: int, q: int, seed: int) -> tuple[tuple, int]:
    """(shape, stream seed) of the device-filled cache: T + q rows (tree rows overwritten by the append)."""
    return (T + q, 576), 4 * seed + 1


def inputs(T: int, q: int, heads: int) -> dict[str, np.ndarray]:
    """Host inputs of one case (bf16 bits): q_lat [q, H, 512], q_rope [q, H, 64], tree entries
    c_kv [q, 512] and k_pe [q, 64], parents, vis words."""
    seed = case_seed(T, q, heads)
    u = bf16_to_f32(randfill.hash_array((576,), np.uint16, 4 * seed + 2, randfill.ACT_BF16))
    base_q = bf16_to_f32(randfill.hash_array((q, heads, 576), np.uint16, 4 * seed + 3, randfill.ACT_BF16))
    base_k = bf16_to_f32(randfill.hash_array((q, 576), np.uint16, 4 * seed + 4, randfill.ACT_BF16))
    lift = np.float32(math.log(T + 1))
    gamma = lift / (COMMON * np.float32(u @ u) * np.float32(SCALE))
    jitter = np.float32(0.75) + np.float32(0.5) * _unit_floats(q, 4 * seed + 5)[:, None]   # keys differ in weight
    query = f32_to_bf16(base_q * QUERY_SCALE + COMMON * u)
    entries = f32_to_bf16(base_k + (gamma * jitter) * u)
    parents = random_tree(q, 4 * seed + 6)
    return {"q_lat": query[..., :512].copy(), "q_rope": query[..., 512:].copy(), "c_kv": entries[:, :512].copy(),
            "k_pe": entries[:, 512:].copy(), "parents": parents, "vis": visibility(parents)}


def full_cache(T: int, q: int, heads: int, case: dict) -> np.ndarray:
    """The cache the kernel sees after the append: prefix stream rows, then the tree entries."""
    shape, stream = prefix_spec(T, q, case_seed(T, q, heads))
    cache = randfill.hash_array(shape, np.uint16, stream, randfill.ACT_BF16).copy()
    cache[T:, :512] = case["c_kv"]
    cache[T:, 512:] = case["k_pe"]
    return cache


def digest(case: dict) -> str:
    h = hashlib.sha256()
    for key in ("q_lat", "q_rope", "c_kv", "k_pe", "vis"):
        h.update(np.ascontiguousarray(case[key]).tobytes())
    return h.hexdigest()[:16]


def reference(T: int, q: int, heads: int, case: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(out [q, H, 512] fp32, lse [q, H]): the fixture when there is one for these inputs, else computed."""
    from ddtree.plugins.reference import mla_tree_attention
    case = inputs(T, q, heads) if case is None else case
    path = FIXTURES / f"attention_{case_name(T, q, heads)}.npz"
    if path.exists():
        fx = np.load(path)
        if str(fx["digest"]) == digest(case):
            return fx["out"].astype(np.float32), fx["lse"]
    return mla_tree_attention(case["q_lat"], case["q_rope"], full_cache(T, q, heads, case), T, case["vis"], SCALE)


def build() -> None:
    from ddtree.plugins.reference import mla_tree_attention
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for T, q, heads in CASES:
        if T != FIXTURE_CONTEXT:
            continue
        case = inputs(T, q, heads)
        out, lse = mla_tree_attention(case["q_lat"], case["q_rope"], full_cache(T, q, heads, case), T, case["vis"], SCALE)
        np.savez_compressed(FIXTURES / f"attention_{case_name(T, q, heads)}.npz", out=out.astype(np.float16),
                            lse=lse.astype(np.float32), digest=np.array(digest(case)))
        print(f"{case_name(T, q, heads)}: out rms {np.sqrt(np.mean(out.astype(np.float64) ** 2)):.4f}")


if __name__ == "__main__":
    build()
