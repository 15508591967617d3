"""Real `baton worker` processes on 127.0.0.1 and a small client for their internal API."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

TOKEN = "server-test-token"
READY_DEADLINE_S = 180.0
BASE_ARGS = ["--dtype", "float32", "--threads", "1", "--model", "bundled", "--kv-port", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class WorkerApi:
    """A worker's HTTP API at `url`, whoever started it (this module, or `baton up`)."""

    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, token: str = TOKEN) -> httpx.Response:
        return httpx.get(self.url + path, headers=_auth(token), timeout=30)

    def post(self, path: str, body: dict | None = None, token: str = TOKEN, timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + path, json=body or {}, headers=_auth(token), timeout=timeout)

    def state(self) -> dict:
        return self.get("/internal/state").json()

    def metric(self, name: str) -> float:
        """Sum of a metric's samples over all label sets."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def tokenize(self, text: str) -> list[int]:
        return self.post("/internal/tokenize", {"text": text}).json()["token_ids"]

    def wait_free_blocks(self, expected: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        free = self.state()["free_blocks"]
        while free != expected and time.monotonic() < deadline:
            time.sleep(0.1)
            free = self.state()["free_blocks"]
        return free


class WorkerProcess(WorkerApi):
    PORT_TRIES = 3  # a free port can be taken by another process before the worker binds it

    def __init__(self, name: str, role: str, *args: str, env: dict | None = None):
        super().__init__("")
        self.name = name
        self.role = role
        self.args, self.env = list(args), {**os.environ, "BATON_INTERNAL_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1",
                                          **(env or {})}
        self.tries = 0
        self._log = None
        self._spawn()

    def _spawn(self) -> None:
        self.tries += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.gettempdir()) / f"baton-test-{self.name}-{self.port}.log"
        cmd = [sys.executable, "-m", "baton.cli", "worker", "--role", self.role, "--port", str(self.port),
               "--worker-id", f"{self.name}-{self.port}", *BASE_ARGS, *self.args]
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log_tail() and self.tries < self.PORT_TRIES:
                    self._spawn()
                    continue
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"worker {self.name} not ready in time:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def _auth(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def start_workers(specs: list[tuple]) -> list[WorkerProcess]:
    """Start (name, role, args, env) workers in parallel; wait until all are ready."""
    workers = [WorkerProcess(name, role, *args, env=env) for name, role, args, env in specs]
    deadline = time.monotonic() + READY_DEADLINE_S
    try:
        for w in workers:
            w.wait_ready(deadline)
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers


# -- token streams (async: a stream and a prefill run side by side) ---------------------------
async def read_stream(client: httpx.AsyncClient, method: str, url: str, body: dict | None = None,
                      on_event=None) -> dict:
    """Collect an SSE stream: token ids, text, finish reason, errors."""
    result = {"token_ids": [], "text": "", "finish_reason": None, "errors": [], "done": False}
    async with client.stream(method, url, json=body, headers=_auth(TOKEN), timeout=120) as resp:
        if resp.status_code != 200:
            await resp.aread()
            result["errors"].append({"status": resp.status_code, "body": resp.text})
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                result["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                result["errors"].append(event["error"])
                continue
            result["token_ids"] += event["token_ids"]
            result["text"] += event["text"]
            result["finish_reason"] = event["finish_reason"] or result["finish_reason"]
            if on_event is not None:
                await on_event(event, result)
    return result


async def generate(worker: WorkerProcess, ids: list[int], params: dict, rid: str | None = None, on_event=None) -> dict:
    async with httpx.AsyncClient() as client:
        body = {"request_id": rid or new_id("gen"), "prompt_token_ids": ids, "params": params}
        return await read_stream(client, "POST", worker.url + "/internal/generate", body, on_event)


async def handoff(prefill: WorkerProcess, decode: WorkerProcess, ids: list[int], params: dict,
                  rid: str | None = None, headroom: int = 64, on_event=None) -> dict:
    """Decode-first: reserve on `decode`, prefill on `prefill`, read the decode stream."""
    rid = rid or new_id("pd")
    async with httpx.AsyncClient(headers=_auth(TOKEN), timeout=120) as client:
        reply = await client.post(decode.url + "/internal/reserve", json={
            "request_id": rid, "prompt_token_ids": ids, "params": params, "headroom_tokens": headroom})
        if reply.status_code != 200:
            return {"reserve": reply, "token_ids": [], "errors": [reply.json()]}
        ticket = reply.json()["ticket"]
        stream = asyncio.create_task(read_stream(client, "GET", f"{decode.url}/internal/stream/{rid}",
                                                  on_event=on_event))
        pre = await client.post(prefill.url + "/internal/prefill", json={
            "request_id": rid, "prompt_token_ids": ids, "params": params, "ticket": ticket})
        result = await asyncio.wait_for(stream, 120)
        result.update(prefill=pre, ticket=ticket, request_id=rid)
        return result


async def free_blocks(worker: WorkerApi) -> int:
    async with httpx.AsyncClient(headers=_auth(TOKEN), timeout=10) as http:
        return (await http.get(f"{worker.url}/internal/state")).json()["free_blocks"]


async def wait_free(worker: WorkerApi, expected: int, within_s: float) -> float:
    """Seconds until the worker's free blocks are back to `expected` (fails past `within_s`)."""
    started = time.perf_counter()
    while (free := await free_blocks(worker)) != expected:
        assert time.perf_counter() - started < within_s, f"{free} free blocks, expected {expected}"
        await asyncio.sleep(0.05)
    return time.perf_counter() - started
