"""The worker's HTTP API (docs/contracts.md). Handlers are thin: model work runs on the
engine thread (AsyncEngine.call), KV traffic on the transport loops."""


import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from baton.kv.ticket import Ticket
from baton.kv.transport import TransferError
from baton.server import params as P
from baton.server.errors import ApiError, bad_request, conflict, not_found
from baton.server.migration import NoRoom
from baton.server.peers import PeerError
from baton.server.prefill import prefill_timeout_default
from baton.server.roles import accepts
from baton.server.streams import relay
from baton.server.worker import Worker

log = logging.getLogger(__name__)
# a migrating sequence's KV: a tensor-parallel worker cannot take it yet (see require)
KV_WORK = ("import",)
TOKEN_TIMEOUT_S = 600.0  # longest silence of a token stream (waiting for KV, long prefill)


def create_app(worker: Worker, start_worker: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        if start_worker:
            await worker.start()
        try:
            yield
        finally:
            await worker.stop()

    app = FastAPI(title="baton worker", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_req, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def authorized(request: Request) -> None:
        if worker.token is None:
            return
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {worker.token}".encode()):
            raise ApiError(401, "missing or wrong internal token", "unauthorized", "unauthorized")

    Authorized = Annotated[None, Depends(authorized)]

    async def ready_worker(_: Authorized) -> Worker:
        if not worker.loaded:
            raise ApiError(503, worker.load_error or "the model is still loading", "unavailable", "loading")
        return worker

    ReadyWorker = Annotated[Worker, Depends(ready_worker)]

    def require(w: Worker, work: str) -> None:
        if w.engine.failure is not None:
            raise ApiError(503, f"the engine is down: {w.engine.failure}", "unavailable", "engine_down")
        if work in KV_WORK and w.engine.config.tensor_parallel_size > 1:
            raise conflict("a tensor-parallel worker does not take migrating sequences yet", "tensor_parallel")
        if not w.lifecycle.accepting:
            raise conflict(f"worker is {w.lifecycle.state}: it takes no new work", "not_accepting")
        if not accepts(w.lifecycle.role, work):
            raise conflict(f"a {w.lifecycle.role} worker does not take {work} requests", "wrong_role")

    # -- probes and metrics ---------------------------------------------------------------
    @app.get("/health")
    async def health():
        # a tensor-parallel group that lost a rank cannot step again: restart the worker
        if worker.loaded and worker.engine.failure is not None:
            return JSONResponse({"status": "failed", "reason": worker.engine.failure}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if worker.loaded and worker.engine.failure is not None:
            return JSONResponse({"status": "failed", "reason": worker.engine.failure}, status_code=503)
        if worker.loaded and worker.lifecycle.accepting:
            return {"status": "ready", "role": worker.lifecycle.role}
        state = worker.lifecycle.state if worker.loaded else "loading"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(worker.metrics.render(worker.engine if worker.loaded else None), media_type=CONTENT_TYPE_LATEST)

    # -- state, drain, role ---------------------------------------------------------------
    @app.get("/internal/state")
    async def state(_: Authorized):
        return worker.state()

    @app.post("/internal/drain", status_code=202)
    async def drain(request: Request, w: ReadyWorker):
        body = await _json(request, allow_empty=True)
        peers = body.get("peers")
        if peers is not None and (not isinstance(peers, list) or not all(isinstance(p, str) for p in peers)):
            raise bad_request("peers: expected a list of worker base URLs")
        w.lifecycle.start_drain(peers)
        return await w.lifecycle.drain_status()

    @app.get("/internal/drain")
    async def drain_status(w: ReadyWorker):
        return await w.lifecycle.drain_status()

    @app.post("/internal/role")
    async def role(request: Request, w: ReadyWorker):
        body = await _json(request)
        try:
            size = body.get("tensor_parallel_size")
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise bad_request("tensor_parallel_size: expected a positive integer")
            return await w.lifecycle.switch_role(body.get("role"), size)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    # -- the handoff ----------------------------------------------------------------------
    @app.post("/internal/reserve")
    async def reserve(request: Request, w: ReadyWorker):
        body = await _json(request)
        rid, ids, sp = P.request_id(body), P.prompt_token_ids(body), P.sampling_params(body.get("params"))
        headroom = P.non_negative_int(body, "headroom_tokens", 0)
        ttl = P.positive_number(body, "ttl_s", w.settings.ticket_ttl_s, 3600)
        require(w, "reserve")
        w.check_request_id_free(rid)
        try:
            ticket = await w.intake.reserve(rid, ids, sp, headroom, ttl)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return {"ticket": ticket.to_dict()}

    @app.post("/internal/prefill")
    async def prefill(request: Request, w: ReadyWorker):
        body = await _json(request)
        rid, ids, sp = P.request_id(body), P.prompt_token_ids(body), P.sampling_params(body.get("params"))
        timeout = P.positive_number(body, "timeout_s", prefill_timeout_default(), 3600)
        try:
            ticket = Ticket.from_dict(body.get("ticket"))
        except (ValueError, TypeError) as exc:
            raise bad_request(f"ticket: {exc}", "invalid_ticket") from None
        require(w, "prefill")
        w.check_request_id_free(rid)
        return await w.prefill.prefill(rid, ids, sp, ticket, timeout)

    @app.post("/internal/import")
    async def import_(request: Request, w: ReadyWorker):
        body = await _json(request)
        state = body.get("state")
        if not isinstance(state, dict) or not isinstance(state.get("request_id"), str):
            raise bad_request("state: expected the exported sequence (a JSON object with request_id)")
        require(w, "import")
        w.check_request_id_free(state["request_id"])
        headroom = P.non_negative_int(body, "headroom_tokens", 16)
        try:
            ticket = await w.intake.accept_import(state, headroom, w.settings.ticket_ttl_s)
        except (KeyError, TypeError, ValueError) as exc:
            raise bad_request(f"state: {exc}") from None
        return {"ticket": ticket.to_dict()}

    @app.post("/internal/migrate")
    async def migrate(request: Request, w: ReadyWorker):
        body = await _json(request)
        rid, target = P.request_id(body), body.get("target")
        if not isinstance(target, str) or not target.startswith(("http://", "https://")):
            raise bad_request("target: expected the target worker's base URL, e.g. http://10.0.0.7:8100")
        try:
            return await w.migrator.migrate(rid, target)
        except NoRoom as exc:
            raise conflict(f"target has no room: {exc}", "kv_pool_full") from None
        except PeerError as exc:
            raise ApiError(502, str(exc), "upstream", exc.code or "upstream") from None
        except (TransferError, TimeoutError) as exc:
            raise ApiError(502, f"moving the KV of {rid!r} failed: {exc!r}", "kv_transfer", "kv_failed") from None
        except ValueError as exc:  # e.g. the target keeps its KV in another dtype
            raise conflict(f"target cannot take {rid!r}: {exc}", "incompatible_target") from None

    # -- tokens ---------------------------------------------------------------------------
    def sse_response(w: Worker, rid: str, queue) -> StreamingResponse:
        stream = relay(w.book, rid, queue, follow=w.peers.follow, on_abandon=lambda r, t: _abandon(w, r, t),
                       token_timeout_s=TOKEN_TIMEOUT_S)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/internal/generate")
    async def generate(request: Request, w: ReadyWorker):
        body = await _json(request)
        rid, ids, sp = P.request_id(body), P.prompt_token_ids(body), P.sampling_params(body.get("params"))
        require(w, "generate")
        w.check_request_id_free(rid)
        w.book.open(rid)
        _, started = waiter = w.admissions.waiter()
        arrived = time.monotonic()

        def add(engine) -> None:
            engine.add_request(ids, sp, rid, arrival_time=arrived)
            w.admissions.watch(rid, waiter)

        try:
            await w.ae.call(add)
        except ValueError as exc:
            w.admissions.forget(rid)
            w.book.close(rid)
            raise bad_request(str(exc)) from None
        except BaseException:
            w.admissions.forget(rid)
            w.book.close(rid)  # no stream left behind for a request that never started
            raise
        await _wait_started(w, rid, started, request)
        return sse_response(w, rid, w.book.claim(rid))

    @app.get("/internal/stream/{request_id}")
    async def stream(request_id: str, w: ReadyWorker):
        queue = w.book.claim(request_id)
        if queue is None:
            raise not_found(f"no unclaimed stream for request {request_id!r} on this worker")
        return sse_response(w, request_id, queue)

    @app.post("/internal/abort/{request_id}")
    async def abort(request_id: str, w: ReadyWorker):
        if not await w.stop_request(request_id):
            raise not_found(f"no live request {request_id!r} on this worker")
        return {"request_id": request_id, "aborted": True}

    @app.post("/internal/tokenize")
    async def tokenize(request: Request, w: ReadyWorker):
        body = await _json(request)
        text = body.get("text")
        if not isinstance(text, str) or not text:
            raise bad_request("text: expected a non-empty string")
        return {"token_ids": w.engine.tokenizer.encode(text)}

    return app


async def _wait_started(w: Worker, rid: str, started, request: Request) -> None:
    """Hold the answer until the engine runs the request: a 200 means it is running. Past the
    queue deadline (no KV room, full batch) it is dropped with a 429; a caller that leaves
    meanwhile takes it out of the queue."""
    deadline = asyncio.get_running_loop().time() + w.settings.queue_timeout_s
    try:
        while not started.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise ApiError(429, f"no room to run {rid!r} within {w.settings.queue_timeout_s:g}s (the "
                               "worker's KV pool or batch is full); retry later", "overloaded", "queue_timeout")
            try:
                await asyncio.wait_for(started.wait(), min(left, 0.5))
            except TimeoutError:
                if await request.is_disconnected():
                    raise ApiError(499, f"the caller of {rid!r} left while it was queued", "gone",
                                   "client_closed") from None
    except BaseException:
        w.admissions.forget(rid)
        await asyncio.shield(w.stop_request(rid))
        w.book.close(rid)
        raise


async def _abandon(w: Worker, request_id: str, target: str | None) -> None:
    if target is not None:
        await w.migrator.forward_abort(request_id)
    else:
        await w.stop_request(request_id)


async def _json(request: Request, allow_empty: bool = False) -> dict:
    raw = await request.body()
    if not raw and allow_empty:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"body: not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("body: expected a JSON object")
    return body

