"""A TCP receiver is woken once a batch of the frames due has queued (kv/low_water.py), and a
sender that stops short never holds up what comes after it on the connection."""

import asyncio
import time

import pytest
import torch
from kv_helpers import DirectSink, make_ticket, random_caches, receiver_for, run, sender_for

from baton.kv.layout import gather_layer
from baton.kv.low_water import LOW_WATER_CAP_BYTES, LOW_WATER_PATIENCE_S, low_water_bytes

LAYERS, HEADS, HEAD_DIM, TOKENS = 16, 4, 8, 70
SRC_BLOCKS, BLOCK_SIZE = [6, 1, 4, 0, 7], 16


def test_the_reader_wakes_at_half_of_what_is_due():
    assert low_water_bytes([(10, 1000)]) == 5000
    assert low_water_bytes([(4, 1000), (6, 500)]) == (4000 + 3000) // 2
    assert low_water_bytes([(10_000, 1 << 20)]) == LOW_WATER_CAP_BYTES


@pytest.mark.parametrize("due", [[], [(1, 1000)], [(0, 1000), (1, 50)], [(5, 0)], [(-3, 100)]])
def test_under_two_frames_due_any_byte_wakes_it(due):
    # the last frame, and the END after it, are read as they come
    assert low_water_bytes(due) == 1


def test_never_more_than_is_due_so_a_partly_read_frame_is_finished():
    for frames in range(2, 40):
        for nbytes in (1, 17, 4096, 300_000):
            wake = low_water_bytes([(frames, nbytes)])
            # with any part of the next frame read, what is still to come covers the mark
            assert 1 <= wake <= (frames - 1) * nbytes


class TimedSink(DirectSink):
    """Notes when the receiver begins each layer it reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.begun: list[float] = []

    def begin_layer_write(self, ticket, layer):
        self.begun.append(time.monotonic())
        return super().begin_layer_write(ticket, layer)


def ticket_for(request_id: str, blocks: list[int]):
    return make_ticket(request_id=request_id, block_ids=blocks, block_size=BLOCK_SIZE, dtype="bfloat16",
                       num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, head_end=HEADS,
                       num_tokens=TOKENS)


def payload(src, layer: int):
    return gather_layer(*src[layer], SRC_BLOCKS, BLOCK_SIZE, TOKENS, 0, HEADS)


async def send_layers(transfer, src, layers, pace_s: float = 0.0) -> None:
    """Those layers of `src`, each `pace_s` after the one before (a layer's compute)."""
    for layer in layers:
        await transfer.send_layer(layer, payload(src, layer))
        await asyncio.sleep(pace_s)


def over_tcp(sink, send):
    """`await send(sender)` with a sender connected to a TCP receiver around `sink`; its
    result once both are closed again."""

    async def main():
        async with receiver_for("tcp", sink) as receiver:
            sender = sender_for("tcp", receiver.endpoint)
            try:
                return await send(sender)
            finally:
                await sender.close()

    return run(main())


def bursts(times: list[float], gap_s: float) -> int:
    return 1 + sum(b - a > gap_s for a, b in zip(times, times[1:]))


def test_layers_paced_by_the_prefill_are_read_in_a_few_batches():
    src = random_caches(LAYERS, 8, BLOCK_SIZE, HEADS, HEAD_DIM, torch.bfloat16, seed=5)
    sink = TimedSink(LAYERS, 16, BLOCK_SIZE, HEADS, HEAD_DIM, torch.bfloat16)
    ticket = sink.issue(ticket_for("paced", [3, 9, 1, 12, 5]))

    async def send(sender):
        transfer = await sender.open(ticket)
        await send_layers(transfer, src, range(LAYERS), pace_s=0.01)
        return await transfer.finish(7, None, timeout=10)

    ack = over_tcp(sink, send)
    assert ack.layers == LAYERS and sink.finished["paced"] == (7, None)
    for layer in range(LAYERS):
        got = gather_layer(*sink.caches[layer], ticket.block_ids, BLOCK_SIZE, TOKENS, 0, HEADS)
        assert torch.equal(got, payload(src, layer))
    # one wakeup a layer would begin them ~10 ms apart, in 16 bursts; halving what is due
    # reads the first, then 7 or 8 at once, and so on
    assert bursts(sink.begun, gap_s=0.004) <= LAYERS // 2, [round(t - sink.begun[0], 4) for t in sink.begun]


def test_a_sender_that_stops_short_does_not_hold_up_the_next_transfer():
    src = random_caches(LAYERS, 8, BLOCK_SIZE, HEADS, HEAD_DIM, torch.bfloat16, seed=6)
    sink = TimedSink(LAYERS, 16, BLOCK_SIZE, HEADS, HEAD_DIM, torch.bfloat16)
    stopped = sink.issue(ticket_for("stopped", [0, 1, 2, 3, 4]))
    complete = sink.issue(ticket_for("complete", [5, 6, 7, 8, 9]))

    async def send(sender):
        first = await sender.open(stopped)
        await send_layers(first, src, range(3))  # then its prefill fails: no more frames, no END
        second = await sender.open(complete)  # the same connection
        started = time.monotonic()
        # paced, so it is read in batches and its last frames come to a drained socket
        await send_layers(second, src, range(LAYERS), pace_s=0.01)
        ack = await second.finish(9, None, timeout=10)
        return ack, time.monotonic() - started

    ack, seconds = over_tcp(sink, send)
    assert ack.layers == LAYERS and sink.finished["complete"] == (9, None)
    # the frames the first still owed counted as due until it went quiet; at worst the
    # second's last frames waited out the patience once
    assert seconds < LOW_WATER_PATIENCE_S + 1.5, seconds
    assert "stopped" not in sink.finished
