"""A loopback stand-in for `baton worker` (docs/contracts.md) with switchable faults.

Its "model" continues a fixed script of token ids: a prompt that already ends with the
first k script tokens gets the rest, so a re-issued request resumes where it broke off.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

REGISTRY: dict[str, FakeWorker] = {}  # url -> worker, so prefill can reach decode


class FakeWorker:
    def __init__(self, role: str, script: list[int], eos: int, token_delay_s: float = 0.002,
                 token: str | None = None):
        self.role, self.script, self.eos = role, script, eos
        self.token_delay_s = token_delay_s
        self.token = token
        self.state = "active"
        self.refuse_reserves = 0  # answer 409 this many times
        self.fail_prefills = 0  # answer 500 this many times
        self.die_after_tokens: int | None = None  # drop the connection after n streamed tokens
        self.queue_timeouts = 0  # answer this many generate calls 429 queue_timeout (pool full)
        self.prefill_seconds_per_token: float | None = None  # its own rate, as its state says
        self.decodes_past_objective = False  # its decodes alone outrun their TPOT objective, as its state says
        self.prefill_delay_s = 0.0  # how long a prefill takes
        self.first_token_delay_s = 0.0  # how long a generate call prefills before its first token
        self.calls: list[tuple[str, str]] = []  # (path, request_id)
        self.aborted: list[str] = []
        self.reserved: dict[str, dict] = {}
        self.auth_failures = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    # -- the "model" ------------------------------------------------------------------------
    def continuation(self, prompt: list[int], params: dict) -> list[int]:
        done = max((k for k in range(len(self.script) + 1) if k <= len(prompt)
                    and prompt[len(prompt) - k:] == self.script[:k]), default=0)
        rest = self.script[done:] + [self.eos]
        return rest[: params.get("max_tokens", 16)]

    # -- HTTP -------------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        ok = not self.token or request.headers.get("Authorization") == f"Bearer {self.token}"
        self.auth_failures += not ok
        return ok

    async def _body(self, request: web.Request, path: str) -> dict:
        body = await request.json()
        self.calls.append((path, body.get("request_id", "")))
        return body

    async def state_handler(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "token"}}, status=401)
        return web.json_response({"role": self.role, "state": self.state, "running": 0,
                                  "waiting": 0, "kv_usage": 0.1,
                                  "prefill_seconds_per_token": self.prefill_seconds_per_token,
                                  "decodes_past_objective": self.decodes_past_objective})

    async def reserve(self, request: web.Request) -> web.Response:
        body = await self._body(request, "reserve")
        if self.refuse_reserves > 0:
            self.refuse_reserves -= 1
            return web.json_response({"error": {"message": "KV pool full"}}, status=409)
        self.reserved[body["request_id"]] = body
        return web.json_response({"ticket": {"request_id": body["request_id"], "kv_endpoint": self.url}})

    async def prefill(self, request: web.Request) -> web.Response:
        body = await self._body(request, "prefill")
        if self.fail_prefills > 0:
            self.fail_prefills -= 1
            return web.json_response({"error": {"message": "boom"}}, status=500)
        await asyncio.sleep(self.prefill_delay_s)
        decode = REGISTRY[body["ticket"]["kv_endpoint"]]
        tokens = decode.continuation(body["prompt_token_ids"], body["params"])
        transfer = {"bytes": 1000 * len(body["prompt_token_ids"]), "transfer_seconds": 0.001, "wire_seconds": 0.001,
                    "prefill_seconds": max(0.0001 * len(body["prompt_token_ids"]), self.prefill_delay_s)}
        if self.prefill_seconds_per_token:  # its step costs, as a real prefill worker reports them
            transfer["prefill_seconds_per_token"] = self.prefill_seconds_per_token
        return web.json_response({"first_token": tokens[0], "transfer": transfer})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "generate")
        if self.queue_timeouts > 0:  # queued until the deadline without room (the contract's 429)
            self.queue_timeouts -= 1
            error = {"message": f"no room to run {body['request_id']!r} within 1s", "type": "overloaded",
                     "code": "queue_timeout"}
            return web.json_response({"error": error}, status=429)
        return await self._stream(request, body["request_id"], body["prompt_token_ids"], body["params"],
                                  self.first_token_delay_s)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["request_id"]
        self.calls.append(("stream", rid))
        body = self.reserved.pop(rid)
        return await self._stream(request, rid, body["prompt_token_ids"], body["params"])

    async def _stream(self, request, rid, prompt, params, first_token_delay_s: float = 0.0) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        tokens = self.continuation(prompt, params)
        await asyncio.sleep(first_token_delay_s)
        for i, token in enumerate(tokens):
            if self.die_after_tokens is not None and i >= self.die_after_tokens:
                self.die_after_tokens = None
                request.transport.close()  # the worker "dies" mid-stream
                return response
            await asyncio.sleep(self.token_delay_s)
            last = i == len(tokens) - 1
            reason = None if not last else ("stop" if token == self.eos else "length")
            event = {"request_id": rid, "token_ids": [token], "text": "", "finish_reason": reason,
                     "num_prompt_tokens": len(prompt), "num_cached_tokens": 0, "logprobs": None}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.append(request.match_info["request_id"])
        return web.json_response({})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def start(self) -> FakeWorker:
        app = web.Application()
        app.router.add_get("/internal/state", self.state_handler)
        app.router.add_post("/internal/reserve", self.reserve)
        app.router.add_post("/internal/prefill", self.prefill)
        app.router.add_post("/internal/generate", self.generate)
        app.router.add_get("/internal/stream/{request_id}", self.stream)
        app.router.add_post("/internal/abort/{request_id}", self.abort)
        app.router.add_get("/metrics", self.metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        REGISTRY[self.url] = self
        return self

    async def stop(self) -> None:
        REGISTRY.pop(self.url, None)
        if self._runner is not None:
            await self._runner.cleanup()

    def paths(self, name: str) -> list[str]:
        return [rid for path, rid in self.calls if path == name]


def any_json(value: Any) -> str:
    return json.dumps(value)
