"""Fake workers for the controller tests: contract metrics in real exposition format, and the
drain/role/state endpoints of docs/contracts.md, on loopback HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROLES = ("prefill", "decode", "both")


@dataclass
class Traffic:
    """A steady load, as the fleet would see it. Rates per second, lengths in tokens."""

    arrival_rate: float = 10.0
    input_len: float = 2000.0
    output_len: float = 20.0
    hit_rate: float = 0.0
    prefill_supply: float = 10_000.0  # uncached tokens/s of one prefill worker while busy
    step_s: float = 0.03  # decode step (inter-token gap)
    batch: float = 8.0  # running sequences per decode worker
    kv_usage: float = 0.4


def per_second(role: str, traffic: Traffic, prefill_workers: int, decode_workers: int) -> dict:
    """What one worker of `role` adds to its counters per second under `traffic`."""
    if role == "prefill":
        demand = traffic.arrival_rate * traffic.input_len * (1 - traffic.hit_rate) / prefill_workers
        busy = min(1.0, demand / traffic.prefill_supply)
        queries = traffic.arrival_rate * traffic.input_len / prefill_workers
        return {"busy": busy, "prompt": busy * traffic.prefill_supply, "queries": queries,
                "hits": queries * traffic.hit_rate}
    requests = traffic.arrival_rate / decode_workers
    generated = requests * traffic.output_len
    return {"requests": requests, "generated": generated, "itl_count": generated,
            "itl_sum": generated * traffic.step_s}


class WorkerMetrics:
    """The worker metrics of docs/contracts.md in their own registry, driven by `advance`."""

    def __init__(self, role: str) -> None:
        self.registry = r = CollectorRegistry()
        by_role = ["role"]
        self.e2e = Histogram("baton_e2e_request_latency_seconds", "e2e", by_role, registry=r)
        self.ttft = Histogram("baton_time_to_first_token_seconds", "ttft", by_role, registry=r)
        self.itl = Histogram("baton_inter_token_latency_seconds", "itl", by_role, registry=r)
        self.exposed = Histogram("baton_kv_exposed_transfer_seconds", "exposed", by_role, registry=r)
        self.running = Gauge("baton_num_requests_running", "running", by_role, registry=r)
        self.waiting = Gauge("baton_num_requests_waiting", "waiting", by_role, registry=r)
        self.kv = Gauge("baton_kv_cache_usage_ratio", "kv", by_role, registry=r)
        self.queries = Counter("baton_prefix_cache_queries", "queries", by_role, registry=r)
        self.hits = Counter("baton_prefix_cache_hits", "hits", by_role, registry=r)
        self.prompt = Counter("baton_prompt_tokens", "prompt", by_role, registry=r)
        self.generated = Counter("baton_generation_tokens", "generated", by_role, registry=r)
        self.busy = Counter("baton_prefill_busy_seconds", "busy", by_role, registry=r)
        self.role_gauge = Gauge("baton_worker_role", "role", by_role, registry=r)
        self.conversions = Counter("baton_role_conversions", "conversions", by_role, registry=r)
        self.role = role
        self._carry: dict[str, float] = {}
        # a scrape between two counters' increments of one tick read them a tick apart: a
        # ratio of their rates over a 4 s window then came out 1.6% off
        self._lock = threading.Lock()
        self.scraped = _ReadUnder(self._lock, r)  # what an exporter thread should serve
        self.set_role(role)

    def set_role(self, role: str) -> None:
        self.role = role
        for name in ROLES:
            self.role_gauge.labels(name).set(1.0 if name == role else 0.0)

    def advance(self, seconds: float, traffic: Traffic, prefill_workers: int,
                decode_workers: int) -> None:
        with self._lock:
            self._advance(seconds, traffic, prefill_workers, decode_workers)

    def _advance(self, seconds: float, traffic: Traffic, prefill_workers: int,
                 decode_workers: int) -> None:
        role = self.role
        rates = per_second(role, traffic, prefill_workers, decode_workers)
        if role == "prefill":
            self.busy.labels(role).inc(rates["busy"] * seconds)
            self.prompt.labels(role).inc(rates["prompt"] * seconds)
            self.queries.labels(role).inc(rates["queries"] * seconds)
            self.hits.labels(role).inc(rates["hits"] * seconds)
            self.running.labels(role).set(0)
            self.waiting.labels(role).set(3)
            return
        for _ in range(self._whole("itl", rates["itl_count"] * seconds)):
            self.itl.labels(role).observe(traffic.step_s)
        for _ in range(self._whole("e2e", rates["requests"] * seconds)):
            self.e2e.labels(role).observe(1.0)
        self.generated.labels(role).inc(rates["generated"] * seconds)
        self.running.labels(role).set(traffic.batch)
        self.waiting.labels(role).set(0)
        self.kv.labels(role).set(traffic.kv_usage)

    def _whole(self, name: str, amount: float) -> int:
        """Histograms count whole observations: carry the fraction to the next tick."""
        total = self._carry.get(name, 0.0) + amount
        whole = int(total)
        self._carry[name] = total - whole
        return whole

    def render(self) -> bytes:
        return generate_latest(self.scraped)


class _ReadUnder:
    """A registry's samples as one tick left them: collected under the lock `advance` holds."""

    def __init__(self, lock: threading.Lock, registry: CollectorRegistry) -> None:
        self._lock, self._registry = lock, registry

    def collect(self):
        with self._lock:
            return list(self._registry.collect())


class FakeWorker:
    """/metrics plus the internal drain, role and state endpoints on host:port."""

    def __init__(self, role: str, host: str = "127.0.0.1", drain_polls: int = 1) -> None:
        self.metrics = WorkerMetrics(role)
        self.host = host
        self.port = 0
        self.state = "active"
        self.drain_polls = drain_polls  # GET /internal/drain answers "draining" this often
        self.calls: list[tuple[str, str, Any]] = []
        self._polls = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def _state(self, _: web.Request) -> web.Response:
        return web.json_response({"role": self.metrics.role, "state": self.state,
                                  "running": 0, "waiting": 0, "kv_usage": 0.0})

    async def _drain(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path, body))
        if request.method == "POST":
            self.state, self._polls = "draining", 0
            return web.json_response({"state": "draining"}, status=202)
        self._polls += 1
        drained = self._polls > self.drain_polls
        if drained:
            self.state = "drained"
        return web.json_response({"state": self.state, "running": 0 if drained else 2})

    async def _role(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append((request.method, request.path, body))
        self.metrics.set_role(body["role"])
        self.metrics.conversions.labels(body["role"]).inc()
        self.state = "active"
        return web.json_response({"role": body["role"]})

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/internal/state", self._state)
        app.router.add_route("*", "/internal/drain", self._drain)
        app.router.add_post("/internal/role", self._role)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@contextlib.asynccontextmanager
async def running_workers(*roles: str):
    """Fake workers of these roles, serving until the block ends (a test may stop one early)."""
    workers = [FakeWorker(role) for role in roles]
    try:
        for worker in workers:
            await worker.start()
        yield workers
    finally:
        for worker in workers:
            await worker.stop()


class FleetDriver:
    """Advances every fake worker's counters in small steps, as steady traffic would."""

    def __init__(self, workers: list[FakeWorker], traffic: Traffic, tick_s: float = 0.05) -> None:
        self.workers = workers
        self.traffic = traffic
        self.tick_s = tick_s
        self._task: asyncio.Task | None = None

    def tick(self, seconds: float) -> None:
        roles = [w.metrics.role for w in self.workers if w.state == "active"]
        prefill, decode = max(1, roles.count("prefill")), max(1, roles.count("decode"))
        for worker in self.workers:
            if worker.state == "active":
                worker.metrics.advance(seconds, self.traffic, prefill, decode)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self.tick_s)
            now = loop.time()
            self.tick(now - last)
            last = now

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
