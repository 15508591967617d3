"""Item 3 of issue 15: the API key guards the API and the router's state, compared in
constant time; a router that others can reach without a key says so loudly."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest
from router_harness import running_router

from baton.router import main
from baton.router.auth import authorized, expected_header, is_loopback


def scope(value: bytes | None) -> dict:
    return {"headers": [] if value is None else [(b"authorization", value)]}


def test_key_check():
    expected = expected_header("s3cret")
    assert authorized(scope(b"Bearer s3cret"), expected)
    for given in (None, b"Bearer s3cre", b"Bearer s3cret ", b"Bearer S3CRET", b"Bearer \xff\xfe"):
        assert not authorized(scope(given), expected)
    assert authorized(scope(None), expected_header(None))  # no key set: open
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("router")


@pytest.mark.asyncio
async def test_router_state_and_models_need_the_key_health_and_metrics_do_not(fake_workers, model_info):
    decode = await fake_workers("decode")
    async with running_router(model_info, [decode.url], api_key="k") as url, httpx.AsyncClient(base_url=url) as http:
        for path in ("/router/state", "/router/placements", "/v1/models"):
            r = await http.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await http.get(path, headers={"Authorization": "Bearer k"})).status_code == 200
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapes: open on purpose
            assert (await http.get(path)).status_code == 200


def test_an_open_router_on_all_addresses_warns_and_the_default_is_loopback(caplog, monkeypatch):
    monkeypatch.delenv("BATON_ROUTER_HOST", raising=False)
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert parser.parse_args([]).host == "127.0.0.1"
    with caplog.at_level(logging.WARNING, logger="baton.router"):
        assert main.warn_if_open("0.0.0.0", None) and "NO API key" in caplog.text
        caplog.clear()
        assert not main.warn_if_open("0.0.0.0", "k") and not main.warn_if_open("127.0.0.1", None)
        assert not caplog.text
