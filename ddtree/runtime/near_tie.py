"""Near-ties on the GPU (docs/interfaces.md section 6): when GPU DDTree departs from GPU AR, is it a near-tie?

The verify (many rows a call) and the one-token decode sum in different orders, so the same sequence's logits
differ between the two paths. At the first departure i, AR committed a and DDTree committed d; only those two
candidates' logits matter. They are measured at that very position on both paths (the prompt and AR's tokens
teacher-forced: one token a call, and calls of each row count the step verifies), and delta_x is the largest
|verify - decode| of x's logit over those row counts. The departure is a near-tie when the ranking of a against d
could flip between the paths:

    |margin| <= bound,  margin = s(a) - s(d) on the decode path,  bound = (delta_a + delta_d + slack) / T
    s = l (greedy, T = 1) or z + g = l / T + g(seed, position, token) (sampled; g is the same on both paths)
    slack = SLACK_ULPS float32 ulps of the candidates' largest |logit| (about 4e-6 at |l| = 10)

The slack: the logits are stored in float32 and everything after (differences, l / T + g) runs in float64 on
the host, so the formula is exact for the replay; the slack covers the one float32 rounding of each candidate's
stored logit on each path (2 x 2) should the committed run round where the replay did not. A real bug (a wrong
row, a token that was not the definition's) moves the margin by far more. The replay assumes deterministic
kernels (a graph replays its logits bitwise) and measures one placement per row count: the chain of r-row calls
aligned at the prompt puts the departure's row at offset (i - 1) mod r of its call, where the step's tree puts
it at its node's row.

Sampled with top-k / top-p, the kept set is a function of the whole row (top-p's normaliser sums every kept
logit), so no per-candidate bound exists for it: membership is taken as measured on each path. "a beats d" on a
path means a is kept there and either d is not kept or s(a) >= s(d) within the bound; the departure is a near-tie
when a can beat d on the decode path and d can beat a on some verify row count. So a candidate whose membership
differs between the paths (the cut moved across it, which only a token at the cut can do) makes a near-tie if the
scores allow it ("rule": "kept set"), while a committed token that no measured path keeps is never one (a token
sampled outside the kept set is a bug, whatever its score).

The old rule (top-2 margin below 2 delta, delta the largest difference over the whole vocabulary) is reported
only as a diagnostic, "delta_row" (over the whole row at the departure), and path_differences (every position).

    verdict = classify_departure(ex, prompt_ids, ar_tokens, dd_tokens, params, rows=(block, budget + 1))
"""
from __future__ import annotations

import numpy as np

from ddtree.reference.model import causal_visible
from ddtree.tree.sampling import SamplingParams, gumbel, kept_mask

SLACK_ULPS = 4                 # float32 ulps of the candidates' largest |logit| (module docstring)


def decode_logits(ex, seq, P: int) -> np.ndarray:
    """[len(seq) - P, V]: row j the logits that pick seq[P + j], feeding seq one token a call after a P-token
    prefill (the decode path)."""
    cache = ex.new_target_cache(len(seq) + 1, limit=len(seq) + 1)
    lg, _ = ex.target_forward(np.array(seq[:P]), np.arange(P), causal_visible(0, P), cache)
    out = [lg[-1]]
    for i in range(P, len(seq) - 1):
        lg, _ = ex.target_forward(np.array(seq[i: i + 1]), np.array([i]), causal_visible(i, 1), cache)
        out.append(lg[-1])
    return np.array(out)


def verify_logits(ex, seq, P: int, rows: int) -> np.ndarray:
    """The same rows as decode_logits through calls of `rows` tokens (a chain: each row sees those before it)."""
    cache = ex.new_target_cache(len(seq) + 1, limit=len(seq) + 1)
    lg, _ = ex.target_forward(np.array(seq[:P]), np.arange(P), causal_visible(0, P), cache)
    out = [lg[-1]]
    for a in range(P, len(seq) - 1, rows):
        b = min(a + rows, len(seq) - 1)
        lg, _ = ex.target_forward(np.array(seq[a:b]), np.arange(a, b), causal_visible(a, b - a), cache)
        out.extend(lg)
    return np.array(out)


def path_differences(ex, prompt_ids, ar_tokens, rows=(8, 65)) -> np.ndarray:
    """Diagnostic: per position, max |verify - decode| over the whole logits row, for each verify row count
    (concatenated). The old near-tie delta was its max; the rule no longer reads it."""
    seq = list(prompt_ids) + list(ar_tokens)
    dec = decode_logits(ex, seq, len(prompt_ids))
    return np.concatenate([np.abs(verify_logits(ex, seq, len(prompt_ids), r) - dec).max(axis=1) for r in rows])


def logits_at(ex, prompt_ids, ar_tokens, i: int, rows) -> tuple[np.ndarray, dict]:
    """The logits that pick AR's token i (the prompt and ar_tokens[:i] teacher-forced): decode row [V], and per
    verify row count r the row [V] from calls of r tokens aligned at the prompt, the call holding row i filled
    with AR's later tokens where there are some (so it has r rows, as the step's)."""
    P, seq = len(prompt_ids), list(prompt_ids) + list(ar_tokens)
    dec = decode_logits(ex, seq[: P + i + 1], P)[-1]
    ver = {}
    for r in rows:
        if not (isinstance(r, (int, np.integer)) and r >= 1):
            raise ValueError(f"classify_departure: rows must be verify row counts >= 1, got {r!r}")
        end = P + r * ((i - 1) // r + 1) + 1 if i else P + 1       # row i's call, and the token its last row picks
        ver[int(r)] = verify_logits(ex, seq[:end], P, int(r))[i]
    return dec, ver


def scores(row, position: int, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """What the sampler ranks at `position`, float64 [V], and the kept set [V] bool: the logits (greedy: all
    kept), else z + g with z = l / T and the top-k / top-p survivors of z."""
    row = np.asarray(row, np.float64)
    if params.greedy:
        return row, np.ones(len(row), bool)
    z = row / params.temperature
    kept = kept_mask(z[None], params.top_k, params.top_p)[0]
    return z + gumbel(params.seed, position, np.arange(len(z))), kept


def margin(logits_row, position: int, params: SamplingParams) -> float:
    """The top-2 gap of what the sampler ranks at `position`: logits (greedy) or z + g over the kept set (a
    diagnostic: the rule compares the departure's two candidates, classify_departure)."""
    s, kept = scores(logits_row, position, params)
    top = np.sort(np.where(kept, s, -np.inf))[-2:]
    return float(top[1] - top[0])


def first_difference(a, b) -> int:
    """The first index where token lists a and b differ (the shorter one's length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def classify_departure(ex, prompt_ids, ar_tokens, dd_tokens, params: SamplingParams, rows) -> dict | None:
    """None when the two runs agree (on their common length); else the verdict on the first departure (module
    docstring): index, candidates (a, d), their logits on the decode path and per verify row count, delta (a, d),
    margin and bound (in s units), kept (a, d) per path, rule ("margin" or "kept set"), near_tie, and the
    diagnostic delta_row. rows: the verify row counts the step uses (e.g. (block, budget + 1))."""
    n = min(len(ar_tokens), len(dd_tokens))
    i = next((j for j in range(n) if ar_tokens[j] != dd_tokens[j]), None)
    if i is None:
        return None
    if not len(rows):
        raise ValueError("classify_departure: rows must name at least one verify row count, got none")
    a, d, pos = int(ar_tokens[i]), int(dd_tokens[i]), len(prompt_ids) + i
    dec, ver = logits_at(ex, prompt_ids, ar_tokens, i, rows)
    s_dec, kept_dec = scores(dec, pos, params)
    kept_ver = {r: scores(v, pos, params)[1] for r, v in ver.items()}
    delta_a = max(abs(float(v[a]) - float(dec[a])) for v in ver.values())
    delta_d = max(abs(float(v[d]) - float(dec[d])) for v in ver.values())
    biggest = max(abs(float(x[c])) for x in (dec, *ver.values()) for c in (a, d))
    T = 1.0 if params.greedy else params.temperature
    slack = SLACK_ULPS * float(np.spacing(np.float32(biggest)))
    bound = (delta_a + delta_d + slack) / T
    m = float(s_dec[a] - s_dec[d])
    a_beats_d = kept_dec[a] and (not kept_dec[d] or m >= -bound)
    d_beats_a = any(k[d] and (not k[a] or m <= bound) for k in kept_ver.values())
    moved = any(k[a] != kept_dec[a] or k[d] != kept_dec[d] for k in kept_ver.values())
    return {"index": i, "candidates": (a, d),
            "logits": {"decode": (float(dec[a]), float(dec[d])),
                       "verify": {r: (float(v[a]), float(v[d])) for r, v in ver.items()}},
            "delta": (delta_a, delta_d), "margin": m, "bound": bound, "slack": slack / T,
            "kept": {"decode": (bool(kept_dec[a]), bool(kept_dec[d])),
                     "verify": {r: (bool(k[a]), bool(k[d])) for r, k in kept_ver.items()}},
            "rule": "kept set" if moved else "margin", "near_tie": bool(a_beats_d and d_beats_a),
            "delta_row": max(float(np.abs(np.asarray(v, np.float64) - dec).max()) for v in ver.values())}


def describe(v: dict) -> str:
    """One line for a verdict of classify_departure (ddtree-run --mode both prints it to stderr)."""
    (a, d), (dec_a, dec_d) = v["candidates"], v["logits"]["decode"]
    verify = ", ".join(f"{r} rows {la:.6g} / {ld:.6g}" for r, (la, ld) in v["logits"]["verify"].items())
    kept = "" if all(v["kept"]["decode"]) and all(all(k) for k in v["kept"]["verify"].values()) else \
        f", kept (a, d): decode {v['kept']['decode']}, verify {v['kept']['verify']}"
    return (f"first departure at new token {v['index']}: AR {a} vs DDTree {d}, logits decode {dec_a:.6g} / {dec_d:.6g}, "
            f"verify {verify}; margin {v['margin']:.3e}, near-tie bound {v['bound']:.3e} (deltas {v['delta'][0]:.3e}"
            f" + {v['delta'][1]:.3e}; whole-row delta {v['delta_row']:.3e}, not the rule){kept}: "
            f"{'a near-tie' if v['near_tie'] else 'NOT a near-tie'} ({v['rule']})")
