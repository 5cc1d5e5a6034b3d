"""The official `openai` client against a live `ddtree serve`: completions and chat, streamed and not.
The streamed text equals the non-streamed text, and both equal what `ddtree run` prints with the same
seed and sampling (the CLI in a subprocess: an independent path through the engine)."""
from __future__ import annotations

import json

import openai
import pytest

from tests.cli.bad_input import ddtree
from tests.server.conftest import MODEL

SAMPLING = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
RUN_FLAGS = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--json"]
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def run_text():
    r = ddtree(["run", PROMPT, "--max-new-tokens", "48", *RUN_FLAGS])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def run_chat():
    r = ddtree(["run", "Hello", "--chat", "--max-new-tokens", "40", *RUN_FLAGS])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_equals_ddtree_run(client, run_text):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, **SAMPLING)
    assert r.choices[0].text == run_text["text"]
    assert r.choices[0].finish_reason == run_text["stats"]["finish_reason"] == "length"
    usage = r.usage.model_dump()
    assert usage["completion_tokens"] == len(run_text["tokens"]) == 48
    assert usage["prompt_tokens"] == len(PROMPT.encode())            # the byte tokenizer, no BOS
    assert usage["ddtree"] == {"steps": run_text["stats"]["steps"],
                               "mean_accept_len": pytest.approx(run_text["stats"]["mean_accept_len"])}


def test_streamed_completion_one_chunk_per_step(client, run_text):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLING))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(texts) == run_text["text"]
    assert len(texts) == run_text["stats"]["steps"] + 1                 # the prefill's token, then each step
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cut_exactly_streamed_and_not(client, run_text):
    full = run_text["text"]
    stop = full[20:23]                                   # somewhere inside a later step, first seen there
    expected = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, stop=[stop], **SAMPLING)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, stop=stop, stream=True,
                                            **SAMPLING))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never completes: its partial matches are held back, then released whole
    never = full[20:23] + "\x00"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, stop=[never], **SAMPLING)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full, "length")


def split_thinking(text: str) -> tuple[str, str]:
    """The tiny model's chat answer with thinking on: reasoning up to </think>, then content."""
    reasoning, _, content = text.partition("</think>")
    return reasoning, content


def test_chat_equals_ddtree_run_chat(client, run_chat):
    assert "<|tool_call" not in run_chat["text"]          # a plain answer: no tool-call markers to parse
    reasoning, content = split_thinking(run_chat["text"])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=40, **SAMPLING)
    message = r.choices[0].message
    assert (message.model_extra.get("reasoning_content") or "", message.content or "") == (reasoning, content)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=40, stream=True, **SAMPLING)
    got = {"reasoning_content": "", "content": ""}
    roles, finishes = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        got["content"] += delta.content or ""
        got["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (got["reasoning_content"], got["content"]) == (reasoning, content)
    assert roles == ["assistant"] and finishes == ["length"]


def test_chat_thinking_off(client, engine):
    messages = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    ids = engine.tokenizer.encode_chat(messages, thinking=False)
    alone = engine.generate(ids, max_new_tokens=24, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == alone.text.split("<|im_end|>")[0]
    assert not r.choices[0].message.model_extra.get("reasoning_content")


def test_errors_reach_the_client_typed(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=0)
    assert e.value.body["param"] == "n"
