"""A server nobody can freeze (issue 52, server resources): huge bodies are refused while read, parsing
never stalls /health, slow or idle clients are cut off, connections are capped, SIGTERM ends in bounded
time, echoed names are cut, and metric labels come from a fixed set however many paths clients try."""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import time
import uuid

import httpx
import pytest

from tests.server.conftest import MODEL, live_server

COMPLETIONS = "/v1/completions"
SMALL = ("--max-request-bytes", "200000", "--body-timeout-seconds", "1", "--head-timeout-seconds", "1",
         "--max-connections", "16", "--shutdown-timeout-seconds", "2")


@pytest.fixture(scope="module")
def small():
    """A server with small limits: (url, process)."""
    with live_server(*SMALL) as (url, proc):
        yield url, proc


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connect(url: str) -> socket.socket:
    host, port = url.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it stayed open `seconds`."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk
    except (TimeoutError, socket.timeout):
        return None
    except ConnectionResetError:
        return got


def test_a_body_past_the_limit_is_413_before_it_is_read(small):
    url, proc = small
    before = rss_mb(proc.pid)
    # declared: refused on the headers, the 50 MB never sent
    s = connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 50000000\r\n\r\n" + b"[" * 1000)
    reply = closed_within(s, 5)
    assert reply is not None and reply.startswith(b"HTTP/1.1 413"), reply
    assert b"--max-request-bytes" in reply and b'"request_too_large"' in reply
    # chunked, no length: counted while reading
    def chunks():
        for _ in range(200):
            yield b"1" * 10_000
    r = httpx.post(url + COMPLETIONS, content=chunks(), timeout=10, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert rss_mb(proc.pid) < before + 50
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_a_body_that_never_finishes_is_408_and_closed(small):
    url, _ = small
    s = connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")
    t0 = time.monotonic()
    reply = closed_within(s, 5)
    assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
    assert 0.8 < time.monotonic() - t0 < 4
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("head", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_a_whole_request_head_is_closed(small, head):
    url, _ = small
    s = connect(url)
    s.sendall(head)
    t0 = time.monotonic()
    assert closed_within(s, 5) is not None
    assert 0.8 < time.monotonic() - t0 < 4


def test_an_idle_keep_alive_connection_is_closed_after_its_head_deadline(small):
    url, _ = small
    s = connect(url)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    s.sendall(b"GET /hea")                      # the next request's head, never finished
    t0 = time.monotonic()
    reply = closed_within(s, 5)
    assert reply is not None and reply.startswith(b"HTTP/1.1 200")
    assert time.monotonic() - t0 < 4


def test_connections_are_capped_and_freed(small):
    url, proc = small
    base = open_fds(proc.pid)
    socks = [connect(url) for _ in range(60)]
    time.sleep(0.3)
    assert open_fds(proc.pid) <= base + 16 + 4             # --max-connections 16 (+ the listener's slack)
    time.sleep(1.5)                                         # past --head-timeout-seconds: all closed
    assert all(closed_within(s, 2) is not None for s in socks)
    for s in socks:
        s.close()
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_echoed_names_and_paths_are_cut(small):
    url, _ = small
    r = httpx.post(url + COMPLETIONS, json={"model": "m" * 150_000, "prompt": "x"}, timeout=10)
    assert r.status_code == 404 and len(r.content) < 1000 and "150000 characters" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/models/" + "n" * 5000, timeout=10)
    assert r.status_code == 404 and len(r.content) < 1000
    r = httpx.post(url + COMPLETIONS, json={"model": MODEL, "prompt": "x", "max_tokens": "y" * 100_000}, timeout=10)
    assert r.status_code == 400 and len(r.content) < 1000


def endpoint_labels(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split('endpoint="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("ddtree:requests_total{")}


def test_metric_labels_come_from_the_routes(small):
    url, _ = small
    with httpx.Client(timeout=5) as client:
        for _ in range(100):
            name = uuid.uuid4().hex
            client.get(f"{url}/v1/models/{name}")
            client.post(f"{url}/{name}", json={})
            client.post(f"{url}/v1/{name}", content=b"{" * 10)
    routes = {"/v1/models", "/v1/models/{name:path}", "/v1/completions", "/v1/chat/completions", "/health",
              "/metrics", "/tokenize", "/detokenize", "/version", "/ping", "other"}
    labels = endpoint_labels(url)
    assert labels <= routes and "/v1/models/{name:path}" in labels, labels


def health_latencies(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=5) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)
    return out


def maximal_bodies(limit: int, values: int) -> list[bytes]:
    """Bodies at the default limits: the largest string, the most ids, containers and strings allowed
    (escaped surrogate pairs: the strings are walked), and the work the scan refuses (a body of nothing
    but strings or brackets)."""
    head = f'{{"model": "{MODEL}", "max_tokens": 1, "prompt": '.encode()
    return [head + b'"' + b"a" * (limit - len(head) - 3) + b'"}',
            head + b"[" + b",".join([b"1"] * (values - 10)) + b"]}",
            head + b"[" + b",".join([b"[]"] * 16000) + b"]}",
            head + b"[" + b",".join([b'"\\ud83d\\ude00"'] * (values - 10)) + b"]}",
            head + b"[" + b'"",' * (limit // 4) + b'""]}',
            head + b"[" * (limit // 2) + b"]}"]


def abuse(url: str, seconds: float) -> None:
    """Posts the maximal bodies in turn for `seconds` (run in its own process: the client's work must not
    share the measuring process's interpreter)."""
    bodies = maximal_bodies(8 << 20, 896 + 65536)          # the defaults on the tiny model
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < deadline:
            for body in bodies:
                r = client.post(url + COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
                assert r.status_code in (200, 400), r.text[:300]


def test_health_answers_within_100_ms_while_maximal_requests_are_parsed(server):
    import multiprocessing
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=abuse, args=(server, 4.0), daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        time.sleep(1.5)                                     # the clients are up and posting
        busy = health_latencies(server, 40)
    finally:
        for w in workers:
            w.join(60)
    assert all(w.exitcode == 0 for w in workers)
    assert statistics.median(busy) < 0.1 and sorted(busy)[int(0.9 * len(busy))] < 0.1, sorted(busy)


def test_sigterm_ends_in_bounded_time_with_stuck_clients():
    with live_server(*SMALL[:2], "--body-timeout-seconds", "60", "--head-timeout-seconds", "60",
                     "--shutdown-timeout-seconds", "1") as (url, proc):
        stuck = []
        for _ in range(5):
            s = connect(url)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            stuck.append(s)
        idle = [connect(url) for _ in range(5)]
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        assert time.monotonic() - t0 < 8 and proc.returncode == 0, proc.stdout.read()
        for s in stuck + idle:
            s.close()
