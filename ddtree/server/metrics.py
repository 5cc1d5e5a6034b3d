"""Prometheus metrics of one server (GET /metrics, the text format) after vLLM's names and conventions: prefix
`ddtree:`, every series labelled `model_name` (the first --served-model-name, as vLLM), in a registry of its
own so two apps in one process (tests) never share counters.

    ddtree:requests_total{endpoint, status}              answered requests by route and HTTP status
    ddtree:request_success_total{finished_reason}        finished generations: stop | length | tool_calls | abort
    ddtree:prompt_tokens_total, ddtree:generation_tokens_total
    ddtree:num_requests_waiting, ddtree:num_requests_running    the queue (running one not counted); 0 or 1
    ddtree:spec_decode_num_drafts_total                  DDTree steps (one drafted tree each)
    ddtree:spec_decode_num_draft_tokens_total            drafted tree nodes (the budget of each step)
    ddtree:spec_decode_num_accepted_tokens_total         drafted tokens committed (a step's tokens minus its bonus)
    ddtree:spec_decode_num_accepted_tokens_per_pos_total{position}   steps whose accepted path reached depth
                                                         position + 1 (position 0 = the first drafted token)
    ddtree:accept_length                                 tokens committed per DDTree step (bonus included)
    ddtree:step_seconds                                  wall time of one DDTree step
    ddtree:time_to_first_token_seconds                   arrival -> first committed token (queue wait + prefill)
    ddtree:inter_token_latency_seconds                   a step's time / the tokens it committed, once per token
    ddtree:e2e_request_latency_seconds                   arrival -> last token

vLLM's mean acceptance length is 1 + accepted / drafts (the bonus token counted), from the same counters.
A DDTree draft is a tree, so draft tokens / drafts is the budget, not a chain length.
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
PREFIX = "ddtree:"


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "ddtree"):
        r = self.registry = CollectorRegistry()
        self.model_name = model_name

        def counter(name, doc, labels=()):
            family = Counter(PREFIX + name, doc, ["model_name", *labels], registry=r)
            return family if labels else family.labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, ["model_name"], registry=r).labels(model_name)

        self._requests = counter("requests", "Answered requests", ("endpoint", "status"))
        self._success = counter("request_success", "Finished generations by finish reason", ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.queue_depth = gauge("num_requests_waiting", "Requests waiting for the engine")
        self.running = gauge("num_requests_running", "Requests the engine is generating")
        self.num_drafts = counter("spec_decode_num_drafts", "DDTree steps (drafted trees)")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tree nodes")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted tokens committed")
        self._accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Steps whose accepted path reached this drafted position", ("position",))
        self.accept_length = histogram("accept_length", "Tokens committed per DDTree step", ACCEPT_BUCKETS)
        self.step_seconds = histogram("step_seconds", "Wall time of one DDTree step", LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Step time per committed token", LATENCY_BUCKETS)
        self.request_seconds = histogram("e2e_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS)

    def answered(self, endpoint: str, status: int | str) -> None:
        self._requests.labels(self.model_name, endpoint, str(status)).inc()

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def step(self, seconds: float, n_tokens: int, draft_tokens: int | None = None) -> None:
        """One DDTree step that committed n_tokens (the prefill's first token is not a step) from a tree of
        draft_tokens nodes (None: an AR step, no draft)."""
        self.step_seconds.observe(seconds)
        self.accept_length.observe(n_tokens)
        for _ in range(n_tokens):
            self.itl.observe(seconds / n_tokens)
        if draft_tokens is None:
            return
        accepted = max(n_tokens - 1, 0)
        self.num_drafts.inc()
        self.num_draft_tokens.inc(draft_tokens)
        self.num_accepted_tokens.inc(accepted)
        for position in range(accepted):
            self._accepted_per_pos.labels(self.model_name, str(position)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
