"""The live KV handoff between real worker processes: equivalence and refusals."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.kv.transport import TransferRefused, select_transport
from tests.server.conftest import GREEDY
from tests.server.workers import generate, handoff, new_id

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("blocks_restored")]


def run_all(coros):
    async def main():
        return await asyncio.gather(*coros)

    return asyncio.run(main())


@pytest.mark.parametrize("decoder", ["decode-tcp", "decode-shm"])
def test_prefill_to_decode_matches_colocated(cluster, prompt_ids, reference, decoder):
    """8 prompts: prefill (16-token blocks, chunked) → decode (32 over TCP, 16 over shm)."""
    prefill, decode = cluster["prefill"], cluster[decoder]
    sent_before = prefill.metric("baton_kv_transfer_bytes_total")
    lengths = ("baton_request_prompt_tokens_sum", "baton_request_prompt_tokens_count",
               "baton_request_generation_tokens_sum")
    lengths_before = {name: (decode.metric(name), prefill.metric(name)) for name in lengths}
    results = run_all([handoff(prefill, decode, ids, GREEDY) for ids in prompt_ids])
    for ids, expected, r in zip(prompt_ids, reference, results):
        assert r["prefill"].status_code == 200, r["prefill"].text
        assert not r["errors"], r["errors"]
        assert r["token_ids"] == expected, f"prompt of {len(ids)} tokens diverged"
        report = r["prefill"].json()
        assert report["first_token"] == expected[0]
        assert report["transfer"]["layers"] == 30 and report["transfer"]["resent_layers"] == []
    transfers = [r["prefill"].json()["transfer"] for r in results]
    for t in transfers:  # the router's threshold learns the rate apart from queue and batch
        assert t["prefill_seconds_per_token"] is None or 0 < t["prefill_seconds_per_token"] < t["prefill_seconds"]
    assert any(t["prefill_seconds_per_token"] for t in transfers)  # measured once a step has run
    # every worker publishes its own rate in its state, for the router's local side
    assert prefill.state()["prefill_seconds_per_token"] > 0
    assert "prefill_seconds_per_token" in decode.state()  # None until it prefills a prompt itself
    assert decode.state()["decodes_past_objective"] in (True, False)  # by its calibrated decode line
    # and what paces a prompt it prefills beside its decodes (the router's local wait)
    intercept, per_decode = decode.state()["decode_step_line"]
    assert intercept >= 0 and per_decode >= 0 and intercept + per_decode > 0
    assert decode.state()["tpot_objective_s"] == pytest.approx(0.030)
    moved = sum(t["bytes"] for t in transfers)
    assert prefill.metric("baton_kv_transfer_bytes_total") - sent_before == moved
    assert decode.metric("baton_kv_exposed_transfer_seconds_count") == 0  # measured on the prefill side
    assert prefill.metric("baton_kv_exposed_transfer_seconds_count") >= len(prompt_ids)
    # each request's lengths counted once, where it finished: on the decode worker
    gained = {name: decode.metric(name) - before[0] for name, before in lengths_before.items()}
    assert gained == {"baton_request_prompt_tokens_sum": sum(len(ids) for ids in prompt_ids),
                      "baton_request_prompt_tokens_count": len(prompt_ids),
                      "baton_request_generation_tokens_sum": sum(len(tokens) for tokens in reference)}
    assert all(prefill.metric(name) == before[1] for name, before in lengths_before.items())


def test_corrupted_layer_is_resent_and_output_identical(cluster, prompt_ids, reference):
    prefill, decode = cluster["prefill"], cluster["decode-tcp"]
    (r,) = run_all([handoff(prefill, decode, prompt_ids[6], GREEDY, rid=new_id("corrupt"))])
    assert r["prefill"].status_code == 200, r["prefill"].text
    assert r["prefill"].json()["transfer"]["resent_layers"] == [5]
    assert r["token_ids"] == reference[6]


def test_expired_ticket_frees_blocks_and_is_refused(cluster, prompt_ids):
    prefill, decode = cluster["prefill"], cluster["decode-tcp"]
    free = decode.state()["free_blocks"]
    rid = new_id("expire")
    reply = decode.post("/internal/reserve", {"request_id": rid, "prompt_token_ids": prompt_ids[7],
                                              "params": GREEDY, "ttl_s": 1.0, "headroom_tokens": 16})
    assert reply.status_code == 200
    ticket = reply.json()["ticket"]
    assert decode.state()["free_blocks"] < free
    assert decode.wait_free_blocks(free, timeout=5) == free  # the janitor gave them back
    late = prefill.post("/internal/prefill", {"request_id": rid, "prompt_token_ids": prompt_ids[7],
                                              "params": GREEDY, "ticket": ticket})
    assert late.status_code == 400 and "expired" in late.json()["error"]["message"]
    stream = decode.get(f"/internal/stream/{rid}")
    assert stream.status_code == 404 or "expired" in stream.text


def test_a_decode_worker_keeping_kv_in_another_dtype_is_refused_before_any_work(cluster, prompt_ids):
    # e.g. a decode worker whose `--kv-cache-dtype auto` chose bf16 beside a float32 prefill worker
    prefill, decode = cluster["prefill"], cluster["decode-tcp"]
    before = prefill.metric("baton_prompt_tokens_total")
    rid = new_id("kvdtype")
    reply = decode.post("/internal/reserve", {"request_id": rid, "prompt_token_ids": prompt_ids[1],
                                              "params": GREEDY, "headroom_tokens": 16})
    ticket = {**reply.json()["ticket"], "dtype": "bfloat16"}
    refused = prefill.post("/internal/prefill", {"request_id": rid, "prompt_token_ids": prompt_ids[1],
                                                 "params": GREEDY, "ticket": ticket})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "ticket_mismatch"
    assert "KV dtype bfloat16 != this worker's float32" in refused.json()["error"]["message"]
    assert prefill.metric("baton_prompt_tokens_total") == before
    assert decode.post(f"/internal/abort/{rid}").status_code == 200  # the router gives it back


def test_full_decode_pool_refuses_reservation_before_any_prefill(cluster, prompt_ids):
    prefill, decode = cluster["prefill"], cluster["decode-tcp"]
    state = decode.state()
    prompt_tokens = prefill.metric("baton_prompt_tokens_total")
    hog = new_id("hog")
    # take all but one block, then ask for more than one
    headroom = (state["free_blocks"] - 1) * state["block_size"] - len(prompt_ids[0]) - 1
    first = decode.post("/internal/reserve", {"request_id": hog, "prompt_token_ids": prompt_ids[0],
                                              "params": {"max_tokens": 4096}, "headroom_tokens": headroom})
    assert first.status_code == 200, first.text
    refused = decode.post("/internal/reserve", {"request_id": new_id(), "prompt_token_ids": prompt_ids[7],
                                                "params": GREEDY, "headroom_tokens": 16})
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "kv_pool_full"
    assert decode.state()["reservations"] == 1
    assert prefill.metric("baton_prompt_tokens_total") == prompt_tokens  # no prompt work anywhere
    assert decode.post(f"/internal/abort/{hog}").status_code == 200


def test_wrong_token_is_refused_and_nothing_is_written(cluster, prompt_ids):
    decode = cluster["decode-tcp"]
    free = decode.state()["free_blocks"]
    body = {"request_id": new_id(), "prompt_token_ids": prompt_ids[0], "params": GREEDY}
    assert decode.post("/internal/reserve", body, token="not-the-token").status_code == 401
    assert decode.post("/internal/reserve", body, token=None).status_code == 401
    assert decode.get("/internal/state", token="nope").status_code == 401
    assert decode.state()["free_blocks"] == free and decode.state()["reservations"] == 0

    # the KV port refuses the same way, before any frame reaches memory
    reply = decode.post("/internal/reserve", {**body, "request_id": new_id("auth")})
    ticket = reply.json()["ticket"]

    async def try_wrong_token():
        from baton.kv.ticket import Ticket

        t = Ticket.from_dict(ticket)
        sender = select_transport("auto", t.kv_endpoint).sender(t.kv_endpoint, worker_id=t.worker_id, token="wrong")
        try:
            await sender.open(t)
        finally:
            await sender.close()

    with pytest.raises(TransferRefused, match="auth"):
        asyncio.run(try_wrong_token())
    assert decode.post(f"/internal/abort/{ticket['request_id']}").status_code == 200


def test_prefill_refuses_a_bad_ticket_without_work(cluster, prompt_ids):
    prefill = cluster["prefill"]
    before = prefill.metric("baton_prompt_tokens_total")
    body = {"request_id": "x", "prompt_token_ids": prompt_ids[0], "params": GREEDY,
            "ticket": {"request_id": "x", "block_ids": [1]}}
    reply = prefill.post("/internal/prefill", body)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_ticket"
    assert prefill.metric("baton_prompt_tokens_total") == before


def test_metrics_follow_the_contract(cluster):
    text = cluster["decode-tcp"].get("/metrics").text
    for name in ["baton_time_to_first_token_seconds_bucket", "baton_inter_token_latency_seconds_bucket",
                 "baton_e2e_request_latency_seconds_bucket", "baton_num_requests_running",
                 "baton_num_requests_waiting", "baton_kv_cache_usage_ratio", "baton_kv_cache_capacity_tokens",
                 "baton_prefix_cache_queries_total", "baton_prefix_cache_hits_total",
                 "baton_prompt_tokens_total", "baton_generation_tokens_total",
                 "baton_kv_transfer_bytes_total", "baton_kv_transfer_seconds_bucket",
                 "baton_kv_exposed_transfer_seconds_bucket", "baton_prefill_busy_seconds_total",
                 "baton_commit_hold_seconds_total", "baton_step_seconds_bucket", "baton_step_prompt_tokens_bucket",
                 "baton_step_off_cpu_seconds_bucket", "baton_request_prompt_tokens_bucket",
                 "baton_request_generation_tokens_bucket",
                 "baton_worker_role", "baton_role_conversions_total", "baton_migrations_total"]:
        assert f"{name}{{" in text or f"{name} " in text, name
    assert 'baton_worker_role{role="decode"} 1.0' in text


def step_series(worker) -> dict[tuple[str, str], float]:
    """(metric, kind) -> value of the step histograms' _count and _sum series."""
    return {(sample.name, sample.labels["kind"]): sample.value
            for family in text_string_to_metric_families(worker.get("/metrics").text)
            if family.name.startswith("baton_step_")
            for sample in family.samples if sample.name.endswith(("_count", "_sum"))}


def test_step_metrics_count_every_step_and_prompt_token(cluster):
    """A colocated request: its prompt runs in prompt-only steps (chunks of at most 512), its
    other tokens in decode-only steps, and the step histograms account for all of them."""
    both = cluster["both"]
    # its own first words: no block of it is in the prefix cache from the other tests
    ids = both.tokenize(f"{new_id('steps')} counts the steps of an engine that serves a language model, "
                        "one prompt chunk and one decode at a time, and reports how long each took.")
    before, prompt_before = step_series(both), both.metric("baton_prompt_tokens_total")
    busy_before = both.metric("baton_prefill_busy_seconds_total")
    result = asyncio.run(generate(both, ids, GREEDY))
    assert len(result["token_ids"]) == GREEDY["max_tokens"]
    after = step_series(both)
    gained = {key: after[key] - before.get(key, 0.0) for key in after}
    prompt_tokens = both.metric("baton_prompt_tokens_total") - prompt_before
    assert prompt_tokens == len(ids) > 16
    assert gained[("baton_step_prompt_tokens_sum", "prompt")] == prompt_tokens
    assert gained[("baton_step_prompt_tokens_count", "prompt")] == gained[("baton_step_seconds_count", "prompt")] >= 1
    # the first token comes from the prompt's last step; each later one from a decode step
    assert gained[("baton_step_seconds_count", "decode")] == GREEDY["max_tokens"] - 1
    assert gained[("baton_step_seconds_count", "mixed")] == 0
    assert gained[("baton_step_seconds_sum", "decode")] > 0
    for kind in ("prompt", "decode"):  # each step's time off the CPU, a part of its time
        assert gained[("baton_step_off_cpu_seconds_count", kind)] == gained[("baton_step_seconds_count", kind)]
        assert 0 <= gained[("baton_step_off_cpu_seconds_sum", kind)] <= gained[("baton_step_seconds_sum", kind)]
    prompt_seconds = gained[("baton_step_seconds_sum", "prompt")]
    assert abs(prompt_seconds - (both.metric("baton_prefill_busy_seconds_total") - busy_before)) < 1e-6


def test_a_first_token_that_ends_the_request_still_hands_off_cleanly(cluster, prompt_ids, reference):
    """max_tokens=1: the decode worker ends the sequence at commit and frees its blocks."""
    (r,) = run_all([handoff(cluster["prefill"], cluster["decode-shm"], prompt_ids[3], {"max_tokens": 1})])
    assert r["prefill"].status_code == 200, r["prefill"].text
    assert r["token_ids"] == reference[3][:1] and r["finish_reason"] == "length"


def test_a_request_id_in_use_is_refused(cluster, prompt_ids):
    decode = cluster["decode-shm"]
    rid = new_id("dup")
    body = {"request_id": rid, "prompt_token_ids": prompt_ids[0], "params": GREEDY}
    assert decode.post("/internal/reserve", body).status_code == 200
    again = decode.post("/internal/reserve", body)
    assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_request"
    assert decode.post("/internal/generate", body).status_code == 409
    assert decode.post(f"/internal/abort/{rid}").status_code == 200
    assert decode.post(f"/internal/abort/{rid}").status_code == 404


@pytest.mark.parametrize("decoder", ["decode-tcp", "decode-shm"])
def test_back_to_back_stream_from_an_outside_sender(cluster, prompt_ids, decoder):
    """What bench/kv.py times: every layer handed to a LayerStreamer at once (pooled buffers,
    reused twice), into a real decode worker that ACKs before its engine commits."""
    import torch

    from baton.kv.stream import BackgroundLoop, LayerStreamer
    from baton.kv.ticket import Ticket
    from tests.server.workers import TOKEN, read_stream

    decode, ids = cluster[decoder], prompt_ids[3]
    params = {**GREEDY, "max_tokens": 3}

    async def one(sender, loop, caches, blocks):
        rid = new_id("b2b")
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            reply = await client.post(decode.url + "/internal/reserve", json={
                "request_id": rid, "prompt_token_ids": ids, "params": params, "headroom_tokens": 16})
            ticket = Ticket.from_dict(reply.json()["ticket"])
            stream = asyncio.create_task(read_stream(client, "GET", f"{decode.url}/internal/stream/{rid}"))
            streamer = LayerStreamer(ticket, sender, loop, src_block_ids=blocks, src_block_size=16)

            def push():
                for layer, (k, v) in enumerate(caches):
                    streamer.on_layer_done(layer, k, v)
                return streamer.finish(first_token=ids[0], timeout=30)

            report = await asyncio.to_thread(push)
            return report, await asyncio.wait_for(stream, 60)

    with BackgroundLoop() as bg:
        probe = Ticket.from_dict(decode.post("/internal/reserve", {
            "request_id": (rid := new_id("probe")), "prompt_token_ids": ids, "params": params}).json()["ticket"])
        assert decode.post(f"/internal/abort/{rid}").status_code == 200
        blocks = list(range(-(-len(ids) // 16)))
        shape = (len(blocks), 16, probe.num_kv_heads, probe.head_dim)
        caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(probe.num_layers)]
        sender = select_transport("auto", probe.kv_endpoint).sender(
            probe.kv_endpoint, worker_id=probe.worker_id, token=TOKEN)
        try:
            for _ in range(2):
                report, result = asyncio.run(one(sender, bg.loop, caches, blocks))
                assert report.ack is not None and report.ack.layers == probe.num_layers
                assert not result["errors"], result["errors"]
                assert result["token_ids"][0] == ids[0] and len(result["token_ids"]) == 3
        finally:
            bg.run(sender.close(), timeout=5)
