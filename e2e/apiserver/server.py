"""The API server's HTTP face: REST paths, watches, tables, bearer tokens, a request log.

Every request is recorded with the user its token belongs to, so the RBAC check can ask
afterwards whether the chart's rules allow what each component really did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from . import errors, openapi, protobuf, resources
from .selectors import field_matcher, label_matcher
from .store import Event, Store
from .tables import table

log = logging.getLogger(__name__)
WATCH_DEFAULT_SECONDS = 1800


@dataclass(frozen=True)
class RequestRecord:
    """One API request in the terms RBAC speaks: who, which verb on which resource."""

    user: str
    verb: str
    api_group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int


@dataclass(frozen=True)
class Target:
    group: str
    version: str
    namespace: str | None
    plural: str
    name: str | None
    subresource: str | None


def parse_path(path: str) -> Target | None:
    """/api/v1/... or /apis/G/V/...; None for anything that is not a resource path."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    elif rest[0] == "namespaces" and len(rest) == 2:
        return Target(group, version, None, "namespaces", rest[1], None)
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    if len(rest) > 3:
        return None
    return Target(group, version, namespace, plural, name, sub)


def _verb(method: str, target: Target, watch: bool) -> str:
    if method == "GET":
        return "get" if target.name else ("watch" if watch else "list")
    return {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if target.name else "deletecollection"}.get(method, method.lower())


class ApiServer:
    def __init__(self, store: Store, tokens: dict[str, str], log_path: Path | None = None) -> None:
        self.store = store
        self.log_path = log_path  # every request, one JSON line each, for the RBAC check
        self.tokens = tokens  # bearer token -> user name ("system:serviceaccount:NS:NAME", ...)
        self.requests: list[RequestRecord] = []
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()

    # --- serving ---

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=2)
        await self._runner.setup()
        return await self.listen(host, port, ssl_context)

    async def listen(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Serve on one more address (the `kubernetes` Service's, for in-cluster clients)."""
        assert self._runner is not None
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def _user(self, request: web.Request) -> str | None:
        header = request.headers.get("Authorization", "")
        if not header:
            return "system:anonymous"
        scheme, _, token = header.partition(" ")
        return self.tokens.get(token.strip()) if scheme.lower() == "bearer" else None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        user = self._user(request)
        if user is None:
            return web.json_response(errors.ApiError(401, "Unauthorized", "Unauthorized").status(),
                                     status=401)
        target = parse_path(request.path)
        if target is None:
            return self._discovery(request)
        watch = request.query.get("watch") in ("true", "1")
        verb = _verb(request.method, target, watch)
        if watch:  # a watch lasts minutes: record it when it opens
            self._record(RequestRecord(user, verb, target.group, target.plural, "",
                                       target.namespace or "", "", 200))
        try:
            response = await self._serve(request, target, watch)
            code = response.status
        except errors.ApiError as e:
            response, code = web.json_response(e.status(), status=e.code), e.code
        except (ValueError, json.JSONDecodeError) as e:
            error = errors.bad_request(str(e))
            response, code = web.json_response(error.status(), status=400), 400
        if not watch:
            self._record(RequestRecord(user, verb, target.group, target.plural,
                                       target.subresource or "", target.namespace or "",
                                       target.name or "", code))
        return response

    def _record(self, record: RequestRecord) -> None:
        self.requests.append(record)
        if self.log_path is not None:
            with open(self.log_path, "a") as log:
                log.write(json.dumps(dataclasses.asdict(record)) + "\n")

    def _discovery(self, request: web.Request) -> web.StreamResponse:
        served = self.store.served()
        path = request.path.rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        body: dict[str, Any] | None = None
        if path == "/version":
            body = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-baton-e2e",
                    "platform": "linux/amd64"}
        elif path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        elif path == "/api":
            body = resources.api_versions()
        elif path == "/apis":
            body = resources.api_group_list(served)
        elif parts[:1] == ["apis"] and len(parts) == 2:
            body = resources.api_group(served, parts[1])
        elif parts == ["api", "v1"]:
            body = resources.api_resource_list(served, "", "v1")
        elif parts[:1] == ["apis"] and len(parts) == 3:
            body = resources.api_resource_list(served, parts[1], parts[2])
        elif path == "/openapi/v3":
            body = openapi.index(served)
        elif parts[:3] == ["openapi", "v3", "api"] and len(parts) == 4:
            body = openapi.group_version(served, "", parts[3])
        elif parts[:3] == ["openapi", "v3", "apis"] and len(parts) == 5:
            body = openapi.group_version(served, parts[3], parts[4])
        elif path == "/":
            body = {"paths": ["/api", "/api/v1", "/apis", "/version"]}
        if body is None:
            return web.json_response(errors.ApiError(404, "NotFound", "the server could not find "
                                                     "the requested resource").status(), status=404)
        return web.json_response(body)

    async def _serve(self, request: web.Request, target: Target, watch: bool) -> web.StreamResponse:
        res = self.store.resource(target.group, target.version, target.plural)
        namespace = target.namespace if res.namespaced else None
        query = request.query
        if request.method == "GET" and target.name and not target.subresource:
            obj = self.store.get(res, namespace, target.name)
            return self._respond(request, res, [obj], single=True)
        if request.method == "GET" and target.name and target.subresource == "status":
            return web.json_response(self.store.get(res, namespace, target.name))
        if request.method == "GET" and target.name and target.subresource == "scale":
            return web.json_response(self.store.get_scale(res, namespace, target.name))
        if request.method == "GET":
            match_labels = label_matcher(query.get("labelSelector"))
            match_fields = field_matcher(query.get("fieldSelector"))
            match = lambda o: match_labels(o) and match_fields(o)
            if watch:
                return await self._watch(request, res, namespace, match)
            items = self.store.list(res, namespace, match)
            return self._respond(request, res, items, single=False)
        body = await self._body(request)
        if request.method == "POST" and not target.name:
            dry_run = query.get("dryRun") == "All"
            return web.json_response(self.store.create(res, namespace, body, dry_run), status=201)
        if request.method == "PUT" and target.name:
            return web.json_response(self.store.replace(res, namespace, target.name, body,
                                                        target.subresource))
        if request.method == "PATCH" and target.name:
            content_type = request.headers.get("Content-Type", "")
            if "apply-patch" in content_type:
                return web.json_response(self.store.apply(res, namespace, target.name, body))
            return web.json_response(self.store.patch(res, namespace, target.name, body,
                                                      content_type, target.subresource))
        if request.method == "DELETE" and target.name:
            options = body if isinstance(body, dict) else {}
            grace = query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
            deleted = self.store.delete(res, namespace, target.name,
                                        None if grace is None else int(grace))
            return web.json_response(deleted)
        raise errors.ApiError(405, "MethodNotAllowed", f"{request.method} is not supported here")

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if request.content_type == "application/apply-patch+yaml":
            return yaml.safe_load(raw) or {}
        if request.content_type == "application/vnd.kubernetes.protobuf":
            return protobuf.decode(raw)
        if "protobuf" in request.content_type or "cbor" in request.content_type:
            raise errors.ApiError(415, "UnsupportedMediaType",
                                  f"{request.content_type} is not supported; send JSON")
        return json.loads(raw) if raw.strip() else {}

    def _respond(self, request: web.Request, res: resources.Resource,
                 items: list[dict[str, Any]], single: bool) -> web.Response:
        rv = str(self.store.version)
        if "as=Table" in request.headers.get("Accept", ""):
            include = request.query.get("includeObject", "Metadata")
            return web.json_response(table(res, items, include, rv))
        if single:
            return web.json_response(items[0])
        return web.json_response({"kind": f"{res.kind}List", "apiVersion": res.api_version,
                                  "metadata": {"resourceVersion": rv}, "items": items})

    async def _watch(self, request: web.Request, res: resources.Resource, namespace: str | None,
                     match: Any) -> web.StreamResponse:
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def listener(changed: resources.Resource, event: Event) -> None:
            if changed.key == res.key:
                queue.put_nowait(event)

        self.store.listeners.append(listener)
        try:
            since = request.query.get("resourceVersion", "")
            if since in ("", "0"):
                backlog = [Event(self.store.version, "ADDED", o, None)
                           for o in self.store.list(res, namespace, match)]
                last = self.store.version
            else:
                backlog = self.store.events_since(res, int(since))
                last = int(since)
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            timeout = float(request.query.get("timeoutSeconds") or WATCH_DEFAULT_SECONDS)
            deadline = asyncio.get_running_loop().time() + timeout
            for event in backlog:
                last = max(last, event.rv)
                await self._send(response, res, event, namespace, match, as_is=since in ("", "0"))
            if request.query.get("sendInitialEvents") == "true":
                # a watch-list (client-go informers) waits for this mark before it syncs
                mark = {"type": "BOOKMARK", "object": {
                    "kind": res.kind, "apiVersion": res.api_version, "metadata": {
                        "resourceVersion": str(last),
                        "annotations": {"k8s.io/initial-events-end": "true"}}}}
                await response.write((json.dumps(mark) + "\n").encode())
            while not self._stopping.is_set():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
                if event.rv <= last:
                    continue
                last = event.rv
                await self._send(response, res, event, namespace, match, as_is=False)
            return response
        finally:
            self.store.listeners.remove(listener)

    async def _send(self, response: web.StreamResponse, res: resources.Resource, event: Event,
                    namespace: str | None, match: Any, as_is: bool) -> None:
        obj = event.obj
        if namespace is not None and obj["metadata"].get("namespace") != namespace:
            return
        kind = event.type
        if not as_is:
            now, before = match(obj), event.old is not None and match(event.old)
            if kind == "MODIFIED" and now and not before:
                kind = "ADDED"
            elif kind == "MODIFIED" and before and not now:
                kind = "DELETED"  # it left the selection: a filtered watch says so
            elif not now and not before:
                return
        line = json.dumps({"type": kind, "object": obj}) + "\n"
        await response.write(line.encode())
