"""The fault and load suites' stack: one real `baton up --prefill 1 --decode 1`.

Set up so each fault can be staged: a known internal token (the tests read the workers'
free blocks), layers that stream slowly from the prefill worker (a kill lands inside a
transfer), a short claim deadline for streams a dead router leaves behind, and short
reservation and queue deadlines (a full decode pool answers 429 soon). Prompts under
THRESHOLD tokens are prefilled on the decode worker, longer ones on the prefill worker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import openai
import psutil

from tests.local.stack_harness import UpProcess
from tests.server.workers import TOKEN, WorkerApi

THRESHOLD = 48
LAYER_DELAY_S = 0.1  # x 30 layers: a remote prefill takes 3 s or more
# shorter than the defaults (10 s and 30 s), so the full-pool test is short
RESERVE_WAIT_S = 3  # for KV room on the decode worker, then the prompt is prefilled there
QUEUE_TIMEOUT_S = 10  # for room in the decode worker's queue, then 429
WORKER_ARGS = ["--worker-arg=--dtype=float32", "--worker-arg=--num-kv-blocks=1024",
               "--worker-arg=--max-num-seqs=256", f"--worker-arg=--queue-timeout={QUEUE_TIMEOUT_S}",
               f"--router-arg=--reserve-wait={RESERVE_WAIT_S}"]
ENV = {"BATON_INTERNAL_TOKEN": TOKEN, "BATON_TEST_LAYER_DELAY_S": str(LAYER_DELAY_S),
       "BATON_STREAM_CLAIM_TIMEOUT_S": "5"}
LONG = "A relay race hands a baton from runner to runner; Baton hands a KV cache from worker to worker. "


@dataclass
class Stack:
    up: UpProcess
    url: str
    prefill: WorkerApi
    decode: WorkerApi
    model: str

    @property
    def workers(self) -> list[WorkerApi]:
        return [self.prefill, self.decode]

    def api(self, timeout_s: float = 120.0, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                  timeout=timeout_s, **kwargs)

    def free_blocks(self) -> list[int]:
        return [w.state()["free_blocks"] for w in self.workers]

    def wait_idle(self, idle: list[int], within_s: float) -> float:
        """Seconds until every worker has at least its `idle` free blocks back (fails past
        `within_s`). At least, not exactly: blocks an earlier test left in a timed-out
        transfer may come back while this one runs."""
        started = time.monotonic()
        while True:
            now = self.free_blocks()
            if all(n >= i for n, i in zip(now, idle, strict=True)):
                break
            assert time.monotonic() - started < within_s, f"free blocks {now}, idle {idle}"
            time.sleep(0.05)
        return time.monotonic() - started

    def router_count(self, name: str, label: str) -> float:
        """A router counter's value for one label, e.g. ("retries", 'reason="prefill_failed"')."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"baton_router_{name}_total{{") and label in line)

    def process(self, role: str) -> psutil.Process:
        if role == "router":
            return self.up.server("baton.router.main")
        return self.up.server("baton.server.main", f"--role {role}")

    def serves(self) -> bool:
        try:
            answer = httpx.post(f"{self.url}/v1/completions", timeout=30,
                                json={"model": self.model, "prompt": "Hi", "max_tokens": 2})
            return answer.status_code == 200
        except httpx.HTTPError:
            return False

    def wait_serving(self, since: float, within_s: float) -> float:
        """Seconds from `since` (a monotonic time) until a completion succeeds again."""
        while not self.serves():
            assert time.monotonic() - since < within_s, f"not serving {within_s}s later:\n{self.up.output()}"
            time.sleep(0.5)
        return time.monotonic() - since


def prompt_for(path: str, tag: str) -> str:
    """A prompt of its own (no shared cached prefix) on the local or the remote path."""
    return f"[{tag}] Tell me a story." if path == "local" else f"[{tag}] {LONG * 2}"


async def gather_within(deadline_s: float, *coros):
    """Every result (or exception) within the deadline: a hang fails the test."""
    return await asyncio.wait_for(asyncio.gather(*coros, return_exceptions=True), deadline_s)
