"""Pure pieces of the worker: role profiles, request parsing, SSE, settings, fault hooks."""

from __future__ import annotations

import argparse
import json

import pytest

from baton.engine.outputs import RequestOutput
from baton.server import main, sse
from baton.server.errors import ApiError
from baton.server.params import prompt_token_ids, sampling_params
from baton.server.roles import PoolShape, accepts, shape_for_role
from baton.server.settings import WorkerSettings
from baton.server.test_hooks import corrupt_layer_hook


def test_prefill_profile_trades_kv_pool_for_token_budget_and_switching_back_restores():
    start = PoolShape(num_kv_blocks=400, max_num_batched_tokens=2048, chunk_size=512)
    prefill = shape_for_role("prefill", "decode", start)
    assert prefill.num_kv_blocks < start.num_kv_blocks
    assert prefill.max_num_batched_tokens > start.max_num_batched_tokens
    assert prefill.chunk_size == start.chunk_size  # a short prompt waits for one chunk at most
    assert shape_for_role("decode", "decode", start) == start
    # a worker that started as prefill grows its pool when it becomes a decoder
    decode = shape_for_role("decode", "prefill", prefill)
    assert decode.num_kv_blocks == start.num_kv_blocks
    with pytest.raises(ValueError, match="role"):
        shape_for_role("router", "decode", start)


def test_roles_take_only_their_work():
    assert accepts("decode", "reserve") and not accepts("prefill", "reserve")
    assert accepts("prefill", "prefill") and not accepts("decode", "prefill")
    assert all(accepts("both", w) for w in ("reserve", "prefill", "generate", "import"))


def test_sampling_params_refuse_unknown_and_invalid_fields():
    assert sampling_params({"max_tokens": 3, "temperature": 0.5}).max_tokens == 3
    assert sampling_params(None).max_tokens == 64
    with pytest.raises(ApiError, match="params.beam_width"):
        sampling_params({"beam_width": 2})
    with pytest.raises(ApiError, match="max_tokens"):
        sampling_params({"max_tokens": 0})
    with pytest.raises(ApiError) as info:
        prompt_token_ids({"prompt_token_ids": [1, "2"]})
    assert info.value.status == 400 and info.value.body()["error"]["code"] == "invalid_request"


def test_sse_event_carries_only_the_new_tokens():
    out = RequestOutput(request_id="r", prompt_token_ids=[1, 2, 3], token_ids=[7, 8], text="ab",
                        finished=True, finish_reason="length", num_cached_tokens=2,
                        new_token_ids=[8], new_text="b")
    doc = sse.output_event(out)
    assert doc == {"request_id": "r", "token_ids": [8], "text": "b", "finish_reason": "length",
                   "num_prompt_tokens": 3, "num_cached_tokens": 2, "logprobs": None}
    line = sse.encode(doc)
    assert line.endswith("\n\n") and json.loads(sse.data_of(line)) == doc
    assert sse.data_of(": keepalive") is None and sse.data_of(sse.DONE.strip()) == "[DONE]"


def test_settings_name_the_worker_and_its_kv_address():
    s = WorkerSettings(host="127.0.0.1", port=9000, kv_port=9001)
    assert s.name == "127.0.0.1-9000" and s.kv_address() == "127.0.0.1:9001"
    shm = WorkerSettings(worker_id="decode/a b", kv_transport="shm")
    assert shm.kv_address() == "decode-a-b"
    with pytest.raises(ValueError, match="kv-transport"):
        WorkerSettings(kv_transport="carrier-pigeon").validate()


def test_tpot_objective_reaches_the_engine_and_bad_values_name_the_flag():
    assert WorkerSettings(tpot_objective_s=0.08).engine_settings()["tpot_objective_s"] == 0.08
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--tpot-objective-ms"):
            WorkerSettings(tpot_objective_s=bad).validate()


def test_the_bank_is_the_roles_unless_given_and_bad_values_name_the_flag():
    assert WorkerSettings().engine_settings()["tpot_bank_objectives"] is None  # the engine's role default
    assert WorkerSettings(tpot_bank_objectives=1.2).engine_settings()["tpot_bank_objectives"] == 1.2
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--tpot-bank-objectives"):
            WorkerSettings(tpot_bank_objectives=bad).validate()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "worker-0.example"])
def test_insecure_mode_is_refused_off_loopback(host):
    with pytest.raises(ValueError, match=f"--insecure-no-token serves an open API.*got '{host}'"):
        WorkerSettings(host=host, insecure_no_token=True).validate()
    WorkerSettings(host=host, insecure_no_token=False).validate()  # with a token: anywhere


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_insecure_mode_runs_on_loopback(host):
    WorkerSettings(host=host, insecure_no_token=True).validate()


def test_an_insecure_worker_on_a_public_address_does_not_start(monkeypatch, capsys):
    import uvicorn

    monkeypatch.delenv("BATON_INTERNAL_TOKEN", raising=False)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the worker started serving"))
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert main.run(parser.parse_args(["--insecure-no-token", "--host", "0.0.0.0"])) == 2
    assert "--insecure-no-token serves an open API" in capsys.readouterr().err


def test_corrupt_hook_flips_one_layer_once_per_matching_request(monkeypatch):
    monkeypatch.setenv("BATON_TEST_CORRUPT_LAYER", "2")
    monkeypatch.setenv("BATON_TEST_CORRUPT_PREFIX", "corrupt-")
    hook = corrupt_layer_hook()

    class H:
        def __init__(self, rid, layer):
            self.request_id, self.layer = rid, layer

    data = memoryview(bytes(8))
    assert bytes(hook(H("corrupt-1", 2), data)) != bytes(data)
    assert bytes(hook(H("corrupt-1", 2), data)) == bytes(data)  # the re-send goes through
    assert bytes(hook(H("other", 2), data)) == bytes(data)
    assert bytes(hook(H("corrupt-2", 1), data)) == bytes(data)
    monkeypatch.delenv("BATON_TEST_CORRUPT_LAYER")
    assert corrupt_layer_hook() is None


def test_worker_refuses_to_start_without_a_token(monkeypatch, capsys):
    monkeypatch.delenv("BATON_INTERNAL_TOKEN", raising=False)
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert main.run(parser.parse_args(["--role", "decode"])) == 2
    assert "BATON_INTERNAL_TOKEN" in capsys.readouterr().err


def test_a_silent_stream_sends_keepalives_then_a_clear_timeout(monkeypatch):
    import asyncio

    from baton.server import streams

    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.05)

    class Book:
        def close(self, _rid):
            pass

    abandoned = []

    async def on_abandon(rid, target):
        abandoned.append(rid)

    async def collect():
        chunks = []
        async for chunk in streams.relay(Book(), "r", asyncio.Queue(), follow=None,
                                         on_abandon=on_abandon, token_timeout_s=0.2):
            chunks.append(chunk)
        await asyncio.sleep(0.05)  # the abort runs in a task of its own
        return chunks

    chunks = asyncio.run(collect())
    assert chunks[0] == sse.KEEPALIVE and chunks[-1] == sse.DONE
    assert "within 0.2s" in chunks[-2] and abandoned == ["r"]


def test_the_abort_of_a_stream_cancelled_by_its_server_still_runs():
    """Starlette stops a stream whose client left by cancelling an anyio scope; every await
    in that scope is cancelled again, so the abort must not run inside it."""
    import asyncio

    import anyio

    from baton.server import streams

    class Book:
        def close(self, _rid):
            pass

    abandoned = []

    async def on_abandon(rid, target):
        await asyncio.sleep(0.05)  # a call to the engine thread
        abandoned.append(rid)

    async def main():
        async def consume():
            async for _ in streams.relay(Book(), "r", asyncio.Queue(), follow=None,
                                         on_abandon=on_abandon, token_timeout_s=60):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await asyncio.sleep(0.05)
            tg.cancel_scope.cancel()
        await asyncio.sleep(0.3)

    asyncio.run(main())
    assert abandoned == ["r"]


def test_the_test_layer_delay_slows_each_layer_of_a_step_once(monkeypatch):
    from baton.server import test_hooks

    slept = []
    monkeypatch.setattr(test_hooks.time, "sleep", slept.append)
    delay = test_hooks.LayerDelay(0.1)
    for layer in (0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 1, 2):  # a step of three prompts, then one of one
        delay.before(layer)
    assert slept == [0.1] * 6
    monkeypatch.delenv("BATON_TEST_LAYER_DELAY_S", raising=False)
    assert test_hooks.layer_delay() is None
    monkeypatch.setenv("BATON_TEST_LAYER_DELAY_S", "0.2")
    assert test_hooks.layer_delay() is test_hooks.layer_delay() and test_hooks.layer_delay().seconds == 0.2
