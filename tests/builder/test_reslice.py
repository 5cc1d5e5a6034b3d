"""builder/reslice.py: rank r of a tp N plan cut from a tp 1 engine's tensors equals, bit for bit, what
the builder writes for rank r of a tp N engine; the expert slicing rule agrees with repacking the
INT4 slice of a random expert (plugins/layout.py); bad input names the tensor."""
from dataclasses import replace

import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.builder.experts import EXPERT_TENSORS
from ddtree.builder.plan import TPPlan, make_plan
from ddtree.builder.reslice import EXPERT_AXES, reslice_rank, take
from ddtree.data import tiny_model_dirs
from ddtree.engine_dir import STORED, engine_configs, load_rank_tensors, read_engine_config
from ddtree.model.int4 import pack_int4
from ddtree.plugins import layout


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(tp, experts) -> (plan, [rank tensors as stored]) of the embedded tiny model, built on demand."""
    root, built = tmp_path_factory.mktemp("reslice"), {}

    def get(tp: int, experts: str = "tp"):
        if (tp, experts) not in built:
            engine = build_engine(*tiny_model_dirs(), tp, ["sm_90"], root / f"tp{tp}-{experts}", graphs=False,
                                  experts=experts)["engine"]
            meta = read_engine_config(engine)
            plan = make_plan(*engine_configs(engine, meta), tp, experts)
            built[tp, experts] = plan, [load_rank_tensors(engine, r, meta["weight_files"], convert=STORED)
                                        for r in range(tp)]
        return built[tp, experts]
    return get


@pytest.mark.parametrize("tp,experts", [(2, "tp"), (4, "tp"), (2, "ep"), (4, "ep")])
def test_matches_the_builder_bitwise(engines, tp, experts):
    _, (full,) = engines(1)
    plan, ranks = engines(tp, experts)
    split = 0
    for r, want in enumerate(ranks):
        got = reslice_rank(full, plan, r)
        assert sorted(got) == sorted(want)
        for name, a in want.items():
            b = got[name]
            assert (b.dtype, b.shape) == (a.dtype, a.shape), name
            assert b.tobytes() == a.tobytes(), f"{name} (rank {r} of tp {tp}, experts={experts})"
            split += a.shape != full[name].shape
    stacks = [n for n in full if ".mlp.experts." in n]
    assert stacks and split >= len(stacks) * tp          # the routed experts (and more) really are cut


def random_expert(rng, H, I):
    """(gate, up, down) compressed-tensors triples and their int4 values [I, H], [I, H], [H, I]."""
    q = [rng.integers(-8, 8, size=s).astype(np.int8) for s in ((I, H), (I, H), (H, I))]
    s = [rng.integers(0x3c00, 0x3f80, size=(a.shape[0], a.shape[1] // layout.GROUP)).astype(np.uint16) for a in q]
    return q, s


def triple(q, s):
    return pack_int4(q), s, np.array(q.shape, dtype=np.int32)


@pytest.mark.parametrize("H,I,tp", [(128, 256, 2), (128, 256, 4), (192, 512, 4), (64, 512, 2)])
def test_slice_of_repack_is_repack_of_slice(H, I, tp):
    """The full experts repacked then cut by EXPERT_AXES == the INT4 slice of each expert repacked."""
    rng = np.random.default_rng(H + I + tp)
    experts = [random_expert(rng, H, I) for _ in range(4)]
    full = layout.repack_experts([tuple(triple(q, s) for q, s in zip(*e)) for e in experts])
    Ir = I // tp
    for r in range(tp):
        rows, grp = slice(r * Ir, (r + 1) * Ir), slice(r * Ir // layout.GROUP, (r + 1) * Ir // layout.GROUP)
        sliced = [(triple(q[0][rows], s[0][rows]), triple(q[1][rows], s[1][rows]), triple(q[2][:, rows], s[2][:, grp]))
                  for q, s in experts]
        want = layout.repack_experts(sliced)
        for key, suffix in EXPERT_TENSORS.items():
            got = take(full[key], EXPERT_AXES["tp"][suffix], r, tp)
            np.testing.assert_array_equal(got, want[key], err_msg=f"{key} rank {r}")
    for r in range(2):                                    # experts="ep": whole experts
        want = layout.repack_experts([tuple(triple(q, s) for q, s in zip(*e)) for e in experts[2 * r: 2 * r + 2]])
        for key, suffix in EXPERT_TENSORS.items():
            np.testing.assert_array_equal(take(full[key], EXPERT_AXES["ep"][suffix], r, 2), want[key])


def test_bad_input_names_the_tensor(engines):
    _, (full,) = engines(1)
    plan, _ = engines(2)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    with pytest.raises(ValueError, match=rf"{name}: expected the tp 1 shape \[\d+, \d+\], got"):
        reslice_rank({**full, name: full[name][:-2]}, plan, 0)
    stack = "model.layers.2.mlp.experts.down.words"
    with pytest.raises(ValueError, match=rf"{stack}: expected the tp 1 shape"):
        reslice_rank({**full, stack: full[stack][:, :, :1]}, plan, 1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.bogus\.weight: not a tensor of the tp 2 plan"):
        reslice_rank({**full, "model.layers.0.mlp.bogus.weight": full[name]}, plan, 0)
    drafter = "drafter.fc.weight"
    with pytest.raises(ValueError, match=rf"{drafter}: the tp 2 plan needs it"):
        reslice_rank({k: v for k, v in full.items() if k != drafter}, plan, 0)
    with pytest.raises(ValueError, match="rank 2: the plan has ranks 0..1"):
        reslice_rank(full, plan, 2)
    small = TPPlan(replace(plan.cfg, moe_intermediate_size=128), plan.dcfg, 4)   # I_r = 32: not a 64-chunk
    with pytest.raises(ValueError, match=r"model\.layers\.\*\.mlp\.experts\.\*: .* I_r = 128 / 4 = 32"):
        reslice_rank(full, small, 0)


def test_resliced_ranks_in_memory_compute_the_tp1_logits(engines):
    """EngineExecutor.of_weights (ranks as threads over tensors in memory) on the tp 4 slices of the tp 1 tensors:
    the float64 logits of a prefill and a tree verify equal tp 1's up to summation order."""
    from ddtree.reference.model import causal_visible
    from ddtree.runtime.engine_executor import EngineExecutor
    plan1, (full,) = engines(1)
    plan4, _ = engines(4)
    cfg, dcfg = plan1.cfg, plan1.dcfg
    tp1 = EngineExecutor.of_weights(cfg, dcfg, plan1.to_dict(), [{k: np.asarray(v) for k, v in full.items()}])
    tp4 = EngineExecutor.of_weights(cfg, dcfg, plan4.to_dict(), [reslice_rank(full, plan4, r) for r in range(4)])
    ids, vis = np.array([256, 17, 99, 3, 140]), causal_visible(0, 5)
    tree_vis = np.ones((3, 8), bool)
    tree_vis[1, 7] = tree_vis[2, 6] = False                   # nodes 1 and 2 both children of node 0
    out = []
    for ex in (tp1, tp4):
        cache = ex.new_target_cache()
        a, _ = ex.target_forward(ids, np.arange(5), vis, cache)
        b, _ = ex.target_forward([7, 8, 9], [5, 6, 6], tree_vis, cache)
        out.append(np.concatenate([a, b]))
    assert np.abs(out[0]).max() > 0.1
    np.testing.assert_allclose(out[1], out[0], rtol=0, atol=1e-9 * np.abs(out[0]).max())
