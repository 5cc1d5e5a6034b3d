"""Bad requests over plain HTTP (httpx): each is a 4xx with the OpenAI error object naming the parameter,
and the server goes on answering. A client that disconnects mid-stream frees the engine at the next step."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, metric, samples, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def post(url: str, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_json(server):
    error = error_of(post(server, CHAT, content=b'{"model": "ddtree-tiny", "messages": ['), 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    error = error_of(post(server, CHAT, content=b'[1, 2]'), 400)
    assert "JSON object" in error["message"]
    error_of(post(server, CHAT, content=b'\xff\xfe'), 400)


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": "ten"}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HELLO, "temperature": "hot"}, "temperature"),
    (CHAT, {"model": MODEL, "messages": HELLO, "temperature": 2.5}, "temperature"),
    (CHAT, {"model": MODEL, "messages": HELLO, "stream": "yes"}, "stream"),
    (CHAT, {"model": MODEL, "messages": "Hello"}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content.str"),
    (CHAT, {"messages": HELLO}, "model"),
    (CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": 3}, "prompt.str"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "seed": -1}, "seed"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_wrong_types_and_values(server, path, body, param):
    assert error_of(post(server, path, body), 400)["param"] == param


def test_unknown_model_is_404(server):
    for path, body in ((CHAT, {"model": "gpt-4o", "messages": HELLO}), (COMPLETIONS, {"model": "x", "prompt": "a"})):
        error = error_of(post(server, path, body), 404)
        assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error_of(httpx.get(f"{server}/v1/models/gpt-4o"), 404)["code"] == "model_not_found"
    error_of(httpx.get(f"{server}/v1/no-such-route"), 404)


def test_empty_messages_and_prompts(server):
    assert error_of(post(server, CHAT, {"model": MODEL, "messages": []}), 400)["param"] == "messages"
    assert error_of(post(server, COMPLETIONS, {"model": MODEL, "prompt": []}), 400)["param"] == "prompt"
    error = error_of(post(server, COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}), 400)
    assert error["param"] == "prompt" and "batch" in error["message"]


def test_prompt_past_the_context_names_the_limit(server):
    for path, body, param in ((COMPLETIONS, {"model": MODEL, "prompt": "x" * 1200}, "prompt"),
                              (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1200}]},
                               "messages")):
        error = error_of(post(server, path, body), 400)
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
        assert "896" in error["message"] and "max_position_embeddings" in error["message"]


UNSUPPORTED = [   # parameters that would change the output and are not implemented
    (CHAT, "presence_penalty", 0.5), (CHAT, "frequency_penalty", -1.0),
    (CHAT, "response_format", {"type": "json_object"}), (CHAT, "tool_choice", "required"),
    (CHAT, "tool_choice", {"type": "function", "function": {"name": "f"}}), (CHAT, "reasoning_effort", "low"),
    (COMPLETIONS, "presence_penalty", 1.0), (COMPLETIONS, "frequency_penalty", 0.1),
    (COMPLETIONS, "echo", True), (COMPLETIONS, "best_of", 2), (COMPLETIONS, "suffix", "end"),
]


@pytest.mark.parametrize("path, name, value", UNSUPPORTED)
def test_unsupported_parameter_is_named(server, path, name, value):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": HELLO} if path == CHAT else {"prompt": "x"})}
    error = error_of(post(server, path, {**body, name: value}), 400)
    assert (error["param"], error["code"]) == (name, "unsupported_parameter")
    assert name in error["message"]


def test_defaults_of_unsupported_parameters_are_accepted(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "n": 1, "presence_penalty": 0,
            "frequency_penalty": 0.0, "response_format": {"type": "text"}, "logprobs": False,
            "tool_choice": "auto", "user": "me"}
    assert post(server, CHAT, body).status_code == 200
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 1, "echo": False, "best_of": 1}
    assert post(server, COMPLETIONS, body).status_code == 200


def test_unknown_parameter_is_named(server):
    error = error_of(post(server, CHAT, {"model": MODEL, "messages": HELLO, "mirostat": 2}), 400)
    assert error["param"] == "mirostat" and "unrecognized" in error["message"]
    error = error_of(post(server, CHAT, {"model": MODEL, "messages": HELLO, "stream_options": {"include_usage": True}}),
                     400)
    assert error["param"] == "stream_options"


def test_disconnect_mid_stream_frees_the_engine(server):
    wait_idle(server)
    before = metric(server, "ddtree:generation_tokens_total")
    body = {"model": MODEL, "prompt": "def", "max_tokens": 880, "temperature": 0.9, "seed": 3, "stream": True}
    with httpx.stream("POST", server + COMPLETIONS, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the connection is closed: the engine stops within a few steps, far before 880 tokens
    wait_idle(server)
    generated = metric(server, "ddtree:generation_tokens_total") - before
    assert 0 < generated < 300, generated
    r = post(server, COMPLETIONS, {"model": MODEL, "prompt": "def", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_health_and_metrics(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok", "queue": 0, "running": 0}
    names = {(name, dict(labels)["model_name"]) for name, labels in samples(server)}
    for name in ("ddtree:prompt_tokens_total", "ddtree:generation_tokens_total",
                 "ddtree:num_requests_waiting", "ddtree:accept_length_bucket", "ddtree:step_seconds_bucket",
                 "ddtree:time_to_first_token_seconds_bucket", "ddtree:inter_token_latency_seconds_bucket"):
        assert (name, MODEL) in names, name
    assert metric(server, "ddtree:requests_total", endpoint="/v1/chat/completions", status="400") >= 1
