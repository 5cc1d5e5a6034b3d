"""`ddtree serve --device cuda --max-num-seqs 4` (issue 51): 16 concurrent clients (plus two that hang up mid-stream)
on the GPU's request lanes and batched step graphs, under --kernel-plan batch-invariant, each get exactly the tokens
of the same request run alone in-process on the GPU with its seed; the batch really runs several at once (never
more than 4); the queue and the gauges are empty after."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra")
from tests.server.conftest import live_server, metric, wait_idle  # noqa: E402
from tests.server.test_batching import N_CLIENTS, alone, clients_at_once, request_of  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_engine():
    from ddtree.runtime.engine import DDTreeEngine
    return DDTreeEngine.load(device="cuda", kernel_plan="batch-invariant")


def test_16_clients_on_4_gpu_lanes(gpu_engine):
    engine = gpu_engine
    bodies = [request_of(engine, i) for i in range(N_CLIENTS)]
    hang_ups = [{**request_of(engine, i), "stream": True, "max_tokens": 200} for i in range(2)]
    expected = [alone(engine, b) for b in bodies]
    with live_server("--device", "cuda", "--kernel-plan", "batch-invariant", "--max-num-seqs", "4", "--max-queue",
                     "32", "--budget", "8", startup_s=300.0) as (url, proc):
        wait_idle(url)
        answers, seen = clients_at_once(url, bodies, hang_ups, timeout=300)
        for i, (status, texts, usage) in enumerate(answers[:N_CLIENTS]):
            assert status == 200, f"client {i}: {status}"
            assert texts == {0: engine.decode(expected[i])}, f"client {i} differs from its request alone"
            assert usage["completion_tokens"] == len(expected[i])
        assert 2 <= max(seen) <= 4, f"running counts seen: {sorted(set(seen))}"
        assert wait_idle(url) == {"status": "ok", "queue": 0, "running": 0}
        assert metric(url, "ddtree:num_requests_waiting") == 0 and metric(url, "ddtree:num_requests_running") == 0
        assert proc.poll() is None
