"""The context limit (docs/interfaces.md sections 1 and 6): prompt + new tokens <= max_position_embeddings.

On a synthetic tiny checkpoint whose config says 64 positions: a prompt of 64 tokens or more is a
PromptTooLongError naming both numbers before any forward; a huge max_new_tokens stops at the context
with finish reason "length", DDTree still equal to AR token for token (greedy and sampled, random and
oracle drafters), no forward ever feeds a position >= 64, and the caches never grow past the rows
the run can need (no preallocation to prompt + max_new_tokens). A step's accept length counts only
the tokens it committed. The CLI does the same as a user sees it."""
import json
import shutil

import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.data import TINY_DIR, tiny_model_dirs
from ddtree.reference.cache import LatentCache
from ddtree.reference.drafter import Drafter
from ddtree.reference.model import Target
from ddtree.runtime.caches import DraftCaches, TargetCaches
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.executor import NumpyExecutor
from ddtree.runtime.loop import PromptTooLongError, RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.training.evaluate import context_curve
from ddtree.tree.sampling import SamplingParams
from tests.cli.bad_input import ddtree, refuses

C = 64                                  # the context of the checkpoints below
HUGE = 10 ** 9
GREEDY = SamplingParams()
WARM = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=77)
BYTES_BOS = 256


def prompt(n: int) -> list[int]:
    return [BYTES_BOS] + [97 + i % 26 for i in range(n - 1)]


@pytest.fixture(scope="module")
def ctx_dirs(tiny_dirs, tmp_path_factory):
    """The runtime tests' tiny checkpoint (random drafters of block 4 and 8) with max_position_embeddings 64."""
    root = tmp_path_factory.mktemp("ctx64")
    target = shutil.copytree(tiny_dirs["target"], root / "target")
    cfg = json.loads((target / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = C
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"target": target, 4: tiny_dirs[4], 8: tiny_dirs[8]}


class Watch:
    """Wraps an executor: records every position fed to the target and the drafter, and the caches made."""

    def __init__(self, ex):
        self.ex, self.target_pos, self.drafter_pos, self.caches, self.trees = ex, [], [], [], []

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def new_target_cache(self, capacity=256, limit=None):
        self.caches.append(("target", limit, self.ex.new_target_cache(capacity, limit)))
        return self.caches[-1][2]

    def new_drafter_cache(self, capacity=0, limit=None):
        self.caches.append(("drafter", limit, self.ex.new_drafter_cache(capacity, limit)))
        return self.caches[-1][2]

    def target_forward(self, ids, pos, visible, cache, taps=()):
        self.target_pos += [int(p) for p in pos]
        return self.ex.target_forward(ids, pos, visible, cache, taps)

    def drafter_forward(self, block_ids, pos, ctx_taps, cache):
        self.drafter_pos += [int(p) for p in pos]
        self.start = int(pos[0])
        return self.ex.drafter_forward(block_ids, pos, ctx_taps, cache)

    def tree_build(self, root_token, draft_logits, budget):
        self.trees.append((self.start, len(draft_logits)))                     # (start, tree depth cap)
        return self.ex.tree_build(root_token, draft_logits, budget)


class OracleExecutor(NumpyExecutor):
    """The 'drafter' proposes the target's own continuation (docs/interfaces.md 6; as in
    test_ddtree_lossless), so every step accepts the whole block: the block cap near the end and a
    step cut mid-way are both exercised."""

    params = GREEDY

    def new_target_cache(self, capacity=256, limit=None):
        self.last_cache = super().new_target_cache(capacity, limit)
        return self.last_cache

    def drafter_forward(self, block_ids, pos, ctx_taps, cache):
        scratch = self.last_cache.copy()
        scratch.limit = None                         # a scratch continuation, not the run's cache
        token, p = int(block_ids[0]), int(pos[0])
        logits = np.zeros((len(block_ids) - 1, self.config.vocab_size))
        for k in range(len(block_ids) - 1):
            lg, _ = self.target.forward([token], [p], np.ones((1, scratch.length + 1), bool), scratch)
            token = int(self.sample(lg, np.array([p + 1]), self.params)[0])
            logits[k, token] = 12.0
            p += 1
        return logits


@pytest.fixture(scope="module")
def target64(ctx_dirs):
    t = Target.from_checkpoint(ctx_dirs["target"])
    assert t.config.max_position_embeddings == C
    return t


@pytest.fixture(scope="module")
def executors(ctx_dirs, target64):
    made = {}
    for b in (4, 8):
        d = Drafter.from_checkpoint(ctx_dirs[b], target64)
        made["random", b] = NumpyExecutor(target64, d)
        made["oracle", b] = OracleExecutor(target64, d)
    return made


def capacity(cache) -> int:
    return cache.capacity if hasattr(cache, "capacity") else cache.length        # reference DraftCache: exact


@pytest.mark.parametrize("drafter,block,budget,params,n_prompt", [
    ("random", 4, 16, GREEDY, 5), ("random", 8, 7, WARM, 20), ("oracle", 8, 16, GREEDY, 5),
    ("oracle", 4, 3, WARM, 33), ("oracle", 8, 64, GREEDY, 62), ("random", 8, 64, WARM, 63),
])
def test_huge_max_new_tokens_stops_at_the_context_and_ddtree_equals_ar(executors, drafter, block, budget, params,
                                                                       n_prompt):
    ex = executors[drafter, block]
    ex.params = params
    p = prompt(n_prompt)
    ar_stats, dd_stats = RunStats(), RunStats()
    ar_watch, dd_watch = Watch(ex), Watch(ex)
    want = run_to_end(ar_steps(ar_watch, p, HUGE, params, stats=ar_stats))
    got = run_to_end(ddtree_steps(dd_watch, p, HUGE, params, budget, stats=dd_stats))
    assert len(want) == C - n_prompt and got == want
    for stats in (ar_stats, dd_stats):
        assert stats.finish_reason == "length" and stats.to_dict()["finish_reason"] == "length"
        assert stats.new_tokens == C - n_prompt
    # no forward past the context: AR feeds up to the second-to-last token, DDTree's deepest node at C - 1
    assert max(ar_watch.target_pos) == C - 2
    assert max(dd_watch.target_pos) <= C - 1
    # caches sized by the context, not by max_new_tokens: a limit of the rows the run can need
    for kind, limit, cache in ar_watch.caches + dd_watch.caches:
        assert limit is not None and limit <= C + budget, (kind, limit)
        assert capacity(cache) <= limit
    # every tree may reach the full depth unless that would pass the context: then its deepest node is at C - 1
    assert all(depth == min(block - 1, C - 1 - start) for start, depth in dd_watch.trees), dd_watch.trees
    assert bool(dd_watch.trees) == (n_prompt < C - 1)          # one token left: the prefill's, no step
    if drafter == "oracle":       # every step accepts its whole path; the last one commits what the context holds
        want_acc = [min(depth + 1, C - 1 - start) for start, depth in dd_watch.trees]
        assert dd_stats.accept_lens == want_acc and 1 + sum(want_acc) == C - n_prompt


def test_max_new_tokens_below_the_context_is_kept(executors):
    ex = executors["oracle", 8]
    ex.params = GREEDY
    for n in (1, 2, 9, 10, 17):
        stats = RunStats()
        got = run_to_end(ddtree_steps(ex, prompt(5), n, GREEDY, 16, stats=stats))
        assert got == run_to_end(ar_steps(ex, prompt(5), n, GREEDY)) and len(got) == n
        assert stats.finish_reason == "length"
        # committed only: the prefill's token plus every step's accept length is exactly the output
        assert 1 + sum(stats.accept_lens) == stats.new_tokens == n
        assert len(stats.accept_lens) == stats.steps and all(1 <= a <= 8 for a in stats.accept_lens)


@pytest.mark.parametrize("params", [GREEDY, WARM], ids=["greedy", "t0.7"])
def test_accept_len_counts_only_committed_tokens_at_eos(executors, params):
    """An EOS in the middle of a fully accepted path cuts the step: the tokens after it are not counted."""
    ex = executors["oracle", 8]
    ex.params = params
    full = run_to_end(ar_steps(ex, prompt(5), 40, params))
    for cut in (3, 12, 21):                        # EOS at new token cut + 1 (its first occurrence)
        eos = full[cut]
        first = full.index(eos)
        stats = RunStats()
        got = run_to_end(ddtree_steps(ex, prompt(5), 40, params, 16, eos_ids=[eos], stats=stats))
        assert got == full[: first + 1]
        assert stats.finish_reason == "stop" and stats.to_dict()["finish_reason"] == "stop"
        assert 1 + sum(stats.accept_lens) == stats.new_tokens == first + 1
        d = stats.to_dict()
        assert d["mean_accept_len"] == pytest.approx((first) / max(stats.steps, 1))
        ar_stats = RunStats()
        run_to_end(ar_steps(ex, prompt(5), 40, params, eos_ids=[eos], stats=ar_stats))
        assert ar_stats.finish_reason == "stop" and 1 + sum(ar_stats.accept_lens) == ar_stats.new_tokens


@pytest.mark.parametrize("n_prompt", [C, C + 1, 500])
def test_prompt_too_long_is_named_before_any_forward(executors, n_prompt):
    watch = Watch(executors["random", 4])
    for steps in (ar_steps(watch, prompt(n_prompt), 8, GREEDY),
                  ddtree_steps(watch, prompt(n_prompt), 8, GREEDY, 16)):
        with pytest.raises(PromptTooLongError, match=f"prompt is {n_prompt} tokens.*context.* is {C} tokens"):
            next(steps)
    assert watch.target_pos == [] and watch.drafter_pos == [] and watch.caches == []


def test_prompt_one_below_the_context_gets_one_token(executors):
    ex = executors["random", 8]
    for steps in (ar_steps, ddtree_steps):
        stats = RunStats()
        args = (16,) if steps is ddtree_steps else ()
        out = run_to_end(steps(ex, prompt(C - 1), HUGE, GREEDY, *args, stats=stats))
        assert len(out) == 1 and stats.finish_reason == "length" and stats.steps == 0


def test_caches_grow_by_doubling_up_to_their_limit():
    for make, rows in ((lambda cap, lim: LatentCache(2, 4, 2, capacity=cap, limit=lim), None),
                       (lambda cap, lim: TargetCaches(2, 2, 6, cap, limit=lim), "reserve"),
                       (lambda cap, lim: DraftCaches(2, 2, 1, 4, cap, limit=lim), "reserve")):
        cache = make(8, 40)

        def grow(n):
            if rows:
                cache.reserve(n)
            else:
                cache.set_length(n)
        grow(9)
        assert cache.capacity == 16                  # doubled
        grow(17)
        assert cache.capacity == 32
        grow(33)
        assert cache.capacity == 40                  # doubled past 40 is clipped to the limit
        grow(40)
        assert cache.capacity == 40
        with pytest.raises(ValueError, match="41 rows asked for, past the cache's limit of 40"):
            grow(41)
        with pytest.raises(ValueError, match="capacity 50 is above its limit 40"):
            make(50, 40)
        unlimited = make(8, None)
        if rows:
            unlimited.reserve(1000)
        else:
            unlimited.set_length(1000)
        assert unlimited.capacity == 1000


@pytest.fixture(scope="module")
def engine64(ctx_dirs, tmp_path_factory):
    """A tp 2 engine (no graphs, no cubins: the CPU executors read none) built from the 64-position checkpoint with
    its block-4 drafter."""
    out = tmp_path_factory.mktemp("ctx-engine") / "engine"
    return build_engine(ctx_dirs["target"], ctx_dirs[4], 2, [], out, graphs=False, kernels=False)["engine"]


def test_engine_executor_stops_at_the_context_with_bounded_caches(engine64):
    ex = EngineExecutor(engine64)
    assert ex.config.max_position_embeddings == C
    ar_watch, dd_watch, stats = Watch(ex), Watch(ex), RunStats()
    want = run_to_end(ar_steps(ar_watch, prompt(37), HUGE, WARM))
    got = run_to_end(ddtree_steps(dd_watch, prompt(37), HUGE, WARM, 8, stats=stats))
    assert got == want and len(got) == C - 37 and stats.finish_reason == "length"
    assert max(dd_watch.target_pos) <= C - 1
    assert all(depth == min(3, C - 1 - start) for start, depth in dd_watch.trees), dd_watch.trees
    for kind, limit, cache in ar_watch.caches + dd_watch.caches:
        assert limit <= C + 8 and cache.capacity <= limit, (kind, limit, cache.capacity)


# --- as a user runs it ----------------------------------------------------------------------------------

def test_cli_prompt_too_long_names_both_numbers(ctx_dirs):
    refuses(["run", "--model", str(ctx_dirs["target"]), "--drafter", str(ctx_dirs[4]), "x" * C],
            "PromptTooLongError", f"prompt is {C} tokens", f"is {C} tokens", "max_position_embeddings")


@pytest.mark.parametrize("mode", ["both", "ar"])
def test_cli_huge_max_new_tokens_stops_at_the_context(ctx_dirs, mode):
    r = ddtree(["run", "--model", str(ctx_dirs["target"]), "--drafter", str(ctx_dirs[4]), "hello",
                "--max-new-tokens", str(HUGE), "--mode", mode, "--temperature", "0.8", "--json"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == out["stats"]["new_tokens"] == C - len(b"hello")
    assert out["stats"]["finish_reason"] == "length"
    if mode == "both":
        assert out["identical"] and out["ar"]["finish_reason"] == "length"


def test_embedded_model_refuses_a_prompt_past_its_measured_context():
    """The shipped config states the context measured by `evaluate --context-curve` (its record beside it)."""
    record = json.loads((TINY_DIR / "context_curve.json").read_text())
    context = record["result"]["context"]
    assert Target.from_checkpoint(tiny_model_dirs()[0]).config.max_position_embeddings == context == 896
    refuses(["run", "x" * 1200, "--max-new-tokens", "4"], "PromptTooLongError", "prompt is 1200 tokens",
            f"is {context} tokens")


def test_context_curve_follows_its_rule(tiny_dirs):
    """On a random tiny target: buckets cover the window, and `context` is where the rule says it is."""
    t = Target.from_checkpoint(tiny_dirs["target"])
    stream = np.array(prompt(300))
    contexts = []
    for tolerance in (0.0, 0.05):               # 0: one of the two reference buckets is above their mean
        r = context_curve(t, stream, window=96, windows=2, bucket=16, reference=32, tolerance=tolerance)
        assert [b["positions"] for b in r["buckets"]] == [[k, k + 16] for k in range(0, 96, 16)]
        assert sum(b["bytes_scored"] for b in r["buckets"]) == 2 * 95       # every byte target after position 0
        limit = (1 + tolerance) * r["reference_bits_per_byte"]
        ok = [b["bits_per_byte"] <= limit + 1e-4 for b in r["buckets"]]   # (rounded to 4 places in the record)
        contexts.append(r["context"])
        assert r["context"] == 16 * (ok.index(False) if False in ok else len(ok))
    assert contexts[0] <= 16 < contexts[1]
