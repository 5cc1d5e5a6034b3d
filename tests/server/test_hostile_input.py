"""Hostile request bodies (issue 52, server input): text that cannot be encoded, ids outside the vocabulary,
deep nesting, huge integers, non-JSON constants. Each is a 400 in the OpenAI error shape, streamed or not
(the status comes before any event), and the server goes on answering."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VOCAB = 512                     # the embedded tiny model's vocab_size


def post_raw(url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(url + path, content=content, timeout=30, headers={"Content-Type": "application/json"})


def refused(r: httpx.Response, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == 400, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def body(**fields) -> bytes:
    """ASCII JSON: a lone surrogate written as its \\uXXXX escape, as a client's json.dumps would."""
    return json.dumps(fields, ensure_ascii=True).encode()


TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, fields, param", [
    (COMPLETIONS, {"prompt": "ab\udc80c"}, "prompt"),
    (COMPLETIONS, {"prompt": ["\ud83d"]}, "prompt.0"),
    (CHAT, {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{**TOOL, "function": {**TOOL["function"], "description": "use \udbff me"}}]},
     "tools.0.function.description"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}, "stop.0"),
])
def test_lone_surrogates_are_named(server, stream, path, fields, param):
    r = post_raw(server, path, body(model=MODEL, stream=stream, max_tokens=2, **fields))
    error = refused(r, "invalid_string", param)
    assert "surrogate" in error["message"]


def test_surrogates_in_the_model_name_and_keys_and_as_bytes(server):
    refused(post_raw(server, COMPLETIONS, body(model="tiny\ud800", prompt="x")), "invalid_string", "model")
    refused(post_raw(server, COMPLETIONS, body(model=MODEL, prompt="x", **{"\udc00k": 1})), "invalid_string")
    # CESU-8 / WTF-8 bytes of U+D800 inside a string: not UTF-8 (Python's json would have let them through)
    raw = b'{"model": "ddtree-tiny", "prompt": "a\xed\xa0\x80b"}'
    assert "UTF-8" in refused(post_raw(server, COMPLETIONS, raw), "invalid_json")["message"]
    # a valid pair is fine: the escaped surrogate pair of U+1F600 is one character
    ok = post_raw(server, COMPLETIONS, body(model=MODEL, prompt="\U0001F600", max_tokens=1, temperature=0))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt, bad", [
    ([VOCAB], VOCAB), ([1, 2, 600], 600), ([-1], -1), ([2 ** 63], 2 ** 63), ([2 ** 64 - 1], 2 ** 64 - 1),
    ([[5, VOCAB + 7]], VOCAB + 7),
])
def test_token_ids_outside_the_vocabulary(server, stream, prompt, bad):
    r = post_raw(server, COMPLETIONS, body(model=MODEL, prompt=prompt, stream=stream, max_tokens=2))
    error = refused(r, "invalid_token_id", "prompt")
    assert str(bad) in error["message"] and f"[0, {VOCAB})" in error["message"]


def test_the_last_id_in_the_vocabulary_is_served(server):
    r = post_raw(server, COMPLETIONS, body(model=MODEL, prompt=[0, VOCAB - 1], max_tokens=1, temperature=0))
    assert r.status_code == 200, r.text


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("depth", [33, 250, 5000, 16000])
def test_deep_nesting_is_refused_by_depth(server, depth):
    raw = f'{{"model": "{MODEL}", "prompt": {nested(depth)}}}'.encode()
    error = refused(post_raw(server, COMPLETIONS, raw), "request_too_complex")
    assert f"{depth + 1} deep" in error["message"] and "--max-json-depth" in error["message"]


def test_many_containers_or_values_are_refused(server):
    """Wide instead of deep: 20000 empty lists (each costs the C parser ~4 values' time; + the prompt list and
    the body object), 70000 values, 70000 strings."""
    raw = f'{{"model": "{MODEL}", "prompt": [{",".join(["[]"] * 20000)}]}}'.encode()
    assert "20002 arrays and objects" in refused(post_raw(server, COMPLETIONS, raw), "request_too_complex")["message"]
    raw = f'{{"model": "{MODEL}", "prompt": [{",".join(["1"] * 70000)}]}}'.encode()
    assert "JSON values" in refused(post_raw(server, COMPLETIONS, raw), "request_too_complex")["message"]
    strings = ",".join(['""'] * 70000)
    raw = f'{{"model": "{MODEL}", "prompt": [{strings}]}}'.encode()
    assert "strings" in refused(post_raw(server, COMPLETIONS, raw), "request_too_complex")["message"]


def schema(depth: int) -> dict:
    node = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}}
    return node


def test_tool_schemas_nested_past_the_limit(server):
    for depth in (20, 250):                 # 20 levels: 2 + 2*20 + 1 = 43 deep in the body
        tool = {**TOOL, "function": {**TOOL["function"], "parameters": schema(depth)}}
        r = post_raw(server, CHAT, body(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[tool]))
        refused(r, "request_too_complex")
    tool = {**TOOL, "function": {**TOOL["function"], "parameters": schema(5)}}
    r = post_raw(server, CHAT, body(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[tool],
                                    max_tokens=1, temperature=0))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("number", ["9" * 21, "1" + "0" * 5000, "-" + "7" * 40, "1" * 30 + ".5"])
def test_integers_past_any_parameter(server, number):
    raw = f'{{"model": "{MODEL}", "prompt": "x", "seed": {number}}}'.encode()
    assert "digits" in refused(post_raw(server, COMPLETIONS, raw), "invalid_json")["message"]


def test_digits_inside_strings_and_long_fractions_are_not_numbers(server):
    r = post_raw(server, COMPLETIONS, body(model=MODEL, prompt="1" * 100, max_tokens=1, temperature=0.0))
    assert r.status_code == 200, r.text
    raw = f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 1, "top_p": 0.{"9" * 40}}}'.encode()
    assert post_raw(server, COMPLETIONS, raw).status_code == 200


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_json_constants(server, constant):
    raw = f'{{"model": "{MODEL}", "prompt": "x", "temperature": {constant}}}'.encode()
    assert "not JSON" in refused(post_raw(server, COMPLETIONS, raw), "invalid_json")["message"]


def test_escaped_quotes_do_not_confuse_the_scan(server):
    """Brackets, commas and quotes inside strings are text: a prompt of them is served, not counted."""
    prompt = '\\"[[[[{{{{,,,,' * 50 + "\\\\"
    r = post_raw(server, COMPLETIONS, body(model=MODEL, prompt=prompt, max_tokens=1, temperature=0))
    assert r.status_code == 200, r.text


def test_the_server_is_healthy_after_the_abuse(server):
    r = httpx.get(f"{server}/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
