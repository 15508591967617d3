"""What `baton up --autoscale` shows of its controller: recent decisions and its metrics.

`DecisionLog` keeps the last decisions (each with its explanation, inputs and formula
outputs); `ControllerServer` serves them as JSON on `/decisions` and the controller's
`baton_autoscaler_*` metrics on `/metrics`, from a stdlib HTTP server on its own thread
(the controller's event loop never waits for a reader).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from baton.autoscaler.inputs import Decision


class DecisionLog:
    """The last `keep` decisions, appended by the controller thread, read by HTTP threads."""

    def __init__(self, period_s: float, keep: int = 200) -> None:
        self.period_s = period_s
        self._records: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.periods = 0

    def add(self, decision: Decision, status: dict[str, Any], applied: str | None,
            error: str | None) -> dict[str, Any]:
        with self._lock:
            self.periods += 1
            record = {
                "period": self.periods,
                "unix_time": time.time(),  # the end of the period's measuring window
                "time": status.get("time"),
                "action": decision.action.value,
                "explanation": decision.explanation,
                "applied": applied,
                "error": error,
                "current": list(decision.current),
                "desired": list(decision.desired),
                "target": list(decision.target),
                "inputs": status.get("inputs", {}),
                "outputs": status.get("outputs", {}),
            }
            self._records.append(record)
            return record

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"period_s": self.period_s, "periods": self.periods,
                    "decisions": list(self._records)}


def decision_line(record: dict[str, Any]) -> str:
    """One line for the `baton up` output."""
    extra = "; ".join(p for p in (record["applied"], record["error"]) if p)
    return (f"autoscaler period {record['period']}: {record['action']}: {record['explanation']}"
            + (f" [{extra}]" if extra else ""))


class ControllerServer:
    """Serves `log` and `registry` on host:port (port 0: any free one) until stop()."""

    def __init__(self, log: DecisionLog, registry: CollectorRegistry, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.log, self.registry = log, registry
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="baton-controller-http",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?")[0].rstrip("/")
                if path == "/metrics":
                    self._send(200, generate_latest(owner.registry), CONTENT_TYPE_LATEST)
                elif path == "/decisions":
                    body = json.dumps(owner.log.snapshot()).encode()
                    self._send(200, body, "application/json")
                else:
                    self._send(404, b'{"error": "try /decisions or /metrics"}', "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:  # scrapes would flood the output
                pass

        return Handler

    def start(self) -> ControllerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
