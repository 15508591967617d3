"""The router's HTTP app: OpenAI endpoints, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from baton.router import responses
from baton.router.admission import AdmissionQueue, Overloaded
from baton.router.discovery import Discovery
from baton.router.dispatch import Deadlines, Dispatcher, NoCapacity, UpstreamFailed
from baton.router.metrics import RouterMetrics
from baton.router.policy import DECODE_ROLES
from baton.router.pool import WorkerPool
from baton.router.protocol import ApiError, parse_chat, parse_completion
from baton.router.serving import text_deltas
from baton.router.threshold import ThresholdEstimator
from baton.router.tokenizing import ModelInfo
from baton.router.worker_client import WorkerClient, WorkerRejected

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    block_size: int = 16  # the workers' KV block size: prefix hashes must match theirs
    api_key: str | None = None
    internal_token: str | None = None
    disagg_threshold: float | None = None  # None = auto
    max_running: int = 256
    max_waiting: int = 1024
    poll_interval_s: float = 0.5
    token_timeout_s: float = 60.0
    deadlines: Deadlines = field(default_factory=Deadlines)


def _error(err: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(model: ModelInfo, discovery: Discovery, config: RouterConfig | None = None) -> FastAPI:
    config = config or RouterConfig()
    metrics = RouterMetrics()
    estimator = ThresholdEstimator(fixed=config.disagg_threshold)
    client = WorkerClient(config.internal_token, token_timeout_s=config.token_timeout_s)
    pool = WorkerPool(client, estimator, poll_interval_s=config.poll_interval_s)
    dispatcher = Dispatcher(pool, client, estimator, config.block_size, metrics, config.deadlines)
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

    app = FastAPI(title="Baton router", lifespan=lifespan)
    app.state.pool, app.state.dispatcher, app.state.estimator = pool, dispatcher, estimator

    def authorized(request: Request) -> bool:
        return not config.api_key or request.headers.get("authorization") == f"Bearer {config.api_key}"

    async def serve(request: Request, kind: str):
        endpoint = "chat" if kind == "chat" else "completions"
        response = await _serve(request, kind)
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _serve(request: Request, kind: str):
        if not authorized(request):
            return _error(ApiError(401, "missing or wrong API key", "authentication_error",
                                   code="invalid_api_key"))
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(ApiError(400, f"the request body is not valid JSON: {e}"))
        try:
            req = parse_chat(body, model) if kind == "chat" else parse_completion(body, model)
        except ApiError as e:
            return _error(e)
        try:
            await admission.acquire()
        except Overloaded as e:
            return _error(ApiError(429, str(e), "rate_limit_error", code="overloaded"),
                          {"Retry-After": str(e.retry_after_s)})
        started = time.perf_counter()
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        metrics.prompt_tokens.inc(len(req.prompt_ids))
        deltas = text_deltas(dispatcher, model, req, request_id)
        try:
            first = await _first_delta(deltas)
        except BaseException as e:
            admission.release(time.perf_counter() - started)
            await deltas.aclose()
            if isinstance(e, Exception):
                return _error(_api_error(e))
            raise
        metrics.ttft.observe(time.perf_counter() - started)
        if req.stream:
            return StreamingResponse(stream_body(req, kind, request_id, first, deltas, started),
                                     media_type="text/event-stream")
        text, last = first.text, first
        try:
            async with aclosing(deltas):
                while last.finish_reason is None:
                    last = await anext(deltas)
                    text += last.text
        except Exception as e:
            return _error(_api_error(e))
        finally:
            _finish(started, last.completion_tokens)
        body = responses.full_response(kind, request_id, req.model, text, last.finish_reason,
                                       len(req.prompt_ids), last.completion_tokens)
        return JSONResponse(body)

    def _finish(started: float, tokens: int) -> None:
        elapsed = time.perf_counter() - started
        admission.release(elapsed)
        metrics.e2e.observe(elapsed)
        metrics.generation_tokens.inc(tokens)

    async def stream_body(req, kind, request_id, first, deltas, started):
        created = int(time.time())
        last = first
        try:
            async with aclosing(deltas):
                delta, opening = first, True
                while True:
                    if delta.text or delta.finish_reason is not None or opening:
                        yield responses.sse(responses.stream_chunk(
                            kind, request_id, req.model, created, delta.text, delta.finish_reason, opening))
                        opening = False
                    last = delta
                    if delta.finish_reason is not None:
                        break
                    delta = await anext(deltas)
            if req.include_usage:
                yield responses.sse(responses.usage_chunk(kind, request_id, req.model, created,
                                                          len(req.prompt_ids), last.completion_tokens))
        except Exception as e:  # headers are gone: report in-band, then end the stream
            yield responses.sse(_api_error(e).body())
        finally:
            _finish(started, last.completion_tokens)
        yield responses.sse("[DONE]")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return _error(ApiError(401, "missing or wrong API key", "authentication_error"))
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

    @app.get("/router/state")
    async def router_state():
        return {"workers": [w.__dict__ for w in pool.snapshots()], "threshold": estimator.explain(),
                "admission": {"running": admission.running, "waiting": admission.waiting}}

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


async def _first_delta(deltas):
    """Wait for the first text (or the end); errors before it become HTTP errors."""
    return await anext(deltas)


def _api_error(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, WorkerRejected):
        return ApiError(400 if e.status < 500 else 502, str(e))
    if isinstance(e, NoCapacity):
        return ApiError(503, str(e), "server_error", code="no_capacity")
    if isinstance(e, UpstreamFailed | StopAsyncIteration):
        return ApiError(502, str(e) or "the workers ended the request early", "server_error")
    log.exception("request failed", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
