"""The decode loops, written once over executor primitives (docs/interfaces.md section 6).

DDTree step (docs/ddtree.md 2.6), with `start` = the position of the bonus token (= target cache length):
    draft    block [bonus, MASK x (b-1)] at start.., with the taps of the tokens committed last step
    build    per-depth top-k of the draft logits -> best-first tree of `budget` nodes, root = bonus
    verify   one target forward over the n = tree size nodes at positions start + depth, visible =
             the whole cache plus each node's ancestors; taps at every node
    walk     the target's sample at every node (position start + depth + 1); follow matching children
    update   compact the target cache to the accepted path; the next bonus is the sample where the
             walk stopped; the accepted nodes' taps become the drafter's new context
The AR loop is one target forward per token. Both stop after an EOS (kept; finish reason "stop") or
after max_new_tokens or the model's context (finish reason "length"), and slice committed tokens by
position: a token is never filtered by its value (it may equal MASK).

The context C = the target's max_position_embeddings: prompt + new tokens <= C (a prompt of C tokens
or more is a PromptTooLongError, before any forward), and no target forward feeds a token at a
position >= C: near the end DDTree builds its tree from the first draft rows only, so the deepest
node sits at most at the last position still to be committed (lossless: AR commits the same tokens
up to the same place; the drafter still drafts its whole block, whose later mask rows go unused).
The caches start small and grow on demand up to the rows the run can need (CPU executors; a GPU
cache is fixed at load).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ddtree.errors import InputError
from ddtree.reference.model import causal_visible
from ddtree.tree.build import topk_logprobs
from ddtree.tree.prune import absent_tree
from ddtree.tree.sampling import SamplingParams

CACHE_CHUNK = 256           # rows a cache starts with past the prompt; it grows (doubling) up to its limit


class RequestError(InputError):
    """A request the engine cannot serve as given (prompt, lengths, device, mode, budget, dirs), naming the
    parameter / flag."""


class PromptTooLongError(RequestError):
    """The prompt leaves no room for a new token in the model's context."""


@dataclass
class RunStats:
    new_tokens: int = 0
    steps: int = 0
    accept_lens: list = field(default_factory=list)     # per step: committed tokens (bonus included)
    max_depth: int = 0
    wall_s: float = 0.0
    finish_reason: str | None = None                    # "stop" (an EOS) | "length" (max_new_tokens / context)
    budgets: list = field(default_factory=list)         # per DDTree step: the budget it verified
    auto: bool = False                                  # --budget auto chose them (to_dict reports them)
    prune: object | None = None                         # --prune auto: runtime/pruning.py PruneStats

    def to_dict(self) -> dict:
        steps = max(self.steps, 1)
        per_depth = [sum(a - 1 >= d for a in self.accept_lens) / steps for d in range(1, self.max_depth + 1)]
        return {"new_tokens": self.new_tokens, "steps": self.steps,
                "mean_accept_len": sum(self.accept_lens) / steps if self.steps else 0.0,
                "per_depth_accept_rate": per_depth,
                "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0,
                "wall_s": self.wall_s, "finish_reason": self.finish_reason,
                **({"budget_per_step": {str(b): self.budgets.count(b) for b in sorted(set(self.budgets))}}
                   if self.auto else {}),
                **(self.prune.to_dict() if self.prune is not None else {})}


def context_of(config) -> int:
    """The model's context in tokens (positions 0 .. C-1): its max_position_embeddings."""
    return int(config.max_position_embeddings)


def check_context(n_prompt: int, context: int) -> None:
    """A prompt must leave room for at least one new token: n_prompt < context."""
    if n_prompt >= context:
        raise PromptTooLongError(f"the prompt is {n_prompt} tokens but the model's context "
                                 f"(max_position_embeddings) is {context} tokens: at most {context - 1} "
                                 "prompt tokens leave room for a new one")


def _check(prompt_ids, max_new_tokens: int, context: int) -> tuple[list[int], int]:
    """-> the prompt as ints, and the new tokens the run may commit: max_new_tokens cut to the context."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise RequestError("the prompt is empty (at least one token, e.g. BOS, is needed)")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_context(len(prompt), context)
    return prompt, min(max_new_tokens, context - len(prompt))


def _new_cache(make, rows_before: int, limit: int):
    """A cache of min(limit, rows_before + CACHE_CHUNK) rows that may grow up to `limit` rows."""
    return make(min(limit, rows_before + CACHE_CHUNK), limit)


@dataclass
class DecodeState:
    """Where a sequence stands between steps (the host's view; a GPU executor mirrors it on the device)."""
    cache: object                       # the target cache: `start` rows (every committed token but the bonus)
    start: int                          # the bonus token's position = the committed length
    bonus: int                          # the last committed token, not yet fed to the target
    end: int                            # positions < end hold the prompt and every new token
    dcache: object = None               # the drafter cache: start - len(ctx) rows
    ctx: np.ndarray | None = None       # [a, K H] taps of committed positions not yet in the drafter cache
    window: np.ndarray | None = None    # [<= b, K H] taps of the last b committed positions (the GPU step's
                                        # drafter context window, runtime/cuda_step.py)
    block: int = 0                      # the drafter block size b
    table_k: int | None = None          # --budget auto: keep each step's drafter table with this many candidates
    draft_logp: np.ndarray | None = None  # [D, table_k] that table (log-probabilities, descending per depth)
    prune: object | None = None         # --prune auto: runtime/pruning.py Pruner (the verify prunes inside)
    draft_logits: np.ndarray | None = None  # --prune auto: this step's drafter logits [depth, V] (path probabilities)


def ar_step(ex, st: DecodeState, params: SamplingParams) -> list[int]:
    """One autoregressive step: feed the bonus token, sample the next (the composition of the primitives)."""
    return ar_commit(ex, st, params, ex.target_forward(*ar_call(st))[0])


def ar_call(st: DecodeState) -> tuple:
    """An AR step's target_forward arguments: the bonus token after the cache."""
    return np.array([st.bonus]), np.array([st.start]), causal_visible(st.cache.length, 1), st.cache, ()


def ar_commit(ex, st: DecodeState, params: SamplingParams, logits) -> list[int]:
    """An AR step after its forward (logits [1, V]): sample the next token."""
    token = int(ex.sample(logits[-1:], np.array([st.start + 1]), params)[0])
    st.start, st.bonus = st.start + 1, token
    return [token]


@dataclass
class Verify:
    """A step waiting for its verify (ddtree_steps / ar_steps(union=True)): the target_forward call's arguments
    (ids, pos, visible, cache, taps); the driver sends back its (logits, taps), computed with other requests' calls
    as one forward (the executor's verify_requests: runtime/batch.py)."""
    call: tuple


@dataclass
class Fused:
    """A step waiting for its turn (ddtree_steps(union=True) on an executor whose step is fused, the GPU's lanes):
    the driver runs it with other requests' steps (runtime/cuda_lanes.py LanePool.steps: one batched graph) and
    sends back its committed tokens, as ex.ddtree_step(state, params, budget) would return them (budget None:
    an AR step, ex.ar_step's)."""
    ex: object
    state: DecodeState
    params: SamplingParams
    budget: int | None


def ddtree_step(ex, st: DecodeState, params: SamplingParams, budget: int) -> list[int]:
    """One DDTree step as the composition of the primitives (docs/interfaces.md section 6): draft, build,
    verify, walk, compact, context update. -> the accepted drafts in depth order, then the new bonus."""
    tree, call = ddtree_draft(ex, st, budget)
    if st.prune is None:
        return ddtree_commit(ex, st, params, tree, call, ex.target_forward(*call))
    tokens, node_pos, visible, cache, taps = call          # pruned inside the verify: dead nodes absent for the walk
    logits, tapped, live = st.prune.verify(ex, tree, st.draft_logits, node_pos, visible, cache, taps, budget)
    return ddtree_commit(ex, st, params, tree, call, (logits, tapped), live)


def ddtree_draft(ex, st: DecodeState, budget: int) -> tuple:
    """A DDTree step up to its verify: draft and build -> (tree, the verify's target_forward arguments)."""
    b, start = st.block, st.start
    block = np.array([st.bonus] + [ex.drafter_config.mask_token_id] * (b - 1))
    draft_logits = ex.drafter_forward(block, np.arange(start, start + b), st.ctx, st.dcache)   # [b-1, V]
    depth = min(b, st.end - start) - 1    # the deepest node sits at start + depth <= end - 1 (depth >= 1 here)
    tree = ex.tree_build(st.bonus, draft_logits[:depth], budget)
    if st.table_k:                                                         # --budget auto's forecast
        st.draft_logp = topk_logprobs(draft_logits[:depth], st.table_k)[0]
    node_pos = tree.positions(start)                                       # [n]
    visible = np.concatenate([np.ones((tree.size, start), bool), tree.visible()], axis=1)
    if st.prune is not None:                                               # the pruned verify's path probabilities
        st.draft_logits = draft_logits[:depth]
    return tree, (tree.tokens, node_pos, visible, st.cache, tuple(ex.drafter_config.target_layer_ids))


def ddtree_commit(ex, st: DecodeState, params: SamplingParams, tree, call: tuple, verified: tuple,
                  live: np.ndarray | None = None) -> list[int]:
    """A DDTree step after its verify (call: ddtree_draft's; verified: its (logits [n, V], taps); live: the pruned
    verify's mask, dead nodes absent for the walk): sample, walk, compact, context update -> the accepted drafts in
    depth order, then the new bonus."""
    b, start, (_, node_pos, _, _, taps), (logits, tapped) = st.block, st.start, call, verified
    target_tokens = ex.sample(logits, node_pos + 1, params)               # [n]
    walk = ex.accept_walk(tree if live is None else absent_tree(tree, live), target_tokens)
    ex.compact(st.cache, start, walk.accepted)
    acc = walk.accepted                                                    # [a] node indices, acc[0] = root
    st.ctx = np.concatenate([tapped[L][acc] for L in taps], axis=1)        # [a, K*H]
    st.window = np.concatenate([st.window, st.ctx])[-b:]
    st.start, st.bonus = start + len(acc), walk.bonus
    return [int(t) for t in tree.tokens[acc[1:]]] + [walk.bonus]


def ar_steps(ex, prompt_ids, max_new_tokens: int, params: SamplingParams, eos_ids=(),
             stats: RunStats | None = None, union: bool = False) -> Iterator[list[int]]:
    """Yields the committed tokens of each step (one per step) until EOS, max_new_tokens or the context.
    Each step is `ex.ar_step(state, params)` where the executor has that ability (runtime/executor.py) (a captured GPU graph), else the
    composition `ar_step` above. union: as ddtree_steps' (the step's one-row forward is the caller's; on an
    executor whose step is fused, a GPU lane, it yields a loop.Fused with budget None and takes the token)."""
    fused = union and ex.ar_step is not None
    prompt, n_new = _check(prompt_ids, max_new_tokens, context_of(ex.config))
    stats = stats if stats is not None else RunStats()
    eos = {int(e) for e in eos_ids}
    if n_new == 0:
        stats.finish_reason = "length"
        return
    t0 = time.perf_counter()
    # the last token fed sits at len(prompt) + n_new - 2: the cache never holds more than that + 1 rows
    cache = _new_cache(ex.new_target_cache, len(prompt), len(prompt) + n_new)
    logits, _ = ex.target_forward(np.array(prompt), np.arange(len(prompt)), causal_visible(0, len(prompt)), cache)
    token = int(ex.sample(logits[-1:], np.array([len(prompt)]), params)[0])
    st = DecodeState(cache, len(prompt), token, len(prompt) + n_new)
    step = ex.ar_step or (lambda s, p: ar_step(ex, s, p))
    tokens = [token]
    while True:
        if stats.new_tokens:                          # the prefill's token is not a step, as in DDTree,
            stats.steps += 1                          # so the two modes' stats compare
            stats.accept_lens.append(1)
        stats.new_tokens += 1
        stats.wall_s = time.perf_counter() - t0
        token = tokens[0]
        if token in eos or stats.new_tokens >= n_new:
            stats.finish_reason = "stop" if token in eos else "length"
        yield [token]
        if stats.finish_reason is not None:
            return
        if fused:
            tokens = yield Fused(ex, st, params, None)
        else:
            tokens = ar_commit(ex, st, params, (yield Verify(ar_call(st)))[0]) if union else step(st, params)


def ddtree_steps(ex, prompt_ids, max_new_tokens: int, params: SamplingParams, budget: int,
                 eos_ids=(), block_size: int | None = None, stats: RunStats | None = None, prune=None,
                 union: bool = False
                 ) -> Iterator[list[int]]:
    """Yields the tokens each DDTree step commits (the prefill's first token, then per step the
    accepted drafts + the new bonus), cut at EOS / max_new_tokens / the context. Needs an executor with
    a drafter. A step's accept length counts only the tokens it committed (a cut step counts fewer).
    Each step is `ex.ddtree_step(state, params, budget)` where the executor has one (one captured GPU
    graph), else the composition `ddtree_step` above. `budget`: an int, or a chooser called with the state
    before each step (runtime/auto_budget.py AutoBudget: --budget auto); stats.budgets lists each step's.
    prune: a runtime/pruning.py Pruner (--prune auto: the executor's ddtree_step prunes inside each verify where it
    says so, prunes_in_step, else the composition; stats.prune).
    union: each step's verify is the caller's: before a step's tokens the generator yields a Verify and takes its
    (logits, taps) by send() (runtime/batch.py verifies several requests' trees in one forward); on an executor
    whose step is fused (a GPU lane, runtime/cuda_lanes.py) it yields a Fused and takes the step's tokens."""
    fused = union and ex.ddtree_step is not None
    if union and prune is not None:
        raise ValueError("ddtree_steps: a pruned verify is its own forward; union=True shares one with other "
                         "requests (--prune auto is refused with batching)")
    prompt, n_new = _check(prompt_ids, max_new_tokens, context_of(ex.config))
    dcfg = ex.drafter_config
    b = dcfg.block_size if block_size is None else block_size
    if not 2 <= b <= dcfg.block_size:
        raise RequestError(f"block size {b} must be in 2..{dcfg.block_size} (the drafter's block_size)")
    stats = stats if stats is not None else RunStats()
    stats.max_depth = b - 1
    eos = {int(e) for e in eos_ids}
    taps = tuple(dcfg.target_layer_ids)
    if n_new == 0:
        stats.finish_reason = "length"
        return
    end = len(prompt) + n_new                      # positions 0 .. end-1 hold the prompt and every new token
    t0 = time.perf_counter()

    def commit(tokens: list[int]) -> tuple[list[int], bool]:
        out = []
        for t in tokens:
            out.append(t)
            stats.new_tokens += 1
            if t in eos or stats.new_tokens >= n_new:
                stats.finish_reason = "stop" if t in eos else "length"
                return out, True
        return out, False

    # prefill: the prompt's logits give the first token; its taps are the drafter's first context.
    # A verify appends the whole tree (<= budget + 1 rows) after the start <= end - 2 committed rows.
    choose = budget if callable(budget) else None
    stats.auto = choose is not None
    budget = max(budget.budgets) if choose else budget                     # the largest a step may verify
    cache = _new_cache(ex.new_target_cache, len(prompt), end + budget)
    dcache = _new_cache(ex.new_drafter_cache, len(prompt), end)
    logits, tapped = ex.target_forward(np.array(prompt), np.arange(len(prompt)),
                                       causal_visible(0, len(prompt)), cache, taps)
    bonus = int(ex.sample(logits[-1:], np.array([len(prompt)]), params)[0])
    ctx = np.concatenate([tapped[L] for L in taps], axis=1)               # [P, K*H]
    st = DecodeState(cache, len(prompt), bonus, end, dcache, ctx, ctx[-b:], b,
                     table_k=min(choose.table_k, ex.config.vocab_size) if choose else None)
    if ex.drafter_prefill is not None:      # an executor that ingests the prompt's drafter context during the
        ex.drafter_prefill(st)              # prefill (the GPU step's window)
    step = ex.ddtree_step or (lambda s, p, B: ddtree_step(ex, s, p, B))
    if prune is not None:                   # the step prunes (Pruner.for_executor refused the others)
        st.prune, stats.prune = prune, prune.stats
        if not ex.prunes_in_step:           # the composition prunes inside its verify
            step = lambda s, p, B: ddtree_step(ex, s, p, B)     # noqa: E731
    out, done = commit([bonus])
    stats.wall_s = time.perf_counter() - t0
    yield out
    while not done:
        step_budget = choose(st) if choose else budget
        stats.budgets.append(step_budget)
        if fused:
            tokens = yield Fused(ex, st, params, step_budget)
        elif union:
            tree, call = ddtree_draft(ex, st, step_budget)
            tokens = ddtree_commit(ex, st, params, tree, call, (yield Verify(call)))
        else:
            tokens = step(st, params, step_budget)
        out, done = commit(tokens)
        stats.steps += 1
        stats.accept_lens.append(len(out))                                # committed only: a cut step counts less
        stats.wall_s = time.perf_counter() - t0
        yield out


def run_to_end(steps: Iterator[list[int]]) -> list[int]:
    return [t for chunk in steps for t in chunk]
