"""The router keeps an idle client connection open past the idle expiry of common clients.

httpx drops an idle connection after 5 s; had the router also closed at 5 s, a client
polling about that often would now and then send into a connection being closed.
"""

from __future__ import annotations

import asyncio

import pytest
from router_harness import running_router

HTTPX_IDLE_EXPIRY_S = 5.0
REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"


async def read_response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + await asyncio.wait_for(reader.readexactly(length), 10)


@pytest.mark.asyncio
async def test_an_idle_connection_outlives_the_clients_own_expiry(model_info):
    async with running_router(model_info, [], wait_ready=False) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(REQUEST)
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(HTTPX_IDLE_EXPIRY_S + 0.5)
            writer.write(REQUEST)
            await writer.drain()
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200"), "the router closed it"
        finally:
            writer.close()
