"""The HTTP surface without a model: probes, auth, and errors in the contract's shape."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from baton.server.app import create_app
from baton.server.settings import WorkerSettings
from baton.server.worker import Worker

TOKEN = "unit-token"


@pytest.fixture
def client():
    # the worker is never started: no model is loaded, so this stays fast
    app = create_app(Worker(WorkerSettings(role="decode"), TOKEN), start_worker=False)
    with TestClient(app) as c:
        yield c


def test_health_is_up_and_ready_waits_for_the_model(client):
    assert client.get("/health").status_code == 200
    reply = client.get("/ready")
    assert reply.status_code == 503 and reply.json()["status"] == "loading"


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", TOKEN])
def test_internal_endpoints_need_the_shared_token(client, header):
    headers = {"Authorization": header} if header else {}
    for method, path in [("get", "/internal/state"), ("post", "/internal/reserve"),
                         ("post", "/internal/prefill"), ("post", "/internal/drain"),
                         ("post", "/internal/abort/x"), ("get", "/internal/stream/x")]:
        reply = getattr(client, method)(path, headers=headers)
        assert reply.status_code == 401, (method, path)
        assert reply.json()["error"]["code"] == "unauthorized"


def test_with_the_token_a_loading_worker_answers_503_in_the_error_shape(client):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get("/internal/state", headers=headers).json()["state"] == "loading"
    reply = client.post("/internal/reserve", headers=headers, json={})
    assert reply.status_code == 503
    assert set(reply.json()["error"]) == {"message", "type", "code"}


def test_metrics_are_served_before_the_model_loads(client):
    text = client.get("/metrics").text
    assert 'baton_worker_role{role="decode"} 1.0' in text
