"""Workloads as lists of request specs (pure; seeded, so runs are repeatable).

Prompts are token ids (sent as such), so their lengths are exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    output_len: int
    kind: str = "request"
    at: float | None = None  # fixed send time (seconds) for timed workloads


def _tokens(rng: random.Random, n: int, vocab: tuple[int, int]) -> list[int]:
    return [rng.randrange(*vocab) for _ in range(n)]


def random_dataset(num: int, input_len: int, output_len: int, seed: int = 0, range_ratio: float = 0.0,
                   vocab: tuple[int, int] = (100, 30000)) -> list[RequestSpec]:
    """Uniform lengths in [len·(1−r), len·(1+r)]."""
    rng = random.Random(seed)

    def around(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [RequestSpec(_tokens(rng, around(input_len), vocab), around(output_len)) for _ in range(num)]


def shared_prefix_dataset(num: int, prefix_len: int, suffix_len: int, output_len: int,
                          num_prefixes: int = 4, seed: int = 0,
                          vocab: tuple[int, int] = (100, 30000)) -> list[RequestSpec]:
    """`num_prefixes` system prompts shared round robin, each request with its own suffix."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    return [RequestSpec(prefixes[i % num_prefixes] + _tokens(rng, suffix_len, vocab), output_len,
                        kind=f"prefix-{i % num_prefixes}") for i in range(num)]


def multi_turn_dataset(conversations: int, turns: int, system_len: int, user_len: int, reply_len: int,
                       output_len: int, seed: int = 0,
                       vocab: tuple[int, int] = (100, 30000)) -> list[list[RequestSpec]]:
    """Chat sessions: each turn's prompt is one system prompt (shared by every session), the
    session's earlier turns and a new user message. The earlier replies in a prompt are
    fixed stand-ins of `reply_len` tokens, not what the server generated, so every server
    gets the same prompts: a turn finds at most the previous turn's prompt in a prefix
    cache. Turn 1 is kind "first", the rest "follow-up"."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab)
    sessions = []
    for _ in range(conversations):
        history, specs = list(system), []
        for turn in range(turns):
            history += _tokens(rng, user_len, vocab)
            specs.append(RequestSpec(list(history), output_len, kind="first" if turn == 0 else "follow-up"))
            history += _tokens(rng, reply_len, vocab)
        sessions.append(specs)
    return sessions


def interference_longs(duration_s: float, every_s: float, input_len: int, output_len: int,
                       first_at_s: float = 2.0, seed: int = 1,
                       vocab: tuple[int, int] = (100, 30000)) -> list[RequestSpec]:
    """The long prompts of the interference workload, one every `every_s` seconds (the
    short streams run alongside them as closed loops)."""
    rng = random.Random(seed)
    count = max(0, int((duration_s - first_at_s) // every_s) + 1) if every_s > 0 else 0
    return [RequestSpec(_tokens(rng, input_len, vocab), output_len, kind="long", at=first_at_s + i * every_s)
            for i in range(count) if first_at_s + i * every_s < duration_s]
