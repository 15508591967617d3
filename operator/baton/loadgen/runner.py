"""Send the workload and time every streamed chunk (raw SSE over httpx: no client-side
parsing layers between the socket and the clock)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable

import httpx

from baton.loadgen.datasets import RequestSpec
from baton.loadgen.stats import RequestRecord


class Target:
    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                      limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))

    async def close(self) -> None:
        await self.http.aclose()


async def resolve_model(url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1")
    async with httpx.AsyncClient(headers=headers, timeout=30) as http:
        response = await http.get(f"{base}/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def send(target: Target, spec: RequestSpec, index: int, t0: float) -> RequestRecord:
    record = RequestRecord(index=index, kind=spec.kind, prompt_len=len(spec.prompt),
                           start=time.perf_counter() - t0)
    body = {"model": target.model, "prompt": spec.prompt, "max_tokens": spec.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    chunks = 0
    try:
        async with target.http.stream("POST", f"{target.url}/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"].get("message", event["error"]))
                    return record
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        now = time.perf_counter() - started
                        chunks += 1
                        record.chunk_times.append(now)
                        if record.ttft is None:
                            record.ttft = now
        record.e2e = time.perf_counter() - started
        record.output_tokens = record.output_tokens or chunks
        record.success = record.ttft is not None
        if not record.success:
            record.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


async def run_closed_loop(target: Target, specs: list[RequestSpec], concurrency: int,
                          on_done: Callable[[RequestRecord], None],
                          until: Callable[[], bool] | None = None) -> list[RequestRecord]:
    """At most `concurrency` requests in flight, each sent as soon as a slot frees.

    until: once it returns True no further request is sent (those in flight finish); the
    records are of the requests sent.
    """
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(i: int, spec: RequestSpec) -> RequestRecord | None:
        async with gate:
            if until is not None and until():
                return None
            record = await send(target, spec, i, t0)
        on_done(record)
        return record

    records = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    return [r for r in records if r is not None]


async def run_conversations(target: Target, sessions: list[list[RequestSpec]], concurrency: int,
                            on_done: Callable[[RequestRecord], None], think_s: float = 0.0) -> list[RequestRecord]:
    """At most `concurrency` sessions at once, each sending its turns one after another (the
    next `think_s` after the previous reply has ended, as a reader would), the next session as
    soon as one ends."""
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(max(1, concurrency))
    counter = iter(range(10**9))

    async def session(specs: list[RequestSpec]) -> list[RequestRecord]:
        records = []
        async with gate:
            for spec in specs:
                record = await send(target, spec, next(counter), t0)
                on_done(record)
                records.append(record)
                if not record.success:
                    break  # a turn without its reply: the session ends here
                if think_s > 0 and spec is not specs[-1]:
                    await asyncio.sleep(think_s)
        return records

    done = await asyncio.gather(*(session(specs) for specs in sessions))
    return [r for records in done for r in records]


async def run_poisson(target: Target, specs: list[RequestSpec], rate: float, concurrency: int | None,
                      on_done: Callable[[RequestRecord], None], seed: int = 0) -> list[RequestRecord]:
    """Arrivals at `rate` requests/s with exponential gaps (optionally capped in flight)."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    tasks = []

    async def one(i: int, spec: RequestSpec) -> RequestRecord:
        if gate is None:
            record = await send(target, spec, i, t0)
        else:
            async with gate:
                record = await send(target, spec, i, t0)
        on_done(record)
        return record

    for i, spec in enumerate(specs):
        tasks.append(asyncio.create_task(one(i, spec)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def run_interference(target: Target, make_short: Callable[[int], RequestSpec], streams: int,
                           longs: list[RequestSpec], duration_s: float,
                           on_done: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    """`streams` closed loops of short requests for `duration_s`, plus each long prompt at
    its own time."""
    t0 = time.perf_counter()
    records: list[RequestRecord] = []
    counter = iter(range(10**9))

    async def stream_loop() -> None:
        while time.perf_counter() - t0 < duration_s:
            i = next(counter)
            record = await send(target, make_short(i), i, t0)
            records.append(record)
            on_done(record)

    async def long_at(spec: RequestSpec) -> None:
        await asyncio.sleep(max(0.0, spec.at - (time.perf_counter() - t0)))
        record = await send(target, spec, next(counter), t0)
        records.append(record)
        on_done(record)

    await asyncio.gather(*(stream_loop() for _ in range(streams)), *(long_at(s) for s in longs))
    return sorted(records, key=lambda r: r.start)
