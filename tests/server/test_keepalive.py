"""Clients of workers drop idle connections before the worker does (server/keepalive.py).

A real uvicorn server with the worker's keep-alive setting; the app answers with the
client's port, so a reused connection shows as the same port.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from baton.server.keepalive import CLIENT_IDLE_S, SERVER_IDLE_S, worker_http_client


async def client_port(request):
    return PlainTextResponse(str(request.client.port))


@pytest.fixture
def server_url():
    config = uvicorn.Config(Starlette(routes=[Route("/", client_port)]), host="127.0.0.1", port=0,
                            timeout_keep_alive=SERVER_IDLE_S, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(10)


def test_client_lets_go_of_idle_connections_before_the_worker(server_url):
    async def ports(pause_s: float) -> tuple[str, str]:
        async with worker_http_client(timeout=5) as client:
            first = (await client.get(server_url)).text
            await asyncio.sleep(pause_s)
            return first, (await client.get(server_url)).text

    soon = asyncio.run(ports(0.2))
    assert soon[0] == soon[1], "a connection in use should be kept"
    later = asyncio.run(ports(CLIENT_IDLE_S + 0.5))
    assert later[0] != later[1], "an idle connection was reused past CLIENT_IDLE_S"
    # with room for a poll that arrives a little early or late
    assert CLIENT_IDLE_S <= SERVER_IDLE_S / 2
