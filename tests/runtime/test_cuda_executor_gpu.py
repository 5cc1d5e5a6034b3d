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


def near_ties(ref, prompt, tokens) -> int:
    """Every greedy token is the float64 argmax after its prefix, or within TIE of it (a near-tie, counted)."""
    seq = np.array(list(prompt) + list(tokens))
    logits, _ = ref.target_forward(seq, np.arange(len(seq)), causal_visible(0, len(seq)), ref.new_target_cache())
    ties = 0
    for i, tok in enumerate(tokens):                                    # row len(prompt) - 1 + i predicts token i
        row = logits[len(prompt) - 1 + i]
        best = int(np.argmax(row))
        if tok != best:
            margin, tie = row[best] - row[tok], 2 * REL * np.abs(row).max()
            assert margin < tie, f"prompt {prompt}, token {i}: GPU {tok} vs float64 {best}, margin {margin} >= {tie}"
            ties += 1
    return ties


def test_greedy_ar_matches_float64_except_near_ties(engines):
    """The decode steps replay one captured graph (CudaExecutor graphs=True); an eager executor runs too."""
    import time
    from ddtree.runtime.cuda_executor import CudaExecutor
    ref, gex = engines
    eager = CudaExecutor(ref.engine_dir, max_context=256, graphs=False)
    for ex in (gex, eager):
        ties, total, t0 = 0, 0, time.perf_counter()
        for prompt in PROMPTS:
            tokens = run_to_end(ar_steps(ex, prompt, 24, SamplingParams()))
            ties, total = ties + near_ties(ref, prompt, tokens), total + len(tokens)
        graph = "captured" if ex.decode_graph is not None else "eager"
        print(f"greedy AR ({graph}): {total - ties} of {total} GPU tokens are the float64 argmax, {ties} near-ties")
    assert gex.decode_graph is not None and eager.decode_graph is None
    for ex in (gex, eager):                                             # decode speed, 64 steps after the prefill
        t0 = time.perf_counter()
        run_to_end(ar_steps(ex, PROMPTS[0], 65, SamplingParams()))
        print(f"AR decode ({'graph' if ex.graphs else 'eager'}): {64 / (time.perf_counter() - t0):.0f} tok/s")


def test_cli_runs_ar_on_the_gpu(engines):
    import json
    from tests.cli.bad_input import ddtree
    ref, gex = engines
    r = ddtree(["run", "--model", str(ref.engine_dir), "--device", "cuda", "--max-context", "256", "--mode", "ar",
                "--max-new-tokens", "16", "--json", "def fib(n):"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 16 or out["stats"]["finish_reason"] == "stop"
    from ddtree.model.tokenizer import load_tokenizer
    prompt = load_tokenizer(ref.tokenizer_dir, ref.config).encode("def fib(n):")
    print(f"ddtree run --device cuda --mode ar: {len(out['tokens'])} tokens, {near_ties(ref, prompt, out['tokens'])} "
          f"near-ties, {out['stats']['tokens_per_s']:.0f} tok/s; memory plan: {r.stderr.splitlines()[0]}")
    r = ddtree(["run", "--model", str(ref.engine_dir), "--device", "cuda", "--max-context", "256", "--mode", "both",
                "--max-new-tokens", "24", "--budget", "8", "--json", "def fib(n):"])
    print(f"--mode both on the GPU: rc {r.returncode}, {r.stderr.strip().splitlines()[-2:]}")
