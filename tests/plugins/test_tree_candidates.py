"""CPU tests of the tree build's candidate table (plugins/tree_candidates.py) and its numpy twin.

The table's need(r) is checked against a brute-force count of the nodes that precede r in every table, its
contents against a brute-force enumeration, and the twin of the kernel's selection (the B largest keys of a
prefix of the table) against build_tree, the best-first spec, bit for bit over random tables with exact ties."""
import itertools
import re

import numpy as np
import pytest
import tree_cases as tc

import ddtree.plugins.compile as kc
from ddtree.plugins import tree_candidates as tcand
from ddtree.tree.build import build_tree


def all_tuples(K: int, D: int):
    for d in range(1, D + 1):
        yield from itertools.product(range(K), repeat=d)


def dominating(r: tuple, K: int, D: int) -> int:
    """Tuples s of any depth <= D that come no later than r whatever the (descending) table: s a prefix-length
    j <= len(r) tuple with s_i <= r_i. Brute force over every tuple."""
    return sum(1 for s in all_tuples(K, D) if len(s) <= len(r) and all(a <= b for a, b in zip(s, r)))


@pytest.mark.parametrize("B,D", [(10, 3), (20, 2), (6, 4)])
def test_table_is_every_tuple_with_need_at_most_the_budget(B, D):
    packed, meta, need = tcand.candidate_table(B, D)
    got = {tcand.unpack_tuple(w): int(n) for w, n in zip(packed, need)}
    want = {}
    for r in all_tuples(B, D):
        n = dominating(r, B, D)
        if n <= B:
            want[r] = n
    assert got == want
    assert (np.diff(need) >= 0).all()                                  # sorted by need: every budget is a prefix
    lex = (meta >> 16).astype(np.int64)
    assert sorted(got) == [tcand.unpack_tuple(packed[i]) for i in np.argsort(lex)]   # lex = the tuple order
    for w, m in zip(packed, meta):                                      # parent: the prefix, or the root
        r, p = tcand.unpack_tuple(w), int(m) & 0xFFFF
        assert (p == tcand.ROOT) if len(r) == 1 else tcand.unpack_tuple(packed[p]) == r[:-1]
    for b in range(1, B + 1):
        n = tcand.candidates_for(B, D, b)
        assert n == sum(v <= b for v in want.values())


def test_cap_is_the_largest_budget_that_fits():
    for D, cap in [(1, 255), (2, 255), (3, 255), (4, 159), (7, 64), (8, 55)]:
        assert tcand.candidate_cap(255, D) == cap
        assert len(tcand.candidate_table(cap, D)[0]) <= tcand.MAX_CANDIDATES
        if cap < 255:
            assert tcand._count(cap + 1, D, tcand.MAX_CANDIDATES) > tcand.MAX_CANDIDATES
    assert tcand.candidate_cap(255, 9) == 0 and tcand.candidate_cap(16, 7) == 16
    assert len(tcand.candidate_table(64, 7)[0]) == 6005 and tcand.candidates_for(64, 7, 16) == 285
    with pytest.raises(ValueError, match="6144"):
        tcand.candidate_table(65, 7)


def test_twin_is_build_tree_bit_for_bit():
    """Random tables (smooth, exact quarter ties, all equal, -inf tails), K below and at the budget, depth
    1..8, each budget from its own table and from the largest one (as a builder of max budget 255 reads it)."""
    rng = np.random.default_rng(3)
    ties = 0
    for i in range(240):
        D = int(rng.choice([1, 2, 3, 5, 7, 7, 8]))
        B = min(int(rng.choice([1, 2, 5, 16, 33, 64, 200])), tcand.candidate_cap(255, D))
        K = int(min(255, max(1, B if rng.random() < 0.6 else rng.integers(1, 40))))
        logp, ids = tc.table(rng, D, K, 163840, ["smooth", "quarter", "flat", "inf"][i % 4])
        ref = build_tree(7, logp, ids, B)
        ties += len(ref.scores) - len(np.unique(ref.scores))
        for cap in (None, tcand.candidate_cap(255, D)):
            got = tcand.candidate_tree(7, logp, ids, B, cap)
            what = f"case {i}: D {D} K {K} B {B} cap {cap}"
            np.testing.assert_array_equal(got.tokens, ref.tokens, err_msg=what)
            np.testing.assert_array_equal(got.parents, ref.parents, err_msg=what)
            np.testing.assert_array_equal(got.depth, ref.depth, err_msg=what)
            np.testing.assert_array_equal(got.scores.view(np.uint32), ref.scores.view(np.uint32), err_msg=what)
            assert got.ranks == ref.ranks, what
    assert ties > 200, "the cases must contain exactly tied path scores"


def test_kernel_constants_are_the_tables():
    text = (kc.KERNEL_DIR / "tree_build.cu").read_text()
    d = {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)\b", text, re.M)}
    assert d["TB_THREADS"] * d["TB_CAND_ITEMS"] == tcand.MAX_CANDIDATES
    assert d["TB_CAND_MAX_DEPTH"] == tcand.MAX_DEPTH
    assert tcand.MAX_CANDIDATES < 1 << 13                 # index and lex rank: 13-bit fields of the key's low word


def test_builder_reads_a_prefix_or_pops():
    from ddtree.plugins.tree_build import CandidateTable

    class Uploads:
        def upload(self, a):
            return a
    t = CandidateTable(Uploads(), depth=7, max_budget=255)
    assert t.cap == 64 and t.entries(16) == 285 and t.entries(64) == 6005 and t.entries(65) == 0
    assert CandidateTable(Uploads(), depth=9, max_budget=255).entries(4) == 0          # past depth 8: the pops
    assert CandidateTable(Uploads(), depth=7, max_budget=0).entries(4) == 0            # candidates=False
    planned = CandidateTable(Uploads(), depth=7, max_budget=255, min_budget=24)        # candidates=None
    assert planned.entries(23) == 0 and planned.entries(24) == tcand.candidates_for(64, 7, 24) > 0
    assert CandidateTable(Uploads(), depth=7, max_budget=16, min_budget=24).tuple is None   # never used: not uploaded
