"""The lean worker client: SSE splitting, keep-alive reuse, and every failure mapped to the
exceptions the dispatcher recovers from. A raw asyncio server scripts the worker's bytes."""

from __future__ import annotations

import asyncio
import json

import pytest

from baton.router.sse import DONE, SseLines
from baton.router.worker_client import (
    ACCEPTED,
    WorkerClient,
    WorkerRefused,
    WorkerRejected,
    WorkerUnavailable,
)


def event(i: int, reason: str | None = None) -> bytes:
    return b"data: " + json.dumps({"token_ids": [i], "finish_reason": reason}).encode() + b"\n\n"


def chunked(*parts: bytes, end: bool = True) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    out += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + (b"0\r\n\r\n" if end else b"")


def plain(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(body), body)


class ScriptedWorker:
    """Answers each request with the next scripted action: bytes to write, "pause",
    "close" (drop the connection), or "silent" (say nothing)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if answer == "silent":
                    await asyncio.sleep(10)
                for part in answer if isinstance(answer, tuple) else (answer,):
                    if part == "close":
                        writer.close()
                        return
                    if part == "pause":
                        await asyncio.sleep(0.3)
                        continue
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()


async def collect(client: WorkerClient, url: str) -> list[dict]:
    """The stream's events after the acceptance that opens every stream."""
    events = [e async for e in client.generate(url, "r1", [1, 2, 3], {"max_tokens": 2})]
    assert events[0] is ACCEPTED
    return events[1:]


def test_sse_lines_survive_any_split():
    stream = (event(1) + b": comment\r\nevent: x\r\n" + "data: {\"t\": \"é✓\"}\r\n\r\n".encode()
              + event(2, "stop") + b"data: [DONE]\n\n")
    for cut in range(1, 12):
        lines, out = SseLines(), []
        for start in range(0, len(stream), cut):
            out += lines.feed(stream[start:start + cut])
        assert out == [{"token_ids": [1], "finish_reason": None}, {"t": "é✓"},
                       {"token_ids": [2], "finish_reason": "stop"}, DONE]


@pytest.mark.asyncio
async def test_one_connection_for_sequential_streams_and_auth_sent():
    body = chunked(event(1, "length"), b"data: [DONE]\n\n")
    worker = ScriptedWorker(body, body)
    async with worker as url:
        client = WorkerClient("secret")
        await collect(client, url)
        await collect(client, url)
        await client.close()
    assert worker.connections == 1
    assert all(b"Authorization: Bearer secret\r\n" in r and r.endswith(b'"max_tokens":2}}')
               for r in worker.requests)


@pytest.mark.asyncio
async def test_a_stream_left_early_is_not_reused():
    body = chunked(event(1), event(2, "length"), b"data: [DONE]\n\n")
    worker = ScriptedWorker((chunked(event(1), end=False), "pause", b"0\r\n\r\n"), body)
    async with worker as url:
        client = WorkerClient()
        events = client.generate(url, "r1", [1], {})
        assert await anext(events) is ACCEPTED  # the status came first
        assert (await anext(events))["token_ids"] == [1]
        await events.aclose()
        await collect(client, url)
        await client.close()
    assert worker.connections == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("answer,error", [
    (plain(409, b'{"error": {"message": "KV full"}}'), WorkerRefused),
    (plain(400, b'{"error": {"message": "bad"}}'), WorkerRejected),
    (plain(500, b"boom"), WorkerUnavailable),
    (chunked(event(1)), WorkerUnavailable),  # ended without [DONE]
    ((chunked(event(1), end=False), "close"), WorkerUnavailable),  # dropped mid-stream
    (chunked(b"data: {not json\n\n"), WorkerUnavailable),
    (chunked(b'data: {"error": "engine died"}\n\n'), WorkerUnavailable),
    (b"SMTP ready\r\n\r\n", WorkerUnavailable),
    ("silent", WorkerUnavailable),  # past the per-token timeout
])
async def test_failures_map_to_the_dispatchers_exceptions(answer, error):
    async with ScriptedWorker(answer) as url:
        client = WorkerClient(token_timeout_s=0.3)
        with pytest.raises(error):
            await collect(client, url)
        await client.close()


@pytest.mark.asyncio
async def test_refused_connection_is_unavailable():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(WorkerUnavailable):
        await collect(WorkerClient(), f"http://127.0.0.1:{port}")


@pytest.mark.asyncio
async def test_idle_connection_closed_by_the_worker_is_retried_on_a_new_one():
    body = chunked(event(1, "length"), b"data: [DONE]\n\n")
    worker = ScriptedWorker((body, "close"), body)  # closes right after the first answer
    async with worker as url:
        client = WorkerClient()
        await collect(client, url)
        await asyncio.sleep(0.05)
        assert [e["token_ids"] for e in await collect(client, url)] == [[1]]
        await client.close()
    assert worker.connections == 2


@pytest.mark.asyncio
async def test_request_met_by_a_closing_connection_is_sent_again():
    body = chunked(event(1, "length"), b"data: [DONE]\n\n")
    worker = ScriptedWorker(body, "close", body)  # the 2nd request finds the connection closing
    async with worker as url:
        client = WorkerClient()
        await collect(client, url)
        assert [e["token_ids"] for e in await collect(client, url)] == [[1]]
        await client.close()
    assert worker.connections == 2 and len(worker.requests) == 3


def test_read_body_refuses_an_oversized_body_without_buffering_it():
    import asyncio

    from baton.router.asgi_io import BodyTooLarge, read_body

    async def scenario():
        chunks = iter([{"type": "http.request", "body": b"x" * 600, "more_body": True}] * 10)

        async def receive():
            return next(chunks)

        with pytest.raises(BodyTooLarge):
            await read_body(receive, limit=1000)
        whole = iter([{"type": "http.request", "body": b"ab", "more_body": True},
                      {"type": "http.request", "body": b"cd", "more_body": False}])

        async def receive_small():
            return next(whole)

        assert await read_body(receive_small, limit=1000) == b"abcd"

    asyncio.run(scenario())
