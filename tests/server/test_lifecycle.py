"""The server's life: SIGTERM drains (the stream in flight finishes whole, then exit 0); a request that
fails inside the engine is a 500 and the next one is served; a dead engine worker is 503 on /health and
on every request. The failures come from a stand-in that wraps the real engine and raises on two
marker prompts (declared here: the real engine does not fail on demand)."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from ddtree.server.app import create_app
from tests.server.conftest import MODEL, in_process_server, live_server


def test_sigterm_drains_the_stream_in_flight(engine):
    body = {"model": MODEL, "prompt": "def", "max_tokens": 400, "temperature": 0.7, "seed": 5, "stream": True}
    with live_server("--max-queue", "2") as (url, proc):
        text = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
                    break
            proc.send_signal(signal.SIGTERM)                 # mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        text += [c["text"] for line in rest[:-1] for c in json.loads(line[6:])["choices"]]
        assert "".join(text) == engine.generate("def", max_new_tokens=400, temperature=0.7, seed=5).text
        assert proc.wait(30) == 0
        assert "drained" in proc.stdout.read()


class WorkerKilled(BaseException):
    """Not an Exception: what takes a worker thread down (as a dying rank would)."""


class FailingEngine:
    """Stand-in: the real engine, except that prompt "boom" raises RuntimeError and "die" WorkerKilled."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream_request(self, ids, request, stats=None, on_logits=None):
        text = self.engine.decode(ids)
        if text == "boom":
            raise RuntimeError("a bug inside the engine")
        if text == "die":
            raise WorkerKilled("rank 1 is gone")
        return self.engine.stream_request(ids, request, stats, on_logits)


@pytest.fixture()
def failing_server(engine):
    with in_process_server(create_app(FailingEngine(engine), MODEL, max_queue=4)) as url:
        yield url


def complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0}, timeout=30)


def test_a_failing_request_does_not_take_the_server_down(failing_server, engine):
    r = complete(failing_server, "boom")
    assert r.status_code == 500
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "RuntimeError: a bug inside the engine" in error["message"]
    r = complete(failing_server, "def")
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == engine.generate("def", max_new_tokens=8).text
    assert httpx.get(f"{failing_server}/health").status_code == 200


def test_a_dead_engine_is_503(failing_server):
    r = complete(failing_server, "die")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    health = httpx.get(f"{failing_server}/health")
    assert health.status_code == 503 and "rank 1 is gone" in health.json()["error"]["message"]
    r = complete(failing_server, "def")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
