"""The soak's clients: mixed requests through the official OpenAI client, some of them left
on purpose (a stream dropped after a few chunks, a request given up by its timeout)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import openai

LONG = "A relay race hands a baton from runner to runner; Baton hands a KV cache from worker to worker. "

# (share, name): what each request of the mix does
MIX = [(0.35, "stream"), (0.15, "complete"), (0.15, "chat_stream"), (0.05, "chat"),
       (0.15, "stream_dropped"), (0.15, "given_up")]


def prompt(rng: random.Random, serial: int) -> str:
    """Short prompts stay on the decode worker, long ones go to the prefill worker; the serial
    keeps each prompt's cached prefix its own."""
    if rng.random() < 0.3:
        return f"[{serial}] {LONG * rng.randint(1, 3)}"
    return f"[{serial}] {rng.choice(['Tell me a story.', 'Count to ten:', 'Why is the sky blue?'])}"


async def one_request(api: openai.AsyncOpenAI, model: str, rng: random.Random, serial: int) -> str:
    """Run one request of the mix; return its outcome."""
    kind = rng.choices([k for _, k in MIX], [w for w, _ in MIX])[0]
    text = prompt(rng, serial)
    tokens = rng.randint(4, 48)
    extra = {"ignore_eos": True}
    try:
        if kind in ("stream", "stream_dropped"):
            stream = await api.completions.create(model=model, prompt=text, max_tokens=tokens if kind == "stream"
                                                  else 400, stream=True, extra_body=extra)
            leave_after = rng.randint(1, 8) if kind == "stream_dropped" else None
            seen = 0
            async for chunk in stream:
                seen += bool(chunk.choices and chunk.choices[0].text)
                if leave_after is not None and seen >= leave_after:
                    await stream.close()
                    return "dropped"
            return "ok"
        if kind == "complete":
            await api.completions.create(model=model, prompt=text, max_tokens=tokens, extra_body=extra)
            return "ok"
        if kind in ("chat", "chat_stream"):
            messages = [{"role": "user", "content": text}]
            answer = await api.chat.completions.create(model=model, messages=messages, max_tokens=tokens,
                                                       stream=kind == "chat_stream", extra_body=extra)
            if kind == "chat_stream":
                async for _ in answer:
                    pass
            return "ok"
        # given_up: the client's own timeout ends the wait mid-generation
        await api.with_options(timeout=rng.uniform(0.3, 2.0)).completions.create(
            model=model, prompt=text, max_tokens=400, extra_body=extra)
        return "ok"
    except openai.APITimeoutError:
        return "gave_up" if kind == "given_up" else "error: timeout"
    except openai.RateLimitError as e:
        return "429" if e.response.headers.get("retry-after") else "error: 429 without Retry-After"
    except openai.APIError as e:
        return f"error: {type(e).__name__}: {str(e)[:120]}"


async def run_clients(base_url: str, model: str, clients: int, seconds: float, seed: int = 0) -> Counter:
    """`clients` loops of requests for `seconds`; a count of outcomes."""
    outcomes: Counter = Counter()
    deadline = time.monotonic() + seconds
    serial = 0

    async def client(index: int) -> None:
        nonlocal serial
        rng = random.Random(seed * 1000 + index)
        api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        while time.monotonic() < deadline:
            serial += 1
            outcome = await one_request(api, model, rng, serial)
            outcomes[outcome if not outcome.startswith("error") else "error"] += 1
            if outcome.startswith("error"):
                outcomes[outcome] += 1  # the message too, to see what failed

    await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes
