"""CudaExecutor (runtime/cuda_executor.py: the layer functions through the cuda backend) against EngineExecutor's
float64 logits on a tp 1 engine of ddtree/data/tiny: prefill, a tree-shaped verify, a compaction, the drafter,
and greedy autoregressive decoding.

Tolerance. The GPU rounds every op's output to bf16 (relative 2^-9 = 0.2 %) and accumulates in fp32; the
weights are bf16 on both sides (the float64 executor converts them exactly), so the whole difference is the
activations' rounding: some 25 roundings per layer, each a relative 2^-9 on a [q, 128] vector, accumulated
over 4 target layers (3 drafter layers), give an error of order sqrt(100) 2^-9 ~ 2 % of the hidden state's
scale, which the final norm and lm_head carry into the logits. So the bound is on the logits' scale:
max |gpu - ref| <= REL * max |ref| per call with REL = 0.04 (2x that estimate; a wrong op, a wrong rope, a
missing residual or a mis-strided view moves logits by their own scale, 25x the bound).
A near-tie is a step whose float64 logits' top-2 margin is below TIE = 2 REL max|ref| (two logits can swap
only when they are within twice the error bound); the AR test allows the GPU token to differ from the float64
argmax only there, and reports how many such steps it saw.
"""
import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.model.bf16 import bf16_to_f32
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import ar_steps, causal_visible, run_to_end
from ddtree.tree.sampling import SamplingParams

pytestmark = pytest.mark.gpu
REL = 0.04
PROMPTS = ([256, 17, 99, 3, 140, 77, 12], [256, 400, 401, 402, 5], [256] + list(range(30, 60, 3)))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from importlib.resources import files
    from ddtree.runtime.cuda_executor import CudaExecutor
    tiny = files("ddtree") / "data" / "tiny"
    out = tmp_path_factory.mktemp("tiny-tp1") / "engine"
    engine = build_engine(tiny / "target", tiny / "drafter", 1, ["sm_90"], out, graphs=False)["engine"]
    return EngineExecutor(engine), CudaExecutor(engine, max_context=256)


def close(gpu, ref, what):
    err, scale = np.abs(gpu - ref).max(), np.abs(ref).max()
    print(f"{what}: max |gpu - ref| {err:.4f} = {err / scale:.4f} of max |ref| {scale:.3f}")
    assert gpu.shape == ref.shape and np.isfinite(gpu).all()
    assert err <= REL * scale, f"{what}: {err} > {REL} x {scale}"


def tree_mask(parents, T):
    """visible [n, T + n]: the prefix, then each node's ancestors and itself."""
    n = len(parents)
    vis = np.zeros((n, T + n), bool)
    vis[:, :T] = True
    for i, p in enumerate(parents):
        vis[i, T + i] = True
        if p >= 0:
            vis[i, T:] |= vis[p, T:]
    return vis


def test_target_prefill_verify_compact(engines):
    ref, gex = engines
    prompt = np.array(PROMPTS[0])
    rc, gc = ref.new_target_cache(), gex.new_target_cache()
    lr, _ = ref.target_forward(prompt, np.arange(len(prompt)), causal_visible(0, len(prompt)), rc)
    lg, _ = gex.target_forward(prompt, np.arange(len(prompt)), causal_visible(0, len(prompt)), gc)
    close(lg, lr, "prefill")
    T, parents = len(prompt), [-1, 0, 0, 1, 1, 2]                      # a tree: root, two children, ...
    depth = [0, 1, 1, 2, 2, 2]
    ids, pos, vis = np.array([5, 9, 33, 41, 7, 300]), T + np.array(depth), tree_mask(parents, T)
    lr, _ = ref.target_forward(ids, pos, vis, rc)
    lg, _ = gex.target_forward(ids, pos, vis, gc)
    close(lg, lr, "tree verify")
    for L in range(ref.config.num_hidden_layers):                      # the cache rows the verify wrote
        er, eg = rc.layers[0][L][: T + 6], gex.ops.host(gc.layer(L))[: T + 6]
        close(bf16_to_f32(eg).astype(np.float64), er, f"cache layer {L}")
    keep = [0, 2, 5]                                                   # path root -> 2 -> 5
    ref.compact(rc, T, keep)
    gex.compact(gc, T, keep)
    nxt = np.array([11])
    lr, _ = ref.target_forward(nxt, np.array([T + 3]), causal_visible(T + 3, 1), rc)
    lg, _ = gex.target_forward(nxt, np.array([T + 3]), causal_visible(T + 3, 1), gc)
    close(lg, lr, "after compaction")
    allocations = len(gex.gpu._allocs)                                 # same shapes again: the arena is reused
    lr, _ = ref.target_forward(np.array([12]), np.array([T + 4]), causal_visible(T + 4, 1), rc)
    lg, _ = gex.target_forward(np.array([12]), np.array([T + 4]), causal_visible(T + 4, 1), gc)
    close(lg, lr, "a second decode step")
    assert len(gex.gpu._allocs) == allocations, "a call with the shapes of the last one allocated device memory"


def test_drafter_forward(engines):
    ref, gex = engines
    d = ref.drafter_config
    taps = tuple(d.target_layer_ids)
    prompt = np.array(PROMPTS[2])
    _, tapped = ref.target_forward(prompt, np.arange(len(prompt)), causal_visible(0, len(prompt)),
                                   ref.new_target_cache(), taps)
    ctx = np.concatenate([tapped[L] for L in taps], axis=1)
    rc, gc = ref.new_drafter_cache(), gex.new_drafter_cache()
    b = d.block_size
    for step, (n0, n1) in enumerate(((0, len(prompt) - 3), (len(prompt) - 3, len(prompt)))):
        block = np.array([17 + step] + [d.mask_token_id] * (b - 1))
        pos = n1 + np.arange(b)
        lr = ref.drafter_forward(block, pos, ctx[n0:n1], rc)
        lg = gex.drafter_forward(block, pos, ctx[n0:n1], gc)
        close(lg, lr, f"drafter step {step}")


def test_greedy_ar_matches_float64_except_near_ties(engines):
    ref, gex = engines
    params, ties, total = SamplingParams(), 0, 0
    for prompt in PROMPTS:
        gpu_tokens = run_to_end(ar_steps(gex, prompt, 12, params))
        seq = np.array(list(prompt) + gpu_tokens)
        logits, _ = ref.target_forward(seq, np.arange(len(seq)), causal_visible(0, len(seq)), ref.new_target_cache())
        for i, tok in enumerate(gpu_tokens):                            # row len(prompt) - 1 + i predicts token i
            row = logits[len(prompt) - 1 + i]
            best = int(np.argmax(row))
            total += 1
            if tok != best:
                margin, tie = row[best] - row[tok], 2 * REL * np.abs(row).max()
                assert margin < tie, f"prompt {prompt}, token {i}: GPU {tok} vs float64 {best}, margin {margin} >= {tie}"
                ties += 1
    print(f"greedy AR: {total - ties} of {total} GPU tokens are the float64 argmax; {ties} near-ties")
