"""The router's HTTP app: OpenAI endpoints, health, metrics."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from baton.router.admission import AdmissionQueue
from baton.router.asgi_io import MAX_BODY_BYTES
from baton.router.auth import authorized, expected_header
from baton.router.completions import CompletionRoutes, CompletionService
from baton.router.discovery import Discovery
from baton.router.dispatch import RESERVE_HEADROOM_TOKENS, Deadlines, Dispatcher
from baton.router.metrics import RouterMetrics
from baton.router.placements import placement_summary
from baton.router.policy import DECODE_ROLES
from baton.router.pool import WorkerPool
from baton.router.protocol import ApiError
from baton.router.threshold import DEFAULT_STALL_WEIGHT, ThresholdEstimator
from baton.router.tokenizing import ModelInfo
from baton.router.worker_client import WorkerClient


@dataclass
class RouterConfig:
    block_size: int = 16  # the workers' KV block size: prefix hashes must match theirs
    api_key: str | None = None
    internal_token: str | None = None
    disagg_threshold: float | None = None  # None = auto
    stall_weight: float = DEFAULT_STALL_WEIGHT  # what others' lost time counts for (threshold.py)
    max_running: int = 256
    max_waiting: int = 1024
    poll_interval_s: float = 0.5
    token_timeout_s: float = 60.0
    max_body_bytes: int = MAX_BODY_BYTES
    reserve_headroom_tokens: int = RESERVE_HEADROOM_TOKENS  # see dispatch.py
    deadlines: Deadlines = field(default_factory=Deadlines)
    prefix_affinity: bool = True  # decode workers chosen for cached prefixes too (policy.rank_decode)


def _error(err: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(model: ModelInfo, discovery: Discovery, config: RouterConfig | None = None) -> FastAPI:
    config = config or RouterConfig()
    metrics = RouterMetrics()
    estimator = ThresholdEstimator(fixed=config.disagg_threshold, stall_weight=config.stall_weight)
    client = WorkerClient(config.internal_token, token_timeout_s=config.token_timeout_s)
    pool = WorkerPool(client, estimator, poll_interval_s=config.poll_interval_s)
    dispatcher = Dispatcher(pool, client, estimator, config.block_size, metrics, config.deadlines,
                            reserve_headroom_tokens=config.reserve_headroom_tokens,
                            prefix_affinity=config.prefix_affinity)
    admission = AdmissionQueue(config.max_running, config.max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(discovery.run(pool), name="discovery"),
                 asyncio.create_task(pool.run(), name="worker-poll")]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
            service.parsers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Baton router", lifespan=lifespan)
    app.state.pool, app.state.dispatcher, app.state.estimator = pool, dispatcher, estimator

    expected = expected_header(config.api_key)
    unauthorized = ApiError(401, "missing or wrong API key", "authentication_error", code="invalid_api_key")

    service = CompletionService(model, dispatcher, admission, metrics, config.api_key,
                                config.max_body_bytes)
    app.add_middleware(CompletionRoutes, service=service)  # /v1/completions, /v1/chat/completions

    # every answer, the framework's own 404/405/422 included, has OpenAI's error shape
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(ApiError(exc.status_code, message, code=code), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(ApiError(422, f"{request.method} {request.url.path}: invalid request"))

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request.scope, expected):
            return _error(unauthorized)
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                            "owned_by": "baton", "max_model_len": model.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        usable = [w for w in pool.snapshots() if w.accepts_work and w.role in DECODE_ROLES]
        return JSONResponse({"ready": bool(usable), "decode_workers": len(usable)},
                            status_code=200 if usable else 503)

    @app.get("/router/state")  # worker addresses and load: for operators, behind the key
    async def router_state(request: Request):
        if not authorized(request.scope, expected):
            return _error(unauthorized)
        return {"workers": [w.__dict__ for w in pool.snapshots()], "threshold": estimator.explain(),
                "admission": {"running": admission.running, "waiting": admission.waiting}}

    @app.get("/router/placements")  # the last prompts' paths and what chose them (placements.py)
    async def router_placements(request: Request):
        if not authorized(request.scope, expected):
            return _error(unauthorized)
        raw = request.query_params.get("limit")
        limit = int(raw) if raw is not None and raw.isdigit() and int(raw) > 0 else None
        if raw is not None and limit is None:
            return _error(ApiError(400, f"limit must be a whole number of placements >= 1, got {raw!r}",
                                   param="limit"))
        recent = dispatcher.placements.recent(limit)
        return {"total": dispatcher.placements.total, "summary": placement_summary(recent),
                "placements": [p.as_json() for p in recent]}

    @app.get("/metrics")
    async def prometheus():
        metrics.running.set(admission.running)
        metrics.waiting.set(admission.waiting)
        metrics.threshold.set(min(estimator.threshold(), 1e12))
        metrics.workers.clear()
        for w in pool.snapshots():
            metrics.workers.labels(w.role, str(w.accepts_work).lower()).inc()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app

