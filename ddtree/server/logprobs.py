"""`logprobs` / `top_logprobs` of the OpenAI API from the target's own distribution at each committed token.

    entries = token_logprobs(rows, tokens, top_n)     # in the engine's worker: rows [k, V] raw target logits
    chat_logprobs(tokenizer, entries)                  # {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}
    completion_logprobs(tokenizer, entries, offsets)   # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}

What the numbers are: log-softmax of the target's raw logits at the position the token was committed to, in
float64, before temperature, top-k / top-p and logit_bias. This is vLLM's default (`logprobs_mode
raw_logprobs`: "the model's logprobs"), and it is defined for greedy requests too (a temperature-scaled
distribution is not at temperature 0). The rows come from runtime/observed.py: in DDTree the verify's row
at the accepted node, in AR the one-token decode's row; on the float64 CPU reference the two agree to
~1e-15 (tests/runtime/test_observed.py), so DDTree and AR report the same numbers.
top_logprobs: the n most likely tokens by that distribution, ties to the lower id (n = 0: none).
A token's text is its bytes decoded as UTF-8 with U+FFFD for a partial character; `bytes` gives them exact.
"""
from __future__ import annotations

import numpy as np

from ddtree.runtime.observed import log_softmax

MAX_TOP_LOGPROBS = 20           # vLLM's default max_logprobs (OpenAI allows 20 for chat, 5 for completions)


def token_logprobs(rows, tokens, top_n: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """rows [k, V], tokens [k] -> per token (id, logprob, [(id, logprob)] of the top_n)."""
    logp = log_softmax(rows)                                            # [k, V]
    out = []
    for row, token in zip(logp, tokens):
        top = np.argsort(-row, kind="stable")[:top_n] if top_n else []  # ties: lower id first
        out.append((int(token), float(row[token]), [(int(t), float(row[t])) for t in top]))
    return out


def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.decode_bytes([token])
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer, entries) -> dict:
    content = []
    for token, logprob, top in entries:
        text, raw = token_text(tokenizer, token)
        alternatives = []
        for t, lp in top:
            t_text, t_raw = token_text(tokenizer, t)
            alternatives.append({"token": t_text, "logprob": lp, "bytes": t_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(tokenizer, entries, offsets: list[int]) -> dict:
    """offsets: each token's character offset in the whole generated text (streaming.TextStream.offsets)."""
    return {"tokens": [token_text(tokenizer, t)[0] for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(tokenizer, t)[0]: lp for t, lp in top} for _, _, top in entries],
            "text_offset": list(offsets)}
