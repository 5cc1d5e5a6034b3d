"""The GPU steps as captured CUDA graphs (runtime/cuda_step.py) on the embedded tiny model's tp 1 engine:
DDTree == AR on the held-out prompts except at derived near-ties, every committed token the sampling
definition at its node, back-to-back requests with other seeds, budget changes, and the step-state kernels
against their numpy twins.

The near-tie rule is runtime/near_tie.py's (derived, not chosen): at the first departure, AR's and DDTree's
tokens' logits are measured on the verify (the step's row counts: the block, budget + 1) and one-token decode
paths by teacher-forcing the AR tokens; the departure is a near-tie when their margin there is within the sum of
their own verify-vs-decode differences (/ T sampled, on z + g; kept sets as measured on each path).
"""
import numpy as np
import pytest

from ddtree.runtime.loop import ar_steps, ddtree_steps, run_to_end
from ddtree.runtime.near_tie import classify_departure, describe, path_differences
from ddtree.tree.build import Tree
from ddtree.tree.sampling import SamplingParams, sample
from ddtree.tree.walk import accept_walk

pytestmark = pytest.mark.gpu
N = 64                                   # new tokens per prompt
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_gpu import tiny_gpu_executor
    return tiny_gpu_executor(tmp_path_factory, "tiny-step")


def test_verify_and_decode_paths_differ_by_rounding(tiny):
    """The whole-row logit differences between the verify and decode paths over the prompts' AR sequences (a
    diagnostic since the near-tie rule reads only the departure's candidates: runtime/near_tie.py)."""
    ex, prompts = tiny
    per_position = []
    for ids in prompts:
        per_position.extend(path_differences(ex, ids, run_to_end(ar_steps(ex, ids, N, GREEDY))))
    per_position = np.array(per_position)
    d = float(per_position.max())
    print(f"delta (verify vs decode, teacher-forced, {len(prompts)} prompts x {N} tokens x 2 row counts): max "
          f"{d:.3e}; median {np.median(per_position):.3e}, 99th percentile {np.percentile(per_position, 99):.3e}")
    # bf16 order effects are small at most positions; the rare large ones are MoE routing near-ties (the tiny
    # model's random router): a wrong verify path would move the median to the logits' own scale (~10)
    assert 0 < np.median(per_position) < 0.1


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ddtree_graph_equals_ar_graph_except_near_ties(tiny, params):
    ex, prompts = tiny
    total, departures, ties = 0, 0, 0
    for ids in prompts:
        ar = run_to_end(ar_steps(ex, ids, N, params))
        for budget in (1, 4, 16, 64):
            before = ex.steps.graph_steps
            dd = run_to_end(ddtree_steps(ex, ids, N, params, budget))
            assert len(dd) == len(ar) == N
            assert ex.steps.graph_steps > before and ("ddtree", budget, 8, ex.steps.plan.mode) in ex.steps.graphs
            total += N
            if dd == ar:
                continue
            v = classify_departure(ex, ids, ar, dd, params, rows=(8, budget + 1))
            departures += 1
            print(f"budget {budget}: {describe(v)}")
            assert v["near_tie"], f"budget {budget}: DDTree left AR: {describe(v)}"
            ties += 1
    rate = ties / total
    print(f"{params}: {departures} departures in {total} tokens, all near-ties; rate {rate:.4%}")
    assert rate < 0.01
    print("step stats:", ex.steps.stats())


def test_every_committed_token_is_the_sampling_definition(tiny):
    """A few graph steps of two back-to-back requests with other seeds and of budgets 4 -> 16 -> 4: on the
    downloaded verify logits, the host sampler gives every node's target token, and the host walk the
    accepted path and bonus the graph committed (a stale seed or a wrong graph would differ)."""
    ex, prompts = tiny
    checked = 0
    ex.steps.pipeline = False                # last_verify must see the step just read, not the one after it
    for params, budget in ((SamplingParams(temperature=0.9, seed=1), 4), (SamplingParams(temperature=0.9, seed=2), 16),
                           (SamplingParams(temperature=0.7, top_k=20, seed=3), 4), (GREEDY, 16)):
        steps = ddtree_steps(ex, prompts[0], 200, params, budget)
        next(steps)                                                   # the prefill's token
        for _ in range(3):
            committed = next(steps)
            v = ex.steps.last_verify()
            n = budget + 1
            assert len(v["tokens"]) == n
            target = sample(v["logits"], v["positions"] + 1, params)
            assert (target == v["target"]).all(), f"{params} budget {budget}: sampler differs from the definition"
            tree = Tree(v["tokens"], v["parents"], np.zeros(n, np.int32), [()] * n, np.zeros(n, np.float32))
            walk = accept_walk(tree, target)
            assert v["count"] == len(walk.accepted) and v["bonus"] == walk.bonus
            expect = [int(t) for t in v["tokens"][walk.accepted[1:]]] + [walk.bonus]
            assert committed == expect                   # no EOS given and 200 tokens: no step is cut
            checked += 1
        steps.close()
    ex.steps.pipeline = True
    assert checked == 12


def test_step_state_kernels_match_their_twins(tiny):
    from ddtree.plugins import step_state as ss
    ex, _ = tiny
    g = ex.gpu
    rng = np.random.default_rng(0)
    st = ss.StepState(g, max_tokens=8)
    st.set(start=40, bonus=123)
    ids, pos, dlen = g.alloc((8,), np.int32), g.alloc((8,), np.int32), g.alloc((1,), np.int32)
    tlen = g.alloc((1,), np.int32)
    st.prologue(8, 259, 8, ids, pos, dlen, tlen)
    want = ss.prologue_ref(np.array([40, 123, 0, 0]), 8, 259, 8)
    assert (ids.numpy() == want["block_ids"]).all() and (pos.numpy() == want["block_pos"]).all()
    assert int(dlen.numpy()[0]) == want["draft_len"] and int(tlen.numpy()[0]) == want["target_len"]
    window = rng.integers(0, 60000, (8, 64), dtype=np.uint16)
    taps = rng.integers(0, 60000, (17, 64), dtype=np.uint16)
    for count in (1, 3, 8):
        accepted = np.full(17, -1, np.int32)
        accepted[:count] = np.sort(rng.choice(np.arange(1, 17), count, replace=False))
        accepted[0] = 0
        out = g.alloc((8, 64), np.uint16)
        st.ctx_window(g.upload(window), g.upload(taps), g.upload(accepted), g.upload(np.array([count], np.int32)), out,
                      8, 128)
        assert (out.numpy() == ss.ctx_window_ref(window, taps, accepted, count)).all()
        tokens = rng.integers(0, 500, 17).astype(np.int32)
        state = np.array([*st.read(), st.steps, 0], np.int32)
        st.commit(g.upload(tokens), g.upload(accepted), g.upload(np.array([count], np.int32)),
                  g.upload(np.array([77], np.int32)))
        g.sync()
        want_tokens, after = ss.commit_ref(state, tokens, accepted, count, 77)
        rec = st.record(st.steps + 1)
        st.steps += 1
        assert rec["tokens"] == want_tokens and rec["count"] == count and rec["start"] == after[0]
        assert st.read() == (int(after[0]), 77)
    for a in (1, 3, 6, 17):                              # bench step --accept: the first-child chain
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, 17)], np.int32)
        accepted, count = g.upload(np.full(17, -1, np.int32)), g.zeros(1, np.int32)
        st.force_accept(g.upload(parents), 17, a, accepted, count)
        want = ss.force_accept_ref(parents, a)
        assert int(count.numpy()[0]) == len(want) and accepted.numpy()[: len(want)].tolist() == want
    src = rng.integers(0, 60000, (5, 64), dtype=np.uint16)
    dst = g.upload(np.zeros((20, 64), np.uint16))
    base = g.upload(np.array([9], np.int32))
    ex.ops.k.rows_at(dst, 20, base, g.upload(src), 5, 64)
    p = g.alloc((5,), np.int32)
    ex.ops.k.positions_from(base, p, 5)
    want = np.zeros((20, 64), np.uint16)
    want[9:14] = src
    assert (dst.numpy() == want).all() and (p.numpy() == np.arange(9, 14)).all()


def test_auto_budget_on_the_gpu(tiny):
    """--budget auto through the step graphs: DDTree == AR except derived near-ties; with a hand-made cost
    table whose best rates lie in the middle (budget 16 far too slow), the choices are 4 and 8, each the
    brute-force best rate for the table the graph handed back; then `ddtree tune --device cuda` and a
    `ddtree run --budget auto --mode both` on its file."""
    import json

    from ddtree.runtime.loop import RunStats
    from ddtree.tree.budget import expected_accept_for_table
    from tests.cli.bad_input import ddtree
    from tests.runtime.test_auto_budget import BUDGETS as budgets
    from tests.runtime.test_auto_budget import Spy, hand_tuning
    ex, prompts = tiny
    times = (100.0, 110.0, 120.0, 5000.0)
    tuning = hand_tuning(times)
    for ids in prompts[:2]:
        chooser, stats = Spy(tuning), RunStats()
        before = ex.steps.graph_steps
        dd = run_to_end(ddtree_steps(ex, ids, N, GREEDY, chooser, stats=stats))
        ar = run_to_end(ar_steps(ex, ids, N, GREEDY))
        assert ex.steps.graph_steps > before
        v = classify_departure(ex, ids, ar, dd, GREEDY, rows=(8, *sorted({b + 1 for b in stats.budgets})))
        assert v is None or v["near_tie"], v
        assert set(stats.budgets) <= {1, 4, 8} and stats.budgets == chooser.chosen
        for table, b in zip(chooser.seen[1:], chooser.chosen[1:]):
            e = expected_accept_for_table(0, table, np.tile(np.arange(table.shape[1], dtype=np.int32),
                                                            (table.shape[0], 1)), 16)
            rates = {c: e[c] / t for c, t in zip(budgets, times)}
            assert rates[b] >= max(rates.values()) * (1 - 1e-9)
        print(f"auto budgets {stats.to_dict()['budget_per_step']}, mean acceptance {stats.to_dict()['mean_accept_len']:.2f}")
    engine = str(ex.engine_dir)
    r = ddtree(["tune", engine, "--device", "cuda", "--budget", "1,2,4,8,16,32,64", "--context", "128,512",
                "--prompts", "4", "--json"])
    assert r.returncode == 0, r.stderr
    print("ddtree tune (H200, tiny):", json.loads(r.stdout.strip().splitlines()[-1])["step_time_us"])
    r = ddtree(["run", "--model", engine, "--device", "cuda", "--budget", "auto", "--mode", "both",
                "--max-new-tokens", "96", "--json", "def fibonacci(n):"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print("ddtree run --budget auto:", out["stats"]["budget_per_step"], f"{out['stats']['tokens_per_s']:.0f} tok/s,",
          "identical" if out["identical"] else f"near-ties {out['stats'].get('near_ties')}")


def test_a_wider_table_builds_the_same_tree(tiny):
    """plugins/tree_build.py run(k=...): the best-first tree of B nodes never reaches rank B, so a table of
    k > B candidates per depth (--budget auto's) leaves the tree unchanged, and its first B columns are the
    narrow table."""
    from ddtree.plugins.tree_build import DraftTreeBuilder
    ex, _ = tiny
    g = ex.gpu
    logits = g.upload(np.random.default_rng(3).normal(0, 3, (7, 512)).astype(np.float32))
    root, start = g.upload(np.array([17], np.int32)), g.upload(np.array([40], np.int32))
    b = DraftTreeBuilder(g, vocab=512, depth=7)
    for budget in (1, 4, 16):
        narrow = b.run(logits, root, start, budget).numpy()
        wide = b.run(logits, root, start, budget, k=64).numpy()
        for name in ("tokens", "parents", "depth", "positions", "vis"):
            assert (narrow[name] == wide[name]).all(), (budget, name)
        assert (wide["table_logp"][:, :budget] == narrow["table_logp"]).all()


def test_parallel_branches_change_no_bit(tiny):
    """The branches (backends/cuda_branch.py: the shared expert beside the routed gate_up, or beside the router when
    asked, the kv path beside the query path, the L2 prefetch beside the attention, and the next layer's front
    beside the routed experts when asked) run the same kernels on the same inputs as the in-order launches without
    prefetch: an eager prefill's logits are bitwise equal, and the captured AR and DDTree graphs (recaptured without
    them, and with the main chain's nodes at a higher priority than the branches': ops.main_first) commit the same
    tokens. A join in the wrong place would let a kernel read an output not yet (or not at all) written."""
    from ddtree.runtime.loop import causal_visible
    ex, prompts = tiny
    assert ex.config.is_moe_layer(ex.config.num_hidden_layers - 1), "the tiny model's last layer is an MoE layer"
    ids = prompts[0][:40]

    def run():
        logits, _ = ex.target_forward(ids, np.arange(len(ids)), causal_visible(0, len(ids)), ex.new_target_cache())
        ar = run_to_end(ar_steps(ex, ids, 24, SAMPLED))
        dd = run_to_end(ddtree_steps(ex, ids, 24, SAMPLED, 16))
        return np.array(logits), ar, dd

    assert ex.ops.branches and ex.ops.prefetch_bytes > 0
    with_branches = run()
    budget = ex.ops.prefetch_bytes
    try:
        ex.ops.prefetch_next_beside = "experts"      # the next front held, then launched beside the routed experts
        ex.steps.graphs.clear()
        beside_experts = run()
        ex.ops.prefetch_next_beside = "collective"
        ex.ops.shared_fork, ex.ops.shared_join = "router", "experts"   # the shared expert beside the router
        ex.steps.graphs.clear()
        shared_router = run()
        ex.ops.shared_fork, ex.ops.shared_join = "routed", "down"
        ex.ops.main_first = True                     # the branches' nodes below the main chain's priority
        ex.steps.graphs.clear()
        main_first = run()
        ex.ops.main_first = False
        ex.ops.branches, ex.ops.prefetch_bytes = False, 0
        ex.steps.graphs.clear()                      # recapture every step graph without the branches
        in_order = run()
    finally:
        ex.ops.branches, ex.ops.prefetch_bytes, ex.ops.prefetch_next_beside = True, budget, "collective"
        ex.ops.shared_fork, ex.ops.shared_join, ex.ops.main_first = "routed", "down", False
        ex.steps.graphs.clear()
    for got in (with_branches, beside_experts, shared_router, main_first):
        assert got[0].view(np.uint32).tolist() == in_order[0].view(np.uint32).tolist()
        assert got[1] == in_order[1]
        assert got[2] == in_order[2]
