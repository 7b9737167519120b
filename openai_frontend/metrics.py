"""The frontend's own Prometheus metrics, served at its /metrics (Triton's stay on Triton's port).

Families (label ``endpoint``: chat_completions, completions, models):
- ``tritonllm_openai_requests_total{endpoint,status}``: counter; status is the HTTP status sent,
  or ``cancelled`` for a client that hung up;
- ``tritonllm_openai_request_duration_seconds{endpoint}``: histogram, arrival to last byte;
- ``tritonllm_openai_time_to_first_token_seconds{endpoint}``: histogram, arrival to the first
  generated text (streamed requests).

With several worker processes (``--workers``) every worker records into the files of
``PROMETHEUS_MULTIPROC_DIR`` (set by __main__ before prometheus_client is imported), and whichever
worker answers /metrics sums them all.
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class FrontendMetrics:
    """One registry per app, so several apps in one process (tests) never collide."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("tritonllm_openai_requests", "Requests to the OpenAI-compatible frontend",
                                ["endpoint", "status"], registry=self.registry)
        self.duration = Histogram("tritonllm_openai_request_duration_seconds",
                                  "Request latency, arrival to last byte", ["endpoint"],
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_token = Histogram("tritonllm_openai_time_to_first_token_seconds",
                                     "Arrival to the first streamed text", ["endpoint"],
                                     buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, endpoint: str, status: str, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, status=status).inc()
        self.duration.labels(endpoint=endpoint).observe(seconds)

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every worker's values, summed
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
