"""The benefit side of `--budget auto` (issue 28, docs/ddtree.md 2.7): expected tokens per step for
every budget, the per-depth calibration of draft probabilities, and the choice of budget from a
step-time table.

The tree for budget b is the first b nodes in pop order (build.py: the pop sequence does not depend
on the budget, the budget only stops it), so one tree built at the largest budget B answers every
b <= B: its prefixes.

Expected acceptance. The walk (walk.py) accepts node c iff its parent p was accepted and the target's
token at p, y_p, equals c's token. So {c accepted} = {every edge on the path root -> c matches}, and
    E[committed] = 1 + E[sum_c 1{c accepted}] = 1 + sum_c P(path to c matches)
by linearity (the 1 is the bonus token: the walk always commits the root's sample at the node where
it stops). No node is counted twice: siblings hold distinct tokens and y_p is one token, so at most
one child of an accepted node is accepted and the accepted nodes are exactly one path. By the chain
rule P(path to c matches) = prod over the path's edges of P(y_p = token(child) | p accepted), with no
independence assumption: each factor is the target's probability of that token in that node's context.
We do not know the target's probabilities before the verify, so each factor is estimated as
calibrated(draft probability of the token at its depth). Over pops 1..b that is a prefix sum:
    expected_accept[b] = 1 + sum_{i=1..b} prod_{edges e on the path to node i} a(e),     [B+1]
with expected_accept[0] = 1 (no drafts: the bonus alone).

Calibration: a per-depth monotone (non-decreasing) map from draft probability to acceptance
probability, fitted on edges whose parent was accepted (only there is the edge tried), by binning the
draft probabilities at quantiles and pooling adjacent violators (isotonic regression over the bins).
Stored as plain lists: for each depth the bin centres x and the fitted acceptance y, read back by
linear interpolation (constant past the ends). A depth with too few samples uses the map of all depths.

Choice: the budget maximising expected committed tokens per microsecond of step, ties -> the smaller.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.errors import InputError
from ddtree.tree.build import Tree, build_tree

CALIBRATION_BINS = 32           # quantile bins per depth before pooling
MIN_BIN_SAMPLES = 8             # fewer bins when there are fewer than this many edges per bin
MIN_DEPTH_SAMPLES = 64          # fewer edges at a depth -> that depth uses the all-depths map
TIE_RTOL = 1e-12                # rates this close are equal (e.g. 6/60 and 3/30 computed in float)


class BudgetError(InputError):
    """A calibration map, cost table or budget list that cannot be used as given, naming the field."""


# ----------------------------------------------------------------------------------------------
# expected acceptance per budget

def edge_draft_probs(tree: Tree, logp: np.ndarray) -> np.ndarray:
    """[n] float64: the drafter's probability of each node's token at its depth, exp(logp[d-1, rank]);
    the root (not drafted) 1.0. logp [D, k] is the table the tree was built from."""
    logp = np.asarray(logp, dtype=np.float64)
    p = np.ones(tree.size)
    for i in range(1, tree.size):
        p[i] = np.exp(logp[tree.depth[i] - 1, tree.ranks[i][-1]])
    return p


def path_probs(parents: np.ndarray, edge_accept: np.ndarray) -> np.ndarray:
    """[n]: P(the path root -> i is accepted) = product of edge_accept along it; root 1.
    parents[i] < i (pop order), so one pass in index order sees every parent first."""
    parents = np.asarray(parents)
    edge_accept = np.asarray(edge_accept, dtype=np.float64)
    path = np.ones(len(parents))
    for i in range(1, len(parents)):
        path[i] = path[parents[i]] * edge_accept[i]
    return path


def expected_accept_from_edges(parents: np.ndarray, edge_accept: np.ndarray) -> np.ndarray:
    """[n] (= B+1 for a tree of B drafts): entry b = expected tokens committed by one step whose tree
    is the first b pops, the bonus included (see the module docstring); entry 0 = 1."""
    path = path_probs(parents, edge_accept)
    path[0] = 1.0                                          # the bonus token: always committed
    return np.cumsum(path)


def expected_accept_prefix(tree: Tree, logp: np.ndarray, calibration: "Calibration | None" = None) -> np.ndarray:
    """[tree.size]: expected committed tokens for every budget b <= the tree's drafts, from the tree built
    at the largest budget and the top-k table logp [D, k] it was built from. No calibration: the raw
    draft probabilities are taken as acceptance probabilities."""
    p = edge_draft_probs(tree, logp)
    a = p if calibration is None else calibration.calibrate(p, tree.depth)
    a[0] = 1.0
    return expected_accept_from_edges(tree.parents, a)


def expected_accept_for_table(root_token: int, logp: np.ndarray, ids: np.ndarray, max_budget: int,
                              calibration: "Calibration | None" = None) -> np.ndarray:
    """[B+1] expected committed tokens for budgets 0..max_budget from a top-k table (logp, ids [D, k]).
    A table with fewer than max_budget candidate prefixes repeats its last value (the tree stops growing)."""
    tree = build_tree(root_token, logp, ids, max_budget)
    e = expected_accept_prefix(tree, logp, calibration)
    return np.concatenate([e, np.full(max_budget + 1 - len(e), e[-1])])


# ----------------------------------------------------------------------------------------------
# calibration: draft probability -> acceptance probability, per depth

def _pool_adjacent_violators(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of y (the isotonic regression), as one value per input."""
    blocks = []                                            # [mean, weight, count] of pooled runs
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([np.full(c, m) for m, _, c in blocks])


def _fit_map(p: np.ndarray, accepted: np.ndarray, bins: int) -> dict:
    """{"x", "y", "samples"}: quantile bins of p (at least MIN_BIN_SAMPLES each), each bin's mean p (x) and
    pooled acceptance rate (y). Inner knots of a flat run are dropped (the interpolated map is the same)."""
    order = np.argsort(p, kind="stable")
    p, accepted = p[order], accepted[order]
    groups = np.array_split(np.arange(len(p)), max(1, min(bins, len(p) // MIN_BIN_SAMPLES)))
    x = np.array([p[g].mean() for g in groups])
    rate = np.array([accepted[g].mean() for g in groups])
    w = np.array([len(g) for g in groups], dtype=np.float64)
    y = _pool_adjacent_violators(rate, w)
    inner_flat = np.zeros(len(y), bool)
    inner_flat[1:-1] = (y[1:-1] == y[:-2]) & (y[1:-1] == y[2:])
    return {"x": [float(v) for v in x[~inner_flat]], "y": [float(v) for v in y[~inner_flat]], "samples": int(len(p))}


def _check_map(m, where: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(m, dict) or not {"x", "y", "samples"} <= set(m):
        raise BudgetError(f"{where}: expected an object with x, y, samples, got {m!r:.80}")
    if not (isinstance(m["samples"], int) and not isinstance(m["samples"], bool) and m["samples"] >= 0):
        raise BudgetError(f"{where}: samples must be a count (an int >= 0), got {m['samples']!r:.80}")
    try:
        x, y = np.asarray(m["x"], dtype=np.float64), np.asarray(m["y"], dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise BudgetError(f"{where}: x and y must be lists of numbers ({e})") from e
    ok = (x.ndim == 1 and x.shape == y.shape and len(x) > 0 and np.all(np.isfinite(x)) and np.all(np.isfinite(y))
          and np.all(np.diff(x) >= 0) and np.all(np.diff(y) >= 0) and np.all((y >= 0) & (y <= 1)))
    if not ok:
        raise BudgetError(f"{where}: x must be non-decreasing and y non-decreasing in [0, 1], "
                          f"both finite, of one non-zero length (got {len(x)} and {len(y)} values)")
    return x, y


@dataclass(frozen=True)
class Calibration:
    """Per-depth monotone maps; depths[d-1] is depth d's map or None (use `pooled`). The JSON form is
    {"depths": [{"x", "y", "samples"} | null, ...], "pooled": {"x", "y", "samples"}}."""
    depths: tuple
    pooled: dict

    def calibrate(self, p, depth) -> np.ndarray:
        """Acceptance probability of drafted tokens with draft probability p at depth (arrays broadcast)."""
        p, depth = np.broadcast_arrays(np.asarray(p, dtype=np.float64), np.asarray(depth))
        out = np.empty(p.shape)
        for d in np.unique(depth):
            m = self.depths[d - 1] if 1 <= d <= len(self.depths) and self.depths[d - 1] else self.pooled
            sel = depth == d
            out[sel] = np.interp(p[sel], m["x"], m["y"])
        return out

    def to_json(self) -> dict:
        return {"depths": list(self.depths), "pooled": self.pooled}

    @classmethod
    def from_json(cls, d, where: str = "calibration") -> "Calibration":
        """Checked: BudgetError names `where` and the field (depths[i], pooled)."""
        if not isinstance(d, dict) or set(d) != {"depths", "pooled"} or not isinstance(d["depths"], list):
            raise BudgetError(f"{where}: expected an object {{\"depths\": [...], \"pooled\": {{...}}}}, "
                              f"got {d!r:.80}")
        _check_map(d["pooled"], f"{where}.pooled")
        for i, m in enumerate(d["depths"]):
            if m is not None:
                _check_map(m, f"{where}.depths[{i}] (depth {i + 1})")
        return cls(tuple(d["depths"]), d["pooled"])

    @classmethod
    def identity(cls) -> "Calibration":
        """Acceptance probability = draft probability."""
        return cls((), {"x": [0.0, 1.0], "y": [0.0, 1.0], "samples": 0})


def fit_calibration(draft_probs, accepted_flags, depths, bins: int = CALIBRATION_BINS,
                    min_samples: int = MIN_DEPTH_SAMPLES) -> Calibration:
    """Fit from edges that were tried: one sample per drafted node whose parent was accepted, with the
    node's draft probability, whether the walk accepted it, and its depth (1..D). Each depth with at least
    min_samples edges gets its own map; the others use the map fitted on every edge."""
    p = np.asarray(draft_probs, dtype=np.float64)
    acc = np.asarray(accepted_flags, dtype=np.float64)
    dep = np.asarray(depths)
    if not (p.ndim == 1 and p.shape == acc.shape == dep.shape and len(p) > 0):
        raise BudgetError(f"fit_calibration: draft_probs, accepted_flags, depths must be 1-D of one non-zero "
                          f"length, got {p.shape}, {acc.shape}, {dep.shape}")
    if np.any((p < 0) | (p > 1)) or np.any((acc != 0) & (acc != 1)) or np.any(dep < 1):
        raise BudgetError("fit_calibration: draft_probs must be in [0, 1], accepted_flags 0/1, depths >= 1")
    maps = []
    for d in range(1, int(dep.max()) + 1):
        sel = dep == d
        maps.append(_fit_map(p[sel], acc[sel], bins) if sel.sum() >= min_samples else None)
    return Calibration(tuple(maps), _fit_map(p, acc, bins))


# ----------------------------------------------------------------------------------------------
# the choice

def choose_budget(expected_accept, step_time_us, budgets_available) -> int:
    """The budget b in budgets_available maximising expected_accept[b] / step_time_us[b] (committed tokens per
    microsecond); equal rates -> the smaller budget. expected_accept: indexed by budget ([B+1], entry b; a
    budget past its end gets the last entry: the tree cannot grow). step_time_us: {budget: us} or indexed by
    budget."""
    e = np.asarray(expected_accept, dtype=np.float64)
    budgets = sorted({int(b) for b in budgets_available})
    if not budgets or budgets[0] < 1:
        raise BudgetError(f"choose_budget: budgets_available must hold budgets >= 1, got {budgets}")
    if e.ndim != 1 or len(e) < 1:
        raise BudgetError(f"choose_budget: expected_accept must be a non-empty [B+1] array, got shape {e.shape}")
    best, best_rate = None, -np.inf
    for b in budgets:
        try:
            t = float(step_time_us[b])
        except (KeyError, IndexError) as err:
            raise BudgetError(f"choose_budget: step_time_us has no entry for budget {b}") from err
        if not (np.isfinite(t) and t > 0):
            raise BudgetError(f"choose_budget: step_time_us[{b}] must be a positive time in us, got {t}")
        rate = e[min(b, len(e) - 1)] / t
        if rate > best_rate * (1 + TIE_RTOL):              # a tie (to rounding) keeps the smaller budget
            best, best_rate = b, rate
    return best
