"""runtime/near_tie.py on the CPU. The rule is checked as a formula on a made-up executor whose verify and decode
logits differ by chosen amounts (TwoPaths): a departure whose candidates move by more than their margin is a
near-tie, one where only other vocabulary entries moved is not (and was under the old whole-row rule), greedy and
sampled, the top-k kept set's edge included; on the float64 tiny model an injected wrong token is no near-tie.
Also: the margin of what the sampler ranks (by hand), first_difference, and --device cuda's default KV rows
(docs/interfaces.md 8)."""
import numpy as np
import pytest

from ddtree.runtime.near_tie import SLACK_ULPS, classify_departure, first_difference, margin, path_differences
from ddtree.runtime.run_cli import default_max_context
from ddtree.tree.sampling import SamplingParams, gumbel, kept_mask, sample

V, PROMPT, I, ROWS = 8, [0, 1, 2], 3, (2, 4)
Q = len(PROMPT) + I - 1          # the token position whose logits row picks AR's token I (in the 4-row call)
GREEDY = SamplingParams()


class TwoPaths:
    """A made-up executor: the row of token position q is base[q] [V] in the prefill and in one-token calls, and
    base[q] + shift[r][q] in a later call of r rows (the verify path)."""

    def __init__(self, base, shift=None):
        self.base, self.shift = base, shift or {}

    def new_target_cache(self, capacity=0, limit=None):
        return None

    def target_forward(self, ids, pos, visible, cache, taps=()):
        pos = np.asarray(pos)
        out = self.base[pos].copy()
        if len(ids) > 1 and pos[0] > 0 and len(ids) in self.shift:
            out += self.shift[len(ids)][pos]
        return out, {}


def made_up(row_at_q, moves: dict) -> TwoPaths:
    """Rows far from any tie everywhere but Q (row_at_q); moves {token: shift} at Q in the 4-row verify calls."""
    base = np.random.default_rng(0).normal(0, 1, (16, V))
    base[Q] = row_at_q
    shift = np.zeros((16, V))
    for tok, s in moves.items():
        shift[Q, tok] = s
    return TwoPaths(base, {4: shift})


def runs(a: int, d: int) -> tuple[list, list]:
    ar = [5, 6, 7, a, 1, 2]
    return ar, ar[:I] + [d] + ar[I + 1:]


@pytest.mark.parametrize("s", [0.006, 0.004])
def test_greedy_candidates_moving_past_their_margin(s):
    """a = 3 leads d = 4 by 0.01 on decode; the verify moves a down and d up by s: a near-tie iff 0.01 <= 2 s
    (+ the slack, 4 float32 ulps of |3.0|)."""
    row = np.full(V, -2.0)
    row[3], row[4] = 3.0, 2.99
    ex = made_up(row, {3: -s, 4: +s})
    v = classify_departure(ex, PROMPT, *runs(3, 4), GREEDY, ROWS)
    slack = SLACK_ULPS * float(np.spacing(np.float32(3.0)))
    assert v["index"] == I and v["candidates"] == (3, 4)
    assert v["logits"]["decode"] == (3.0, 2.99)
    assert v["logits"]["verify"] == {2: (3.0, 2.99), 4: (3.0 - s, 2.99 + s)}
    assert np.allclose(v["delta"], (s, s), rtol=0, atol=1e-15) and v["margin"] == 3.0 - 2.99
    assert np.isclose(v["bound"], 2 * s + slack, rtol=0, atol=1e-15) and v["rule"] == "margin"
    assert v["near_tie"] == (0.01 <= 2 * s) and np.isclose(v["delta_row"], s, rtol=0, atol=1e-15)


def test_only_other_tokens_moving_is_no_near_tie():
    """The verify moves token 6 by -5 and leaves the candidates alone: the old rule (top-2 margin below twice the
    whole-row delta, 5) called the departure a near-tie; the candidates' deltas are 0, so it is not one."""
    row = np.full(V, -2.0)
    row[3], row[4] = 3.0, 2.99
    ex = made_up(row, {6: -5.0})
    ar, dd = runs(3, 4)
    v = classify_departure(ex, PROMPT, ar, dd, GREEDY, ROWS)
    assert v["delta"] == (0.0, 0.0) and v["delta_row"] == 5.0 and not v["near_tie"]
    assert v["bound"] == SLACK_ULPS * float(np.spacing(np.float32(3.0)))
    old_delta = float(path_differences(ex, PROMPT, ar, rows=ROWS).max())
    assert old_delta == 5.0 and margin(row, len(PROMPT) + I, GREEDY) < 2 * old_delta       # the old rule: a tie


def test_the_decode_path_must_rank_ar_token_first():
    """Symmetric: AR's token 2 below d = 4 by 0.5 on decode, with no move that large, is no near-tie (the AR
    run did not take the decode path's token)."""
    row = np.full(V, -2.0)
    row[2], row[4] = 2.5, 3.0
    v = classify_departure(made_up(row, {2: 0.1}), PROMPT, *runs(2, 4), GREEDY, ROWS)
    assert v["margin"] == -0.5 and not v["near_tie"]


@pytest.mark.parametrize("e", [0.006, 0.004])
def test_sampled_scores_moving_past_their_margin(e):
    """T 0.5: scores z + g of a = 3 and d = 5 differ by 0.02 on decode; the verify moves their logits by -e and +e,
    so their scores by 2 e each: a near-tie iff 0.02 <= 4 e (+ slack / T)."""
    p = SamplingParams(temperature=0.5, seed=7)
    g = gumbel(7, len(PROMPT) + I, np.arange(V))
    want = np.full(V, -3.0)
    want[3], want[5] = 4.0, 3.98
    row = p.temperature * (want - g)                                  # l such that z + g = want
    v = classify_departure(made_up(row, {3: -e, 5: +e}), PROMPT, *runs(3, 5), p, ROWS)
    biggest = max(abs(row[3]), abs(row[5]), abs(row[3] - e), abs(row[5] + e))
    slack = SLACK_ULPS * float(np.spacing(np.float32(biggest))) / p.temperature
    assert np.isclose(v["margin"], 0.02, rtol=0, atol=1e-12)
    assert np.isclose(v["bound"], 4 * e + slack, rtol=0, atol=1e-12)
    assert v["near_tie"] == (0.02 <= 4 * e) and v["rule"] == "margin"
    assert int(sample(row[None], np.array([len(PROMPT) + I]), p)[0]) == 3                  # AR's token, by the definition


def top_k_edge(seed=11):
    """Top-k 2 at T 0.5: z(a) = 0 > z(c) = -D > z(d) = -D - eps on decode (kept: a, c; a outscores c) while d
    outscores a, and every other z is far below: (row, a, c, d, g). a, c, d: the smallest, second smallest and
    largest g, D between g(c) - g(a) and g(d) - g(a) - eps."""
    T, eps, q = 0.5, 1e-3, len(PROMPT) + I
    g = gumbel(seed, q, np.arange(V))
    order = np.argsort(g)
    a, c, d = int(order[0]), int(order[1]), int(order[-1])
    D = (g[c] - g[a] + g[d] - g[a] - eps) / 2
    z = np.full(V, -D - 10.0)
    z[a], z[c], z[d] = 0.0, -D, -D - eps
    return T * z, a, c, d, T, eps


def test_a_kept_set_flip_is_a_near_tie():
    """The verify lifts d by 2 eps past c: d enters the kept set, outscores a and is sampled there; the
    departure is a near-tie of the kept set though d's decode score is above a's (margin < 0)."""
    row, a, c, d, T, eps = top_k_edge()
    p = SamplingParams(temperature=T, top_k=2, seed=11)
    ex = made_up(row, {d: 2 * eps * T})
    q = len(PROMPT) + I
    assert int(sample(row[None], np.array([q]), p)[0]) == a                               # AR's, on decode
    lifted = row + ex.shift[4][Q]
    assert int(sample(lifted[None], np.array([q]), p)[0]) == d                            # DDTree's, on verify
    assert kept_mask(lifted[None] / T, 2, 1.0)[0].tolist() == [t in (a, d) for t in range(V)]
    v = classify_departure(ex, PROMPT, *runs(a, d), p, ROWS)
    assert v["kept"] == {"decode": (True, False), "verify": {2: (True, False), 4: (True, True)}}
    assert v["margin"] < 0 and v["rule"] == "kept set" and v["near_tie"]


def test_a_token_no_path_keeps_is_no_near_tie():
    """The same row without the lift (only a far token moves, by -5): d outscores a yet no path keeps it, so
    DDTree committing d is a bug, not a near-tie; the old rule (the kept top-2 margin under 2 x 5) hid it."""
    row, a, c, d, T, eps = top_k_edge()
    p = SamplingParams(temperature=T, top_k=2, seed=11)
    far = next(t for t in range(V) if t not in (a, c, d))
    v = classify_departure(made_up(row, {far: -5.0}), PROMPT, *runs(a, d), p, ROWS)
    assert v["kept"]["decode"] == (True, False) and all(k == (True, False) for k in v["kept"]["verify"].values())
    assert v["margin"] < 0 and not v["near_tie"] and v["delta"] == (0.0, 0.0)
    assert margin(row, len(PROMPT) + I, p) < 2 * v["delta_row"] / T                       # the old rule: a tie


@pytest.mark.parametrize("budget, stats", [(3, {}), ("auto", {"budget_per_step": {"1": 4, "3": 2}})])
def test_run_both_classifies_at_the_rows_it_verified(budget, stats, capsys):
    """ddtree-run --mode both's check (run_cli._near_ties) calls the rule with the block and the budgets' verify
    row counts (budget + 1; --budget auto: the budgets its steps chose) and prints the verdict."""
    from types import SimpleNamespace

    from ddtree.runtime.run_cli import _near_ties
    row = np.full(V, -2.0)
    row[3], row[4] = 3.0, 2.99
    ex, calls = made_up(row, {3: -0.006, 4: +0.006}), []
    forward = ex.target_forward
    ex.target_forward = lambda ids, *rest, **kw: calls.append(len(ids)) or forward(ids, *rest, **kw)
    engine = SimpleNamespace(processes=None, executor=ex, encode=lambda request: PROMPT,
                             drafter_config=SimpleNamespace(block_size=2))
    kw = {"block_size": None, "budget": budget, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    ar, dd = runs(3, 4)
    assert _near_ties(engine, "a prompt", ar, list(ar), kw, stats) == 0 and not calls
    assert _near_ties(engine, "a prompt", ar, dd, kw, stats) == 1
    assert {2, 4} <= set(calls) <= {1, 2, 3, 4}
    err = capsys.readouterr().err
    assert "AR 3 vs DDTree 4" in err and "4 rows 2.994 / 2.996" in err and err.strip().endswith("a near-tie (margin)")


def test_rows_are_checked():
    row = np.zeros(V)
    row[3] = 1.0
    ex = made_up(row, {})
    with pytest.raises(ValueError, match="at least one verify row count"):
        classify_departure(ex, PROMPT, *runs(3, 4), GREEDY, ())
    with pytest.raises(ValueError, match="row counts >= 1, got 0"):
        classify_departure(ex, PROMPT, *runs(3, 4), GREEDY, (0,))


def test_margin_greedy_and_sampled_by_hand():
    row = np.array([1.0, 3.0, 2.5, -1.0])
    assert margin(row, 7, SamplingParams()) == 0.5
    p = SamplingParams(temperature=0.5, seed=9)
    z = row / 0.5 + gumbel(9, 7, np.arange(4))
    top = np.sort(z)[-2:]
    assert np.isclose(margin(row, 7, p), top[1] - top[0], rtol=0, atol=1e-12)
    assert int(np.argmax(z)) == int(sample(row[None], np.array([7]), p)[0])      # the same scores the sampler ranks


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_an_injected_wrong_token_on_the_tiny_model_is_no_near_tie(params):
    """The float64 tiny model: AR's token 2 replaced by the runner-up of what the sampler ranks there (the
    hardest wrong token to tell from a tie) is no near-tie; the margin is the one a full forward gives."""
    from ddtree.data import tiny_model_dirs
    from ddtree.reference.drafter import Drafter
    from ddtree.reference.model import Target
    from ddtree.runtime.executor import NumpyExecutor
    from ddtree.runtime.loop import ar_steps, run_to_end
    target_dir, drafter_dir = tiny_model_dirs()
    target = Target.from_checkpoint(target_dir)
    ex = NumpyExecutor(target, Drafter.from_checkpoint(drafter_dir, target))
    prompt = [256, 100, 101, 102]
    ar = run_to_end(ar_steps(ex, prompt, 8, params))
    assert classify_departure(ex, prompt, ar, list(ar), params, (3, 5)) is None
    n = len(prompt) + 2
    logits, _ = ex.target_forward(np.array(prompt + ar[:2]), np.arange(n), np.tril(np.ones((n, n), bool)),
                                  ex.new_target_cache())
    z = logits[-1] / (params.temperature or 1.0) + (0 if params.greedy else gumbel(3, n, np.arange(len(logits[-1]))))
    z = np.where(kept_mask(logits[-1][None] / (params.temperature or 1.0), 0, params.top_p)[0], z, -np.inf)
    best, runner_up = np.argsort(z)[::-1][:2]
    assert best == ar[2] and z[best] - z[runner_up] > 1e-3, "test data: a clear argmax at token 2"
    v = classify_departure(ex, prompt, ar, ar[:2] + [int(runner_up)] + ar[3:], params, (3, 5))
    assert v["index"] == 2 and v["candidates"] == (ar[2], runner_up)
    assert np.isclose(v["margin"], z[best] - z[runner_up], rtol=0, atol=1e-9)
    assert max(v["delta"]) < 1e-9 and v["bound"] < 1e-4 and not v["near_tie"]


def test_default_max_context_rounds_the_request_up():
    assert default_max_context("abc", 100, 16, chat=False) == 256             # 3 + 1 + 100 + 16 + 1 = 121
    assert default_max_context("é" * 200, 100, 16, chat=False) == 768          # 400 bytes: 518 rows
    assert default_max_context("x", 1, 1, chat=True) == 512                    # 1 + 256 + 1 + 1 + 1 = 260


@pytest.mark.parametrize("a, b, want", [([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 5, 3], 1), ([4], [5], 0),
                                        ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1], 1), ([], [7], 0)])
def test_first_difference(a, b, want):
    assert first_difference(a, b) == first_difference(b, a) == want
