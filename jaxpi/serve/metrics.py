"""`GET /metrics` of `jaxpi serve`: Prometheus counters, gauges and a latency histogram.

    jaxpi_requests_total{method, path, status}     answered requests
    jaxpi_prompt_tokens_total                      prompt tokens of answered requests
    jaxpi_generation_tokens_total                  sampled tokens of answered requests
    jaxpi_requests_running                         requests being answered now
    jaxpi_rows_waiting                             engine rows queued, not yet in an engine call
    jaxpi_request_latency_seconds{path}            request latency, first byte in to last byte out

Each server has its own registry (two servers in one process count apart). `path` is a known
route or "other", so a scan of random URLs does not grow the label set.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/jaxpi/stats")
# Seconds: a health check at the low end, a long reasoning turn at the high end.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, waiting: Callable[[], float] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "jaxpi_requests", "Answered HTTP requests", ("method", "path", "status"), registry=r
        )
        self.prompt_tokens = Counter("jaxpi_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter(
            "jaxpi_generation_tokens", "Sampled tokens of answered requests", registry=r
        )
        self.running = Gauge("jaxpi_requests_running", "Requests being answered now", registry=r)
        self.waiting = Gauge(
            "jaxpi_rows_waiting", "Engine rows queued and not yet in an engine call", registry=r
        )
        if waiting is not None:
            self.waiting.set_function(waiting)
        self.latency = Histogram(
            "jaxpi_request_latency_seconds",
            "Request latency: request read to answer sent",
            ("path",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    @staticmethod
    def route(path: str) -> str:
        return path if path in ROUTES else "other"

    def observe(
        self, method: str, path: str, status: int, seconds: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        route = self.route(path)
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)
