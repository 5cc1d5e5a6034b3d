"""The GPU MoE op at small-mla's dims (hidden 512, moe_intermediate 512, 8 experts, top-2) with its real, unbiased
random router (`ddtree synth --preset small-mla --seed 24`): each MoE layer of a CudaExecutor prefill is checked
against its float64 twins on the GPU's own inputs, so varied expert choice is covered at those dims.

  (a) routing: route_logits (model/routing.py) on the GPU's own fp32 router logits picks the GPU's experts and
      weights, except on rows whose top-k margin is at fp32 rounding level (ROUND); the router logits
      themselves are the float64 product of the GPU's bf16 input and the bf16 router (fp32 accumulation).
  (b) experts: plugins/reference.moe_given_routing with the GPU's ids / weights, the same bf16 input and the
      GPU's shared-expert output gives the GPU's MoE output within bf16 tolerance (the kernel tests' rule).
  (c) the end-to-end question (issue 19): the GPU's logits differ from the float64 EngineExecutor's on this
      engine because of routing near-ties. At the first MoE layer where the GPU picks another expert set
      than the float64 executor for some row, every such row's float64 margin is below ROUTE_TIE (the
      other test file's bound on a score's error); before it the two routings are identical.
H200 (issue 19's open question, an 80-row prefill): (a) exact on every row of the 3 MoE layers (router logits
within 1e-6 of float64, min top-2 margin 4e-4, 7-8 experts used, 13-18 distinct sets per layer); (b) relative
error 2.2e-3, bf16 level; (c) the first layer where the GPU and float64 routings part has 3 of 80 rows flipped,
at float64 margins 6e-4, 3e-4, 1.3e-3 (17 of 80 rows lie within 0.02). So the unbiased engine's end-to-end
logit difference is routing near-ties carried to later rows by attention, no kernel or op bug.
"""
import numpy as np
import pytest

from ddtree.backends.numpy_backend import NumpyOps
from ddtree.builder.build import build_engine
from ddtree.description.opset import ACC
from ddtree.model.bf16 import bf16_to_f32
from ddtree.model.routing import route_logits
from ddtree.plugins import reference
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import causal_visible

pytestmark = pytest.mark.gpu
ROUND = 1e-5                 # a top-k margin at fp32 rounding level of scores ~0.5 (ulp 6e-8), with room
ROUTE_TIE = 0.02             # as tests/runtime/test_cuda_executor_gpu.py
PROMPT = [256] + list(b"def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n")


@pytest.fixture(scope="module")
def unbiased(tmp_path_factory):
    """(EngineExecutor, eager CudaExecutor, the rank's stored tensors) of the unbiased small-mla engine."""
    from ddtree.engine_dir import STORED, check_engine, load_rank_tensors
    from ddtree.model.presets import get_preset
    from ddtree.model.synthetic import random_blocks, write_drafter, write_target
    from ddtree.runtime.cuda_executor import CudaExecutor
    root = tmp_path_factory.mktemp("small-mla-unbiased")
    cfg, dcfg = get_preset("small-mla", None)
    dirs = (write_target(root / "target", cfg, random_blocks(24, cfg), "k2.6", 64),
            write_drafter(root / "drafter", dcfg, random_blocks(25, dcfg)))
    engine = build_engine(*dirs, 1, ["sm_90"], root / "engine", graphs=False)["engine"]
    meta, _ = check_engine(engine, True)
    return (EngineExecutor(engine), CudaExecutor(engine, max_context=256, graphs=False),
            load_rank_tensors(engine, 0, meta["weight_files"], convert=STORED))


def gpu_moe_calls(gex, ids):
    """Prefill ids on the GPU; per MoE call: x, router / bias / expert names, the FusedMoE's router logits,
    ids and weights, the shared expert's and the op's outputs (all as the host sees them)."""
    from ddtree.backends.cuda_backend import CudaOps
    calls, moe = [], CudaOps.moe

    def recording(self, x, router, bias, experts, shared, spec):
        out = moe(self, x, router, bias, experts, shared, spec)
        fused, M = self.kernels[("moe", router.name)], x.shape[0]
        calls.append(dict(x=self.host(x), router=router.name, bias=bias.name, spec=spec,
                          experts={k: experts[v].name for k, v in (("gate_up", "gate_up.words"),
                          ("gate_up_scale", "gate_up.scales"), ("down", "down.words"), ("down_scale", "down.scales"))},
                          logits=fused.logits.numpy()[:M], ids=fused.topk_ids.numpy()[:M],
                          w=fused.topk_w.numpy()[:M], shared=self.host(self.swiglu_mlp(x, *shared)),
                          out=self.host(out)))
        return out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CudaOps, "moe", recording)
        gex.target_forward(ids, np.arange(len(ids)), causal_visible(0, len(ids)), gex.new_target_cache())
    return calls


def ref_routing(ref, ids):
    """The float64 executor's expert sets [q, k] (sorted) and top-k margins [q] per MoE layer."""
    routed, moe = [], NumpyOps.moe

    def recording(self, x, router, bias, experts, shared, spec):
        logits = np.asarray(self.linear(x, router, out=ACC), np.float64)
        e, _, margin = route_logits(logits, np.asarray(bias), spec.topk, spec.n_group, spec.topk_group)
        routed.append((np.sort(e, axis=1), margin))
        return moe(self, x, router, bias, experts, shared, spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NumpyOps, "moe", recording)
        ref.target_forward(ids, np.arange(len(ids)), causal_visible(0, len(ids)), ref.new_target_cache())
    return routed


def test_gpu_moe_layers_match_route_logits_and_the_expert_twin(unbiased):
    ref, gex, host = unbiased
    ids = np.array(PROMPT)
    calls = gpu_moe_calls(gex, ids)
    assert len(calls) == ref.config.num_hidden_layers - ref.config.first_k_dense_replace
    for L, c in enumerate(calls):
        s = c["spec"]
        x, bias = c["x"], host[c["bias"]]
        # router logits: the GPU's fp32 GEMM of the same bf16 input
        logits_ref = reference.gemm(x, host[c["router"]])                 # [q, E] float64
        err = np.abs(c["logits"] - logits_ref).max()
        assert err <= 1e-5 * np.abs(logits_ref).max() + 1e-6, f"MoE call {L}: router logits off by {err}"
        # (a) the routing rule on the GPU's own logits
        e_ref, w_ref, margin = route_logits(c["logits"].astype(np.float64), bias, s.topk, s.n_group, s.topk_group,
                                            s.routed_scaling_factor)
        decided = margin > ROUND
        gpu_sets, ref_sets = np.sort(c["ids"], axis=1), np.sort(e_ref, axis=1)
        wrong = decided & (gpu_sets != ref_sets).any(axis=1)
        assert not wrong.any(), f"MoE call {L}: rows {np.flatnonzero(wrong)} route {c['ids'][wrong]} vs {e_ref[wrong]}"
        order_g, order_r = np.argsort(c["ids"], axis=1), np.argsort(e_ref, axis=1)
        np.testing.assert_allclose(np.take_along_axis(c["w"], order_g, 1)[decided],
                                   np.take_along_axis(w_ref, order_r, 1)[decided], rtol=1e-5)
        used = np.unique(c["ids"])
        # (b) the experts on the GPU's routing, the same bf16 input and shared output
        y_ref = reference.moe_given_routing(x, c["ids"], c["w"].astype(np.float64),
                                            {k: host[n] for k, n in c["experts"].items()}, shared=c["shared"])
        y = bf16_to_f32(c["out"]).astype(np.float64)
        rms = np.sqrt(np.mean(y_ref ** 2))
        rel = np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)
        excess = np.abs(y - y_ref) - (4e-3 * np.abs(y_ref) + 2e-2 * rms)
        print(f"MoE call {L}: {len(x)} rows, experts used {used.tolist()}, {len(np.unique(gpu_sets, axis=0))} "
              f"distinct sets, router logits err {err:.2e}, {int((~decided).sum())} rows at rounding-level "
              f"margin (min margin {margin.min():.2e}); experts vs twin: rel {rel:.2e}, max |d| "
              f"{np.abs(y - y_ref).max():.3e} (rms {rms:.3f})")
        assert len(used) >= s.experts - 2, f"MoE call {L}: only experts {used} chosen (want varied routing)"
        assert rel <= 1e-2 and excess.max() <= 0, f"MoE call {L}: experts vs twin rel {rel:.3e}"


def test_gpu_and_float64_routing_differ_only_at_near_ties(unbiased):
    """(c): the first MoE layer where the two executors' expert sets differ differs only at float64 near-ties."""
    ref, gex, _ = unbiased
    ids = np.array(PROMPT)
    calls, routed = gpu_moe_calls(gex, ids), ref_routing(ref, ids)
    for L, (c, (ref_sets, margin)) in enumerate(zip(calls, routed)):
        differ = (np.sort(c["ids"], axis=1) != ref_sets).any(axis=1)
        print(f"MoE call {L}: {int(differ.sum())} of {len(differ)} rows pick other experts than float64; their "
              f"float64 margins {np.round(margin[differ], 5).tolist()}; rows with margin < {ROUTE_TIE}: "
              f"{int((margin < ROUTE_TIE).sum())}")
        if differ.any():
            assert (margin[differ] < ROUTE_TIE).all(), f"MoE call {L}: a routing flip at a decided row"
            return                                   # later layers see the flipped rows through attention
    print("the GPU routes every row of every MoE layer as the float64 executor does")
