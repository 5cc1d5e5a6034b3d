"""GPU tests of the persistent GEMM chain (kernels/gemm_chain.cu) against its numpy twin: every op's output, given
the kernel's own bf16 input rows, within fp32-sum rounding of the float64 product (a misplaced tile, a lost chunk
or a stale x is O(1) off); the same bits on every graph replay (the counters reset themselves, the split-K sums
run in a fixed order); ragged N, K < the source's N, independent ops and 1..24 rows; rings filled by cp.async and
by bulk copies."""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import gemm_chain as gc
from ddtree.plugins import layout

pytestmark = pytest.mark.gpu
CHAINS = {
    # one tp-8 rank's dense layer (bench/chain.py), K < N_src for o_proj and shared_down
    "kimi_tp8": [gc.ChainGemm(1536, 7168, gc.INPUT), gc.ChainGemm(576, 7168, gc.INPUT), gc.ChainGemm(1536, 1536, 0),
                 gc.ChainGemm(7168, 1024, 2), gc.ChainGemm(512, 7168, 3), gc.ChainGemm(7168, 256, 4)],
    # ragged N (not a multiple of 16 or of a tile group), a diamond (op 3 after ops 1 and 2 through op 2)
    "ragged": [gc.ChainGemm(200, 512, gc.INPUT), gc.ChainGemm(72, 192, 0), gc.ChainGemm(1000, 128, 0),
               gc.ChainGemm(24, 960, 2)],
}


@pytest.fixture(scope="module", params=[(name, bulk) for name in sorted(CHAINS) for bulk in (False, True)],
                ids=lambda p: f"{p[0]}-{'bulk' if p[1] else 'cp.async'}")
def case(gpu, request):
    name, bulk = request.param
    ops = CHAINS[name]
    rng = np.random.default_rng(sorted(CHAINS).index(name))
    x = f32_to_bf16(rng.standard_normal((24, ops[0].K)).astype(np.float32))
    ws = [f32_to_bf16((rng.standard_normal((o.N, o.K)) / np.sqrt(o.K)).astype(np.float32)) for o in ops]
    chain = gc.GemmChain(gpu, ops, bulk=bulk)
    dx, dws = gpu.upload(x), [gpu.upload(layout.tile_bf16(w)) for w in ws]
    chain.bind(dx, dws)
    return {"name": f"{name} bulk={bulk}", "ops": ops, "x": x, "ws": ws, "chain": chain, "keep": (dx, dws)}


def op_inputs(c, outs, M):
    return [c["x"][:M] if o.src == gc.INPUT else outs[o.src] for o in c["ops"]]


@pytest.mark.parametrize("M", [1, 9, 17, 24])
def test_each_op_matches_the_twin_on_its_own_inputs(gpu, case, M):
    chain = case["chain"]
    chain.run(M)
    gpu.sync()
    chain.check()
    outs = [gpu.download(o)[:M] for o in chain.outs]
    for i, (o, xi, w, got) in enumerate(zip(case["ops"], op_inputs(case, outs, M), case["ws"], outs)):
        want = gc.reference_chain(xi[:, :o.K], [w], [gc.ChainGemm(o.N, o.K, gc.INPUT)])[0]
        g, r = bf16_to_f32(got).astype(np.float64), bf16_to_f32(want).astype(np.float64)
        rms = np.sqrt(np.mean(r * r))
        bad = np.abs(g - r) > 2 ** -7 * np.abs(r) + 1e-3 * rms
        assert not bad.any(), f"{case['name']} op {i} M={M}: {bad.sum()} of {bad.size} off, first at " \
                              f"{np.argwhere(bad)[0]}: {g[bad][0]} vs {r[bad][0]}"


def test_graph_replays_give_the_same_bits(gpu, case):
    chain, M = case["chain"], 17
    graph = gpu.capture(lambda s: [chain.run(M, stream=s) for _ in range(3)])
    results = []
    for _ in range(3):
        for o in chain.outs:
            gpu.memset(o, 0)
        gpu.replay(graph)
        gpu.sync()
        chain.check()
        results.append([gpu.download(o)[:M].copy() for o in chain.outs])
    assert int(gpu.download(chain.done).max()) == 0 and int(gpu.download(chain.exits)[0]) == 0
    for later in results[1:]:
        for a, b in zip(results[0], later):
            np.testing.assert_array_equal(a, b)
