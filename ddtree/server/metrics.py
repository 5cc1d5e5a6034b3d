"""Prometheus metrics of one server (GET /metrics, the text format), in a registry of its own so two
apps in one process (tests) never share counters.

    ddtree_requests_total{endpoint, status}      answered requests by HTTP status
    ddtree_prompt_tokens_total, ddtree_generation_tokens_total
    ddtree_queue_depth                            requests waiting (the running one not counted)
    ddtree_running_requests                       0 or 1: the engine serves one request at a time
    ddtree_accept_length                          tokens committed per DDTree step (bonus included)
    ddtree_step_seconds                           wall time of one DDTree step
    ddtree_time_to_first_token_seconds            arrival -> first committed token (queue wait + prefill)
    ddtree_inter_token_latency_seconds            a step's time / the tokens it committed, once per token
    ddtree_request_seconds                        arrival -> last token
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()           # no *_created series: one sample per counter, as vLLM's /metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ACCEPT_BUCKETS = tuple(range(1, 17)) + (24, 32, 64)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ddtree_requests", "Answered requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("ddtree_generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("ddtree_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("ddtree_running_requests", "Requests the engine is generating", registry=r)
        self.accept_length = Histogram("ddtree_accept_length", "Tokens committed per DDTree step",
                                       buckets=ACCEPT_BUCKETS, registry=r)
        self.step_seconds = Histogram("ddtree_step_seconds", "Wall time of one DDTree step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ddtree_inter_token_latency_seconds", "Step time per committed token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("ddtree_request_seconds", "Arrival to last token",
                                         buckets=LATENCY_BUCKETS, registry=r)

    def step(self, seconds: float, n_tokens: int) -> None:
        """One DDTree step that committed n_tokens (the prefill's first token is not a step)."""
        self.step_seconds.observe(seconds)
        self.accept_length.observe(n_tokens)
        for _ in range(n_tokens):
            self.itl.observe(seconds / n_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)
