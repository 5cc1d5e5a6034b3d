"""64 concurrent clients against the live server with --max-queue 8: some are refused with 429 and
Retry-After, every answered one equals the same request run alone in-process (no cross-talk between
requests sharing the engine), and the server is alive with an empty queue afterwards."""
from __future__ import annotations

import asyncio
import json

import httpx

from tests.server.conftest import MODEL, metric, wait_idle

PROMPTS = ["def fib(n):", "import numpy as np\n", "class Tree:", "# Load the data", "for i in range(",
           "The quick brown", "SELECT * FROM", "if __name__ =="]
N_CLIENTS = 64


def request_of(i: int) -> dict:
    """Client i: one of 8 prompts, its own seed, sampled (so a mixed-up seed or prompt shows)."""
    return {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 40, "temperature": 0.9,
            "top_k": 50, "seed": 1000 + i, "stream": i % 2 == 1}


async def one_client(http: httpx.AsyncClient, url: str, i: int):
    body = request_of(i)
    if not body["stream"]:
        r = await http.post(f"{url}/v1/completions", json=body)
        return r.status_code, r.headers.get("retry-after"), r.json()["choices"][0]["text"] if r.status_code == 200 else r.json()
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
        text = []
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return 200, None, "".join(text)


async def all_clients(url: str):
    limits = httpx.Limits(max_connections=N_CLIENTS, max_keepalive_connections=N_CLIENTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        return await asyncio.gather(*(one_client(http, url, i) for i in range(N_CLIENTS)))


def test_64_clients_queue_of_8(server, engine):
    wait_idle(server)
    answers = asyncio.run(all_clients(server))
    refused = [i for i, (status, _, _) in enumerate(answers) if status == 429]
    served = [i for i, (status, _, _) in enumerate(answers) if status == 200]
    assert refused, "64 clients against a queue of 8 and none was refused"
    assert len(refused) + len(served) == N_CLIENTS, [a for a in answers if a[0] not in (200, 429)]
    assert len(served) >= 9                                  # the running one + a full queue at least
    for i in refused:
        status, retry_after, body = answers[i]
        assert int(retry_after) >= 1 and body["error"]["code"] == "queue_full"
    for i in served:                                         # the same request alone, in-process
        body = request_of(i)
        alone = engine.generate(body["prompt"], max_new_tokens=40, temperature=0.9, top_k=50, seed=body["seed"])
        assert answers[i][2] == alone.text, f"client {i}"
    assert wait_idle(server) == {"status": "ok", "queue": 0, "running": 0}
    assert metric(server, "ddtree:num_requests_waiting") == 0
    assert metric(server, "ddtree:num_requests_running") == 0
