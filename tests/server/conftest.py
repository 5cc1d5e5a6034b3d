"""A live `ddtree serve` on 127.0.0.1 for the server tests: the real command in a subprocess, on a free
loopback port, the embedded tiny model, --max-queue 8. Startup and shutdown are bounded in time."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest

MODEL = "ddtree-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(*args: str, startup_s: float = 60.0):
    """`python -m ddtree serve ARGS` on a free loopback port -> (base URL, process); SIGTERM at the end."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ddtree", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, f"ddtree serve exited {proc.returncode}:\n{proc.stdout.read()}"
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "ddtree serve did not come up"
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextmanager
def in_process_server(app):
    """`app` served by uvicorn in a thread on a free loopback port -> its base URL; stopped at the end."""
    import threading

    import uvicorn
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def server():
    """The shared server's base URL (tests leave it idle: queue empty, nothing running)."""
    with live_server("--max-queue", "8") as (url, proc):
        yield url
        assert proc.poll() is None, "the server died during the tests"


@pytest.fixture(scope="session")
def engine():
    """The same model in-process: the reference a request run alone must equal."""
    from ddtree.runtime.engine import DDTreeEngine
    return DDTreeEngine.load()


def samples(url: str) -> dict:
    """The server's /metrics parsed by prometheus_client: {(sample name, frozenset(labels)): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(url: str, name: str, **labels) -> float:
    """One sample of the server's /metrics, labelled model_name=MODEL and `labels`."""
    key = (name, frozenset({"model_name": MODEL, **labels}.items()))
    found = samples(url)
    assert key in found, f"{name}{labels} not in /metrics"
    return found[key]


def wait_idle(url: str, timeout_s: float = 30.0) -> dict:
    """Poll /health until nothing waits or runs (bounded) -> the last /health body."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{url}/health", timeout=5).json()
        if body["queue"] == 0 and body["running"] == 0:
            return body
        assert time.monotonic() < deadline, f"the server is still busy: {body}"
        time.sleep(0.05)
