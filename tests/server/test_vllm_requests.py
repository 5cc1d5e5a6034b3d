"""Request fields a vLLM / OpenAI user sends, against the live tiny-model server: the harmless ones ignored,
logprobs from the target's distribution (equal to the engine's AR run in-process, an independent path),
logit_bias and ignore_eos (equal to the engine's AR with the same options), a non-text part refused by name,
completion_tokens stopping at the stop string, and the metrics counters against the usage of the requests."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from ddtree.runtime.observed import log_softmax
from ddtree.server.app import create_app
from tests.server.conftest import MODEL, in_process_server, metric, samples, wait_idle

PROMPT = "def fib(n):"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def ar_reference(engine, prompt, n, top, **kw):
    """The engine's AR run in-process: tokens and, per token, (logprob, [(id, logprob)] of the top)."""
    rows, tokens = [], []
    for chunk in engine.stream(prompt, max_new_tokens=n, mode="ar", on_logits=rows.append, **kw):
        tokens += chunk
    logp = log_softmax(np.concatenate(rows))
    return tokens, [(logp[i, t], [(int(v), logp[i, v]) for v in np.argsort(-logp[i], kind="stable")[:top]])
                    for i, t in enumerate(tokens)]


def test_harmless_fields_are_accepted_and_ignored(server):
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    plain = httpx.post(server + COMPLETIONS, json=base, timeout=60).json()["choices"][0]["text"]
    extra = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    r = httpx.post(server + COMPLETIONS, json={**base, **extra}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    r = httpx.post(server + CHAT, json={**chat, **extra, "parallel_tool_calls": False}, timeout=60)
    assert r.status_code == 200, r.text


def test_image_part_is_refused_by_name(server):
    parts = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    r = httpx.post(server + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": parts}]}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages.0.content.1" and error["code"] == "unsupported_content_part"
    assert "'image_url'" in error["message"] and "text-only" in error["message"]
    ok = [{"type": "text", "text": "Hi"}]
    r = httpx.post(server + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": ok}],
                                        "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "sampled"])
def test_chat_logprobs_equal_the_engines_ar(client, engine, sampling):
    messages = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, logprobs=True, top_logprobs=3,
                                       **sampling)
    content = r.choices[0].logprobs.content
    tokens, want = ar_reference(engine, engine.tokenizer.encode_chat(messages), 20, 3, **sampling)
    assert len(content) == r.usage.completion_tokens == len(tokens) == 20
    for entry, token, (lp, top) in zip(content, tokens, want):
        assert bytes(entry.bytes) == engine.tokenizer.decode_bytes([token])
        assert entry.logprob == pytest.approx(lp, rel=1e-12, abs=1e-12)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [engine.tokenizer.decode_bytes([v]) for v, _ in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([x for _, x in top], rel=1e-12, abs=1e-12)
    # streamed: the same entries, split over the chunks
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, logprobs=True,
                                            top_logprobs=3, stream=True, **sampling)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_shape_and_values(server, engine):
    r = httpx.post(server + COMPLETIONS, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                               "logprobs": 2}, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    tokens, want = ar_reference(engine, PROMPT, 16, 2, temperature=0)
    text = r["choices"][0]["text"]
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in tokens]
    assert lp["token_logprobs"] == pytest.approx([w[0] for w in want], rel=1e-12, abs=1e-12)
    assert [len(t) for t in lp["top_logprobs"]] == [2] * 16
    assert lp["text_offset"] == [len(text.encode()[:i].decode()) for i in range(16)]   # bytes == chars here
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp["top_logprobs"],
                                                                                lp["token_logprobs"]))
    bad = httpx.post(server + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                          "top_logprobs": 2}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


def test_logit_bias_and_ignore_eos(server, engine):
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.7, "seed": 5}
    plain = httpx.post(server + COMPLETIONS, json=base, timeout=60).json()
    bias = {str(ord("e")): 8, str(ord(" ")): -100}
    biased = httpx.post(server + COMPLETIONS, json={**base, "logit_bias": bias}, timeout=60).json()
    want = engine.generate(PROMPT, max_new_tokens=16, temperature=0.7, seed=5, mode="ar")
    assert plain["choices"][0]["text"] == want.text
    alone = list(engine.stream(PROMPT, max_new_tokens=16, temperature=0.7, seed=5, mode="ar",
                               logit_bias={int(k): v for k, v in bias.items()}))
    assert biased["choices"][0]["text"] == engine.decode([t for c in alone for t in c]) != want.text
    assert " " not in biased["choices"][0]["text"]
    eos = {str(engine.config.eos_token_ids[0]): 100}
    stopped = httpx.post(server + COMPLETIONS, json={**base, "logit_bias": eos}, timeout=60).json()
    assert (stopped["usage"]["completion_tokens"], stopped["choices"][0]["finish_reason"]) == (1, "stop")
    kept = httpx.post(server + COMPLETIONS, json={**base, "logit_bias": eos, "ignore_eos": True}, timeout=60).json()
    assert (kept["usage"]["completion_tokens"], kept["choices"][0]["finish_reason"]) == (16, "length")
    for bad in ({"x": 1}, {"999999": 1}, {"65": 101}):
        r = httpx.post(server + COMPLETIONS, json={**base, "logit_bias": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", bad


def test_completion_tokens_stop_at_the_stop_string(server, engine):
    full = engine.generate(PROMPT, max_new_tokens=40, temperature=0.8, seed=3)
    stop = full.text[12:14]
    cut = full.text.index(stop) + len(stop)          # byte tokenizer: one token per byte of this ASCII text
    assert full.text.isascii()
    r = httpx.post(server + COMPLETIONS, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.8,
                                               "seed": 3, "stop": stop}, timeout=60).json()
    assert r["choices"][0]["text"] == full.text[:full.text.index(stop)]
    assert r["usage"]["completion_tokens"] == cut < 40


def test_metrics_counters_equal_the_usage(engine):
    """A fresh app (its own registry): the spec-decode and token counters against the usage it answered."""
    with in_process_server(create_app(engine, [MODEL], budget=6, max_queue=4, log_requests=False)) as url:
        usages = []
        for seed, n in ((1, 30), (2, 17), (3, 25)):
            r = httpx.post(url + COMPLETIONS, json={"model": MODEL, "prompt": PROMPT, "max_tokens": n,
                                                    "temperature": 0.8, "seed": seed}, timeout=60)
            usages.append(r.json()["usage"])
        wait_idle(url)
        steps = sum(u["ddtree"]["steps"] for u in usages)
        accepted = sum(u["completion_tokens"] - 1 - u["ddtree"]["steps"] for u in usages)  # minus prefill, bonuses
        assert metric(url, "ddtree:spec_decode_num_drafts_total") == steps > 0
        assert metric(url, "ddtree:spec_decode_num_draft_tokens_total") == 6 * steps
        assert metric(url, "ddtree:spec_decode_num_accepted_tokens_total") == accepted > 0
        per_pos = {dict(labels)["position"]: v for (name, labels), v in samples(url).items()
                   if name == "ddtree:spec_decode_num_accepted_tokens_per_pos_total"}
        assert sum(per_pos.values()) == accepted
        assert all(per_pos[str(p)] >= per_pos.get(str(p + 1), 0) for p in range(len(per_pos)))
        assert metric(url, "ddtree:request_success_total", finished_reason="length") == 3
        assert metric(url, "ddtree:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        assert metric(url, "ddtree:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
        assert metric(url, "ddtree:time_to_first_token_seconds_count") == 3
        assert metric(url, "ddtree:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1
                                                                              for u in usages)
        assert metric(url, "ddtree:num_requests_running") == 0
