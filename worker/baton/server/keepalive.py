"""How long worker connections stay open between requests, on both ends.

A worker closes a connection that has been idle for `SERVER_IDLE_S`. A client that reuses a
connection just as the worker closes it gets "server disconnected" instead of an answer, and
a caller polling at about that interval (the autoscaler's 5-s period) met that race on 2 of
24 polls. Clients of workers therefore drop idle connections after `CLIENT_IDLE_S`, well
before the worker does.
"""

from __future__ import annotations

import httpx

SERVER_IDLE_S = 5  # uvicorn's timeout_keep_alive
CLIENT_IDLE_S = 2.0


def worker_http_client(**options) -> httpx.AsyncClient:
    """An httpx client for calls to workers; `options` as for httpx.AsyncClient."""
    return httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=CLIENT_IDLE_S), **options)
