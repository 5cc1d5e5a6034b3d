"""CPU tests of the tree pruning kernel (kernels/tree_prune.cu, plugins/tree_prune.py): it compiles for sm_90 and
sm_120 with the pip NVRTC, takes the horizon as a scalar argument after n_experts, its limits match the twin's
module (tree/prune.py) and the launcher refuses shapes and horizons past them by name. The kernel against its twin on a GPU: tests/plugins/test_tree_prune_gpu.py."""
import re
from pathlib import Path

import pytest

from ddtree.plugins import compile as kc
from ddtree.plugins import tree_prune as tp
from ddtree.tree import prune

SOURCE = Path(kc.KERNEL_DIR) / tp.SOURCE


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_kernel_compiles(arch):
    blob = kc.compile_cubin(tp.SOURCE, arch).read_bytes()
    assert blob[:4] == b"\x7fELF" and tp.KERNEL.encode() in blob


def test_limits_match_the_twin_and_the_launcher():
    defines = {m[0]: int(m[1]) for m in re.findall(r"#define (\w+) (\d+)", SOURCE.read_text())}
    assert (defines["TP_MAX_NODES"], defines["TP_MAX_EXPERTS"], defines["TP_THREADS"]) == \
        (prune.MAX_NODES, prune.MAX_EXPERTS, tp.THREADS)
    assert tp.reference is prune.prune_nodes
    with pytest.raises(prune.PruneError, match="n_experts"):
        tp.TreePrune(None, top_k=8, n_experts=prune.MAX_EXPERTS + 1)
    with pytest.raises(prune.PruneError, match="top_k"):
        tp.TreePrune(None, top_k=prune.MAX_TOPK + 1, n_experts=8)
    launcher = object.__new__(tp.TreePrune)                      # no GPU: run() checks before it launches
    for bad in (-1, prune.MAX_HORIZON + 1, 2.0):
        with pytest.raises(prune.PruneError, match="horizon"):
            launcher.run(0, 0, 0, 0, 0, 0, 0, 5, bad)


def test_kernel_takes_the_horizon_as_a_scalar_argument():
    src = SOURCE.read_text()
    signature = re.search(r"tree_prune\((.*?)\)\s*\{", src, re.S).group(1)
    assert [a.split()[-1] for a in signature.split(",")][-4:] == ["q", "top_k", "n_experts", "horizon"]
    assert "(long long)expert_bytes[0] * (long long)horizon" in src          # the int64 product, as the twin's
    assert f"0 <= horizon <= {prune.MAX_HORIZON}" in src


def preorder_marginal(live, parents, ids, n_experts):
    """The kernel's way to the subtree-marginal counts, step for step in python: preorder blocks (a child the block
    after its elder siblings'), each expert's users' min / max preorder index, its lca the first ancestor of the min's
    node whose block holds the max, then +1 on the lca and every ancestor."""
    q = len(parents)
    alive = [i == 0 or bool(live[i]) for i in range(q)]
    size = [1] * q
    for i in range(q - 1, 0, -1):
        size[parents[i]] += size[i]
    pre, at, nxt = [0] * q, [0] * q, [1] * q
    for i in range(1, q):
        p = parents[i]
        pre[i], nxt[p] = pre[p] + nxt[p], nxt[p] + size[i]
        at[pre[i]] = i
    lo, hi = [q] * n_experts, [-1] * n_experts
    for i in range(q):
        for e in ids[i]:
            if alive[i] and 0 <= e < n_experts:
                lo[e], hi[e] = min(lo[e], pre[i]), max(hi[e], pre[i])
    marginal = [0] * q
    for e in range(n_experts):
        if hi[e] < 0:
            continue
        j = at[lo[e]]
        while hi[e] >= pre[j] + size[j]:
            j = parents[j]
        while j >= 0:
            marginal[j] += 1
            j = parents[j]
    return marginal


def test_the_kernels_preorder_lca_counts_what_the_twin_counts():
    """tree_prune.cu finds each expert's lca from its users' preorder range (integer atomics; the twin climbs from
    pairs of users): its counts equal the rule's definition by sets (experts used inside subtree(i) and by no live
    node outside) on the shared random cases (chains, bushy trees, dead subtrees). The launches themselves against
    the twin: tests/plugins/test_tree_prune_gpu.py."""
    import numpy as np

    from tests.tree.prune_cases import cases
    for case, bytes_, rate, horizon in cases(seed=3, n=60):
        if rate not in (0.0, 1e-3):
            continue
        E = 64
        got = preorder_marginal(case["live"], case["parents"], case["routed_ids"], E)
        live = np.asarray(case["live"]) != 0
        live[0] = True
        want = []                                        # by sets: experts used inside subtree(i) and nowhere else
        for i in range(len(live)):
            inside = [j for j in range(len(live)) if live[j] and _on_path(case["parents"], j, i)]
            outside = set(case["routed_ids"][[j for j in range(len(live)) if live[j] and j not in inside]].ravel())
            want.append(len(set(case["routed_ids"][inside].ravel()) - outside) if live[i] else got[i])
        assert got == want, case


def _on_path(parents, j, i) -> bool:
    while j >= 0:
        if j == i:
            return True
        j = int(parents[j])
    return False
