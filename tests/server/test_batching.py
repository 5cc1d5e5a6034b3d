"""Continuous batching (`ddtree serve --max-num-seqs 4`, server/batch_scheduler.py) and `n` > 1 (server/choices.py):
16 concurrent clients (plus two that hang up mid-stream) each get exactly the tokens of the same request run alone
in-process with its seed; nothing is lost; the batch really runs several at once (never more than 4); the queue
and the gauges are empty after. A request with n = 3 answers choice i as the n = 1 request with seed seed + i."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from ddtree.runtime.loop import RequestError, run_to_end
from ddtree.runtime.request import GenerationRequest
from ddtree.server.app import create_app
from ddtree.server.choices import choice_seeds, merged_usage
from tests.server.conftest import MODEL, live_server, metric, wait_idle

N_CLIENTS = 16
PROMPTS = ["def fib(n):", "import numpy as np\n", "class Tree:", "# Load the data", "for i in range(",
           "The quick brown", "SELECT * FROM", "if __name__ =="]


@pytest.fixture(scope="module")
def batch_server():
    with live_server("--max-num-seqs", "4", "--max-queue", "32", "--budget", "8") as (url, proc):
        yield url
        assert proc.poll() is None, "the server died during the tests"


def request_of(engine, i: int) -> dict:
    """Client i: token-id prompt, its own seed, lengths and sampling (greedy for every 4th), streamed when odd."""
    return {"model": MODEL, "prompt": engine.encode(PROMPTS[i % len(PROMPTS)]), "max_tokens": 12 + 3 * (i % 5),
            "temperature": 0.0 if i % 4 == 0 else 0.9, "top_k": 50, "seed": 1000 + i, "stream": i % 2 == 1}


def alone(engine, body: dict, seed: int | None = None, budget: int = 8) -> list[int]:
    request = GenerationRequest(max_new_tokens=body["max_tokens"], temperature=body["temperature"],
                                top_k=body["top_k"], seed=body["seed"] if seed is None else seed, budget=budget)
    return run_to_end(engine.stream_request(body["prompt"], request))


async def one_client(http: httpx.AsyncClient, url: str, body: dict, hang_up: bool = False):
    """-> (status, {choice index: text}, usage)."""
    if not body["stream"]:
        r = await http.post(f"{url}/v1/completions", json=body)
        data = r.json()
        return r.status_code, {c["index"]: c["text"] for c in data.get("choices", [])}, data.get("usage")
    texts, usage = {}, None
    async with http.stream("POST", f"{url}/v1/completions",
                           json={**body, "stream_options": {"include_usage": True}}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return chunk["error"], texts, None
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if hang_up:
                    return r.status_code, texts, None
    return r.status_code, texts, usage


def watch_running(url: str, seen: list, stop: threading.Event) -> None:
    while not stop.is_set():
        seen.append(httpx.get(f"{url}/health", timeout=5).json()["running"])
        time.sleep(0.02)


def clients_at_once(url: str, bodies: list, hang_ups: list, timeout: float = 120) -> tuple[list, list]:
    """Every body as its own client at once, and the hang-ups (streams dropped after their first chunk) ->
    (each client's (status, texts, usage), the /health running counts seen meanwhile)."""
    seen, stop = [], threading.Event()
    watcher = threading.Thread(target=watch_running, args=(url, seen, stop))
    watcher.start()

    async def everyone():
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=32)) as http:
            return await asyncio.gather(*(one_client(http, url, b) for b in bodies),
                                        *(one_client(http, url, b, hang_up=True) for b in hang_ups))
    try:
        return asyncio.run(everyone()), seen
    finally:
        stop.set()
        watcher.join()


def test_16_clients_with_max_num_seqs_4(batch_server, engine):
    url = batch_server
    wait_idle(url)
    bodies = [request_of(engine, i) for i in range(N_CLIENTS)]
    hang_ups = [{**request_of(engine, i), "stream": True, "max_tokens": 200} for i in range(2)]
    answers, seen = clients_at_once(url, bodies, hang_ups)
    for i, (status, texts, usage) in enumerate(answers[:N_CLIENTS]):
        tokens = alone(engine, bodies[i])
        assert status == 200, f"client {i}: {status}"
        assert texts == {0: engine.decode(tokens)}, f"client {i} differs from its request alone"
        assert usage["completion_tokens"] == len(tokens) and usage["prompt_tokens"] == len(bodies[i]["prompt"])
    assert max(seen) >= 2, f"the batch never held two requests at once: {sorted(set(seen))}"
    assert max(seen) <= 4
    assert wait_idle(url) == {"status": "ok", "queue": 0, "running": 0}
    assert metric(url, "ddtree:num_requests_waiting") == 0 and metric(url, "ddtree:num_requests_running") == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("which", ["batch_server", "server"])       # --max-num-seqs 4, and the default 1
def test_n_choices_are_the_requests_with_seeds_seed_plus_i(request, engine, stream, which):
    url = request.getfixturevalue(which)
    body = {**request_of(engine, 1), "n": 3, "seed": 2**64 - 2, "stream": stream, "max_tokens": 14}
    status, texts, usage = asyncio.run(_one(url, body))
    assert status == 200 and sorted(texts) == [0, 1, 2]
    seeds = choice_seeds(body["seed"], 3)
    assert seeds == [2**64 - 2, 2**64 - 1, 0]                        # wraps at 2^64
    runs = [alone(engine, body, seed, 8 if which == "batch_server" else 16) for seed in seeds]   # their --budget
    assert [texts[i] for i in range(3)] == [engine.decode(t) for t in runs]
    assert len({tuple(t) for t in runs}) > 1                          # the choices do differ
    assert usage["completion_tokens"] == sum(map(len, runs)) and usage["prompt_tokens"] == len(body["prompt"])


def test_n_beyond_the_queue_is_a_400_naming_n(batch_server, engine):
    r = httpx.post(f"{batch_server}/v1/completions", json={**request_of(engine, 0), "n": 33}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-queue" in r.json()["error"]["message"]
    r = httpx.post(f"{batch_server}/v1/completions", json={**request_of(engine, 0), "n": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


async def _one(url, body):
    async with httpx.AsyncClient(timeout=120) as http:
        return await one_client(http, url, body)


def test_merged_usage_sums_the_choices():
    a = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "ddtree": {"steps": 2, "mean_accept_len": 3.0}}
    b = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "ddtree": {"steps": 3, "mean_accept_len": 1.0}}
    assert merged_usage([a, b]) == {"prompt_tokens": 5, "completion_tokens": 11, "total_tokens": 16,
                                    "ddtree": {"steps": 5, "mean_accept_len": (6 + 3) / 5}}


def test_max_num_seqs_on_a_gpu_executor_is_refused_naming_the_flag():
    gpu_engine = SimpleNamespace(processes=None, executor=SimpleNamespace(name="tensorrt", lane_pool=None))
    with pytest.raises(RequestError, match="--max-num-seqs 2 is implemented on the CPU executors"):
        create_app(gpu_engine, MODEL, max_num_seqs=2)
