"""POST /v1/completions and /v1/chat/completions as plain ASGI, in front of FastAPI.

These two sit on every request's path to its first token, so they skip Starlette's stack
(see asgi_io.py); auth, OpenAI-style errors, admission and metrics are as for any route.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

from baton.router import responses
from baton.router.admission import AdmissionQueue, Overloaded
from baton.router.asgi_io import (
    MAX_BODY_BYTES,
    BodyTooLarge,
    ClientGone,
    DisconnectWatch,
    read_body,
    send_event_stream,
    send_json,
)
from baton.router.auth import authorized, expected_header
from baton.router.dispatch import Dispatcher, NoCapacity, UpstreamFailed
from baton.router.metrics import RouterMetrics
from baton.router.protocol import ApiError, GenerationRequest, parse_body
from baton.router.serving import Delta, text_deltas
from baton.router.tokenizing import ModelInfo
from baton.router.worker_client import WorkerBusy, WorkerRejected

log = logging.getLogger(__name__)

PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
# A body this large is parsed (JSON, chat template, tokens) on a worker thread: the long
# steps there release the GIL (see ModelInfo.encode), so other requests' tokens keep flowing.
OFF_LOOP_BYTES = 64 << 10
PARSE_THREADS = 2  # big bodies queue for these rather than take every core


class CompletionRoutes:
    """ASGI middleware: answers the completion paths itself, passes the rest to `app`."""

    def __init__(self, app, service: CompletionService):
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send) -> None:
        kind = PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None:
            await self.app(scope, receive, send)
        elif scope["method"] != "POST":
            await _send_error(send, ApiError(405, f"{scope['method']} is not allowed on "
                                             f"{scope['path']}; use POST", code="method_not_allowed"),
                              {"Allow": "POST"})
        else:
            await self.service.handle(kind, scope, receive, send)


class CompletionService:
    def __init__(self, model: ModelInfo, dispatcher: Dispatcher, admission: AdmissionQueue,
                 metrics: RouterMetrics, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES):
        self.model, self.dispatcher, self.admission, self.metrics = model, dispatcher, admission, metrics
        self.max_body_bytes = max_body_bytes
        self.parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")
        self.expected_auth = expected_header(api_key)

    async def handle(self, kind: str, scope, receive, send) -> None:
        endpoint = "chat" if kind == "chat" else "completions"
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            status = await self._serve(kind, scope, receive, tracked_send)
        except Exception as e:  # a bug, not bad input: still an OpenAI-shaped answer
            if started:
                raise
            status = await _send_error(send, api_error(e))
        if status is not None:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    async def _serve(self, kind: str, scope, receive, send) -> int | None:
        """Answer the request; return the status sent (None: the client left first)."""
        if not authorized(scope, self.expected_auth):
            return await _send_error(send, ApiError(401, "missing or wrong API key", "authentication_error",
                                                    code="invalid_api_key"))
        try:
            raw = await read_body(receive, self.max_body_bytes, scope)
        except ClientGone:
            return None
        except BodyTooLarge as e:
            return await _send_error(send, ApiError(413, str(e), code="request_too_large"))
        try:
            req = await self._parse(kind, raw)
        except ApiError as e:
            return await _send_error(send, e)
        try:
            await self.admission.acquire()
        except Overloaded as e:
            return await _send_error(send, ApiError(429, str(e), "rate_limit_error", code="overloaded"),
                                     {"Retry-After": str(e.retry_after_s)})
        started = time.perf_counter()
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        deltas = self._timed(text_deltas(self.dispatcher, self.model, req, request_id), started)
        # Until the answer is over, only this watch notices a client that leaves (a remote
        # prefill or a full pool can hold the first token for seconds): it cancels the wait,
        # which closes `deltas` and aborts the request on its workers.
        watch = DisconnectWatch(receive)
        try:
            # Errors until a worker takes the request become HTTP errors; from then on the
            # status is 200 and the headers go out while the prompt is still prefilling.
            first = await anext(deltas)
        except BaseException as e:
            watch.done()
            self.admission.release(time.perf_counter() - started)
            await deltas.aclose()
            if isinstance(e, asyncio.CancelledError) and watch.left():
                return None
            if isinstance(e, Exception):
                return await self._send_failure(send, e)
            raise
        if req.stream:
            events = self._stream_events(req, kind, request_id, first, deltas, started)
            await send_event_stream(receive, send, events, watch)
            return 200
        text, last = first.text, first
        try:
            async with aclosing(deltas):
                while last.finish_reason is None:
                    last = await anext(deltas)
                    text += last.text
        except asyncio.CancelledError:
            if watch.left():
                return None
            raise
        except Exception as e:
            watch.ended = True
            return await self._send_failure(send, e)
        finally:
            watch.ended = True
            watch.done()
            self._finish(started, last.completion_tokens)
        await send_json(send, 200, responses.full_response(
            kind, request_id, req.model, text, last.finish_reason, len(req.prompt_ids), last.completion_tokens))
        return 200

    async def _send_failure(self, send, e: Exception) -> int:
        """The request failed before any byte of its answer went out: an error status, with
        Retry-After when the client should come back (no room on the workers)."""
        err = api_error(e)
        headers = {"Retry-After": str(self.admission.retry_after())} if err.status == 429 else None
        return await _send_error(send, err, headers)

    async def _parse(self, kind: str, raw: bytes) -> GenerationRequest:
        if len(raw) < OFF_LOOP_BYTES:
            return parse_body(kind, raw, self.model)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.parsers, parse_body, kind, raw, self.model)

    async def _timed(self, deltas: AsyncIterator[Delta], started: float) -> AsyncIterator[Delta]:
        """`deltas`, observing the time to the first token on the way."""
        async with aclosing(deltas):
            async for delta in deltas:
                if delta.new_tokens or delta.finish_reason is not None:
                    self.metrics.ttft.observe(time.perf_counter() - started)
                    yield delta
                    break
                yield delta
            async for delta in deltas:
                yield delta

    def _finish(self, started: float, tokens: int) -> None:
        elapsed = time.perf_counter() - started
        self.admission.release(elapsed)
        self.metrics.e2e.observe(elapsed)
        self.metrics.generation_tokens.inc(tokens)

    async def _stream_events(self, req, kind, request_id, first, deltas, started):
        created = int(time.time())
        last = first
        try:
            async with aclosing(deltas):
                # a chat stream opens with the assistant's role before any text, as OpenAI's does.
                # Every generated token gets a chunk, its text empty while it completes no
                # character (a multi-byte one split across tokens, a possible stop string's
                # start), as vLLM's do: clients see each token when it is made.
                delta, opening = first, kind == "chat"
                while True:
                    if delta.text or delta.new_tokens or delta.finish_reason is not None or opening:
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
            yield responses.sse(api_error(e).body())
        finally:
            self._finish(started, last.completion_tokens)
        yield responses.sse("[DONE]")


async def _send_error(send, err: ApiError, headers: dict[str, str] | None = None) -> int:
    await send_json(send, err.status, err.body(), headers)
    return err.status


def api_error(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, WorkerRejected):
        return ApiError(400 if e.status < 500 else 502, str(e))
    if isinstance(e, WorkerBusy):  # the decode pool stayed full for the worker's queue deadline
        return ApiError(429, f"{e}", "rate_limit_error", code="overloaded")
    if isinstance(e, NoCapacity):
        return ApiError(503, str(e), "server_error", code="no_capacity")
    if isinstance(e, UpstreamFailed | StopAsyncIteration):
        return ApiError(502, str(e) or "the workers ended the request early", "server_error")
    log.error("request failed", exc_info=e)  # the details stay in the log, not the answer
    return ApiError(500, "internal error; the router's log has the details", "server_error")
