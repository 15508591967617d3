"""Run the real router app in the test's event loop, on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import uvicorn

from baton.router.app import RouterConfig, create_app
from baton.router.discovery import StaticDiscovery
from baton.router.main import SERVER_OPTIONS


@contextlib.asynccontextmanager
async def running_router(model_info, urls: list[str], wait_ready: bool = True,
                         **settings) -> AsyncIterator[str]:
    settings.setdefault("poll_interval_s", 0.05)
    app = create_app(model_info, StaticDiscovery(urls), RouterConfig(**settings))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           **SERVER_OPTIONS))  # as `baton router` serves
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        if wait_ready:
            await wait_router_ready(url)
        yield url
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def wait_router_ready(url: str, timeout_s: float = 10.0) -> None:
    async with httpx.AsyncClient() as http:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (await http.get(f"{url}/ready")).status_code != 200:
            assert asyncio.get_running_loop().time() < deadline, "router never saw a decode worker"
            await asyncio.sleep(0.05)
