"""`ddtree serve`'s vLLM-spelled flags on a live server (loopback): --api-key, --allowed-origins,
--served-model-name (several), --max-model-len, --chat-template, --disable-log-requests (else a log line a
request), --budget auto; and the utility routes /tokenize, /detokenize, /version, /ping, as a vLLM user's
curl exchange (plain HTTP with the headers curl sends) and the official openai client."""
from __future__ import annotations

import httpx
import openai
import pytest

import ddtree
from tests.cli.bad_input import ddtree as ddtree_cli
from tests.server.conftest import MODEL, live_server

KEY = "sk-test-123"
ORIGIN = "http://ui.example"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}=>{% endif %}"


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with live_server("--api-key", KEY, "--allowed-origins", ORIGIN, "--served-model-name", "kimi",
                     "--served-model-name", "kimi-k2.6", "--max-model-len", "300", "--chat-template", str(template),
                     "--budget", "8") as (url, proc):
        yield url, proc


def auth(key=KEY) -> dict:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def test_api_key(flagged):
    url, _ = flagged
    for headers in ({}, auth("wrong")):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {
            "message", "type", "param", "code"}
    assert httpx.get(f"{url}/v1/models", headers=auth()).status_code == 200
    for open_path in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(url + open_path).status_code == 200, open_path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["kimi", "kimi-k2.6"]


def test_cors_preflight_and_origin(flagged):
    url, _ = flagged
    pre = httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(f"{url}/v1/models", headers={**auth(), "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{url}/v1/models", headers={**auth(), "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_served_names_and_max_model_len(flagged):
    url, _ = flagged
    cards = httpx.get(f"{url}/v1/models", headers=auth()).json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("kimi", 300), ("kimi-k2.6", 300)]
    for name in ("kimi", "kimi-k2.6"):
        r = httpx.post(f"{url}/v1/completions", headers=auth(), timeout=60,
                       json={"model": name, "prompt": "def", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == name
    r = httpx.post(f"{url}/v1/completions", headers=auth(), json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 404
    r = httpx.post(f"{url}/v1/completions", headers=auth(), json={"model": "kimi", "prompt": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "300" in r.json()["error"]["message"]
    # max_tokens past --max-model-len is cut to it: finish_reason length at 300 tokens in all
    r = httpx.post(f"{url}/v1/completions", headers=auth(), timeout=120,
                   json={"model": "kimi", "prompt": "x" * 290, "max_tokens": 50, "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["total_tokens"] == 300 and r.json()["choices"][0]["finish_reason"] == "length"


def test_chat_template_flag_and_tokenize(flagged):
    url, _ = flagged
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={"model": "kimi", "messages": messages})
    assert r.json() == {"count": 10, "max_model_len": 300, "tokens": list(b"<user>hi=>")}
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                            "return_token_strs": True})
    assert r.json()["token_strs"] == list("<user>hi")
    chat = httpx.post(f"{url}/v1/chat/completions", headers=auth(), timeout=60,
                      json={"model": "kimi", "messages": messages, "max_tokens": 2, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == 10
    assert httpx.post(f"{url}/tokenize", json={"prompt": "abc"}).json()["tokens"] == [97, 98, 99]
    assert httpx.post(f"{url}/detokenize", json={"tokens": [97, 98, 99]}).json() == {"prompt": "abc"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{url}/tokenize", json={"model": "gpt", "prompt": "a"}).status_code == 404
    assert httpx.post(f"{url}/tokenize", json={}).status_code == 400
    assert httpx.get(f"{url}/version").json() == {"version": ddtree.__version__}
    assert httpx.post(f"{url}/ping").status_code == 200


def test_a_log_line_per_request(flagged):
    url, proc = flagged
    r = httpx.post(f"{url}/v1/completions", headers=auth(), timeout=60,
                   json={"model": "kimi", "prompt": "def", "max_tokens": 5, "temperature": 0})
    rid = r.json()["id"]
    proc.send_signal(__import__("signal").SIGTERM)
    out = proc.communicate(timeout=30)[0]
    line = next(line for line in out.splitlines() if rid in line)
    assert "status 200" in line and "prompt 3 tokens, completion 5 tokens" in line and line.endswith(" s")


def test_disable_log_requests():
    with live_server("--disable-log-requests") as (url, proc):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=60)
        rid = r.json()["id"]
        proc.send_signal(__import__("signal").SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert rid not in out and "status 200" not in out


def test_budget_auto_is_parsed_and_needs_a_tuning_file():
    r = ddtree_cli(["serve", "--budget", "auto", "--port", "0"])
    assert r.returncode == 1 and "Invalid value" not in r.stderr
    assert "budget (--budget) 'auto' needs an engine directory with a tuning file" in r.stderr
    r = ddtree_cli(["serve", "--max-model-len", "100000", "--port", "0"])
    assert r.returncode == 1 and "--max-model-len 100000 is more than the model's context (896" in r.stderr
    r = ddtree_cli(["serve", "--chat-template", "/nonexistent/t.jinja", "--port", "0"])
    assert r.returncode == 1 and "--chat-template /nonexistent/t.jinja" in r.stderr
