"""`baton up --prefill 1 --decode 2 --prefill-tp 1 --decode-tp 2` on a tiny model, through the
router with the official `openai` client: each decode worker splits the model over two rank
processes (the second started through Ray, in a placement group on the worker's node),
prompts are prefilled in one process and decoded on a decode group (the KV heads re-sharded
in flight), and the tokens are one process's. A decode worker converts to a prefill worker
of one process and back, as `baton up --autoscale` converts between pools of these sizes,
under traffic and with no failed request. Killing one rank of a decode worker loses no
request (the router routes around it or re-issues), and `baton up` restarts that worker
from its liveness probe as a kubelet would: it serves the same tokens again."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest
from stack_harness import UpProcess, assert_all_exit

from baton.autoscaler.ray_actuator import RayActuator
from baton.local.autoscale import pool_sizes
from baton.local.runtime import StackSpec
from tests.engine.tiny_llama import write_tiny_llama
from tests.server.workers import TOKEN, WorkerApi

pytestmark = pytest.mark.slow

WORKERS_LINE = re.compile(r"workers: prefill@(http://\S+), decode@(http://\S+), decode@(http://\S+);")
PROMPTS = [[5, 17, 33, 200, 7], list(range(3, 60)), [9] * 30, [100, 101, 102]]
MAX_TOKENS = 24
RESTARTED_WITHIN_S = 90  # three failed liveness probes 1.5 s apart, the back-off, a fresh start


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-up"))


@pytest.fixture(scope="module")
def reference(tiny) -> list[str]:
    """One process, no tensor parallelism: the text every path must give."""
    from baton.engine import Engine
    from baton.engine.sampling import SamplingParams

    engine = Engine(model=str(tiny), dtype="float32", quantization="none", threads=1, num_kv_blocks=64)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    return [o.text for o in outs]


@pytest.fixture(scope="module")
def stack(tiny, tmp_path_factory):
    up = UpProcess(["--prefill", "1", "--decode", "2", "--prefill-tp", "1", "--decode-tp", "2",
                    "--port", "0", "--model", str(tiny), "--disagg-threshold", "0",
                    "--worker-arg=--dtype=float32", "--worker-arg=--num-kv-blocks=64",
                    "--liveness-period", "1.5"],
                   tmp_path_factory.mktemp("up-tp"), env={"BATON_INTERNAL_TOKEN": TOKEN})
    started: list = []
    try:
        url = up.wait_up()
        urls = WORKERS_LINE.search(up.printed()).groups()
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        yield up, url, model, [WorkerApi(u) for u in urls]
        started = up.descendants()  # Ray's rank actors and their ranks included
    finally:
        code = up.stop()
    assert code == 0, up.output()
    assert_all_exit(started)


def complete_all(url: str, model: str) -> list:
    """Each prompt once, concurrently: its text, or the exception the client raised."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

    async def one(ids: list[int]):
        reply = await api.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == MAX_TOKENS
        return reply.choices[0].text

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS), return_exceptions=True), 120)

    return asyncio.run(run())


def test_decode_workers_run_two_ranks_and_the_tokens_are_one_processes(stack, reference):
    up, url, model, workers = stack
    for worker, size in zip(workers, (1, 2, 2)):
        state = worker.state()
        assert state["tensor_parallel_size"] == size and len(state["rank_pids"]) == size - 1, state
    for name in ("worker-1-decode.log", "worker-2-decode.log"):  # the second rank: a Ray actor's
        assert "ranks placed through Ray" in (up.log_dir / name).read_text(), up.output()
    ranks = {pid for worker in workers for pid in worker.state()["rank_pids"]}
    assert len(ranks) == 2 and ranks <= {p.pid for p in up.descendants()}  # stopped with the stack
    replies = complete_all(url, model)
    assert replies == reference
    remote = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r'baton_router_routes_total\{path="remote"\} [1-9]', remote), "no remote prefill"


def test_a_decode_worker_converts_to_a_prefill_worker_of_another_size_under_traffic(stack, reference):
    up, url, model, workers = stack
    convertee = workers[2]
    events: list[str] = []
    actuator = RayActuator(workers=[w.url for w in workers], token=TOKEN, poll_s=0.1,
                           tensor_parallel_sizes=pool_sizes(StackSpec(prefill_tp=1, decode_tp=2)),
                           on_event=lambda reason, message: events.append(f"{reason}: {message}"))
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

    async def conversions_under_traffic():
        stop, outcomes = asyncio.Event(), []

        async def client(i: int):
            while not stop.is_set():
                ids = PROMPTS[i % len(PROMPTS)]
                try:
                    reply = await api.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                                         extra_body={"ignore_eos": True})
                    outcomes.append(reply.choices[0].text == reference[i % len(PROMPTS)] or reply.choices[0].text)
                except Exception as exc:  # noqa: BLE001 - every failure is reported below
                    outcomes.append(exc)
                i += 1

        clients = [asyncio.create_task(client(i)) for i in range(4)]
        states = []
        try:
            await asyncio.sleep(1.0)
            for source, target in (("decode", "prefill"), ("prefill", "decode")):
                converted = await asyncio.wait_for(actuator.convert(convertee.url, source, target, []), 240)
                states.append((converted, await asyncio.to_thread(convertee.state)))
                await asyncio.sleep(1.0)  # traffic through the new layout
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 120)
            await actuator.aclose()
        return states, outcomes

    states, outcomes = asyncio.run(conversions_under_traffic())
    (to_prefill, as_prefill), (to_decode, as_decode) = states
    assert to_prefill and to_decode, events
    assert (as_prefill["role"], as_prefill["tensor_parallel_size"], as_prefill["rank_pids"]) == ("prefill", 1, [])
    assert (as_decode["role"], as_decode["tensor_parallel_size"]) == ("decode", 2)
    assert len(as_decode["rank_pids"]) == 1 and as_decode["state"] == "active"
    failed = [o for o in outcomes if o is not True]
    assert len(outcomes) >= 8 and not failed, failed
    assert complete_all(url, model) == reference


def test_a_killed_decode_rank_loses_no_request_and_the_worker_is_restarted(stack, reference):
    up, url, model, workers = stack
    victim = workers[1]
    [rank_pid] = victim.state()["rank_pids"]
    restarts = up.printed().count("restarted")
    os.kill(rank_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while victim.get("/health").status_code == 200:  # the worker notices on its own
        assert time.monotonic() - killed_at < 10, "the worker never noticed its rank died"
        time.sleep(0.1)

    replies = complete_all(url, model)  # the other decode worker takes them
    assert [r if isinstance(r, str) else repr(r) for r in replies] == reference

    up.wait_printed("failed its liveness probe", RESTARTED_WITHIN_S)
    up.wait_printed("restarted", RESTARTED_WITHIN_S, restarts + 1)
    deadline = killed_at + RESTARTED_WITHIN_S
    while True:
        try:
            if victim.get("/ready").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, up.output()
        time.sleep(0.5)
    state = victim.state()
    assert state["tensor_parallel_size"] == 2 and state["rank_pids"] != [rank_pid]
    assert complete_all(url, model) == reference
