"""The load generator's chat sessions against the real router and a loopback fake worker:
turns of a session one after another with the reader's pause between them, no more
sessions at once than asked."""

from __future__ import annotations

import pytest
from router_harness import running_router

from baton.loadgen.datasets import multi_turn_dataset
from baton.loadgen.runner import Target, run_conversations

pytestmark = pytest.mark.asyncio
THINK_S = 0.3


async def test_sessions_take_turns_and_pause_between_them(fake_workers, model_info):
    decode = await fake_workers("decode")
    sessions = multi_turn_dataset(3, turns=2, system_len=16, user_len=4, reply_len=3, output_len=3, seed=2)
    async with running_router(model_info, [decode.url]) as url:
        target = Target(url, "smollm2")
        try:
            records = await run_conversations(target, sessions, 2, lambda record: None, think_s=THINK_S)
        finally:
            await target.close()
    assert len(records) == 6 and all(r.success for r in records), [r.error for r in records]
    assert [r.prompt_len for r in records] == [20, 27] * 3  # each session's turns, in order
    spans = []
    for first, second in zip(records[::2], records[1::2]):
        first_end = first.start + first.e2e
        assert second.start >= first_end + THINK_S * 0.9  # the pause, then the next turn
        spans.append((first.start, second.start + second.e2e))
    # two sessions at once: the third starts only when one of the first two has ended
    assert spans[2][0] >= min(spans[0][1], spans[1][1]) - 0.01
    assert spans[1][0] < spans[0][1]  # and the second ran beside the first
