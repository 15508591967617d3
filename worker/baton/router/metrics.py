"""The router's own Prometheus metrics (one registry per router, so tests can make many)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("baton_router_requests", "client requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.routes = Counter("baton_router_routes", "prefill placements: local (on the decode worker) or remote",
                              ["path"], registry=r)
        self.retries = Counter("baton_router_retries", "recoveries by cause", ["reason"], registry=r)
        self.ttft = Histogram("baton_router_time_to_first_token_seconds", "TTFT seen by the router",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("baton_router_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("baton_router_prompt_tokens", "prompt tokens received", registry=r)
        self.generation_tokens = Counter("baton_router_generation_tokens", "tokens streamed", registry=r)
        self.running = Gauge("baton_router_requests_running", "admitted requests in flight", registry=r)
        self.waiting = Gauge("baton_router_requests_waiting", "requests queued for admission", registry=r)
        self.threshold = Gauge("baton_router_disagg_threshold_tokens",
                               "uncached prompt length from which prefill goes remote", registry=r)
        self.workers = Gauge("baton_router_workers", "workers by role and whether they take work",
                             ["role", "usable"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
