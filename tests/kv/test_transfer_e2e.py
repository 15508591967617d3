"""End to end over real sockets on this host: TCP and shared memory, same tests for both."""

import asyncio
import glob
import os
import time

import pytest
import torch
from kv_helpers import CacheSink, make_ticket, random_caches, receiver_for, run, sender_for

from baton.kv.layout import gather_layer
from baton.kv.messages import ErrorCode
from baton.kv.shm import segment_dir
from baton.kv.transport import TransferError, TransferRefused

LAYERS, HEADS, HEAD_DIM = 4, 4, 8
SRC_BLOCKS, SRC_BLOCK_SIZE = [6, 1, 4, 0, 7], 16  # prefill side: 16-token blocks
DST_BLOCKS, DST_BLOCK_SIZE = [3, 0, 5], 32  # decode side: 32-token blocks
NUM_TOKENS = 70
SAMPLER_STATE = "torch-cpu-mt19937/1:" + "QUJD" * 1686  # opaque to the transport


def segments_left():
    return glob.glob(os.path.join(segment_dir(), "baton-kv-*"))


def setup(
    transport_name, dtype=torch.bfloat16, heads=(0, HEADS), worker_id="decode-0", **ticket_fields
):
    src = random_caches(LAYERS, 8, SRC_BLOCK_SIZE, HEADS, HEAD_DIM, dtype, seed=11)
    sink = CacheSink(
        LAYERS, 6, DST_BLOCK_SIZE, heads[1] - heads[0], HEAD_DIM, dtype, head_base=heads[0]
    )
    fields = dict(
        request_id="req-e2e",
        worker_id=worker_id,
        block_ids=DST_BLOCKS,
        block_size=DST_BLOCK_SIZE,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        head_start=heads[0],
        head_end=heads[1],
        num_tokens=NUM_TOKENS,
    )
    fields.update(ticket_fields)
    return src, sink, make_ticket(**fields)


def payload_of(src, layer, ticket):
    k, v = src[layer]
    return gather_layer(
        k, v, SRC_BLOCKS, SRC_BLOCK_SIZE, ticket.num_tokens, ticket.head_start, ticket.head_end
    )


def assert_arrived(src, sink, ticket):
    for layer in range(LAYERS):
        k, v = sink.caches[layer]
        got = gather_layer(k, v, DST_BLOCKS, DST_BLOCK_SIZE, NUM_TOKENS, 0, ticket.num_heads)
        assert torch.equal(got, payload_of(src, layer, ticket)), f"layer {layer} differs"


async def transfer_all(sender, ticket, src, first_token=17, logprob=-0.25, sampler_state=None):
    transfer = await sender.open(ticket)
    for layer in range(LAYERS):
        await transfer.send_layer(layer, payload_of(src, layer, ticket))
    ack = await transfer.finish(first_token, logprob, timeout=10, sampler_state=sampler_state)
    return transfer, ack


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reblocked_transfer_arrives_intact(transport_name, dtype):
    src, sink, planned = setup(transport_name, dtype)

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            ticket = sink.issue(
                make_ticket(**{**planned.to_dict(), "kv_endpoint": receiver.endpoint})
            )
            async with sender_for(transport_name, receiver.endpoint) as sender:
                _, ack = await transfer_all(sender, ticket, src)
                assert ack.layers == LAYERS and ack.total_bytes == ticket.total_payload_nbytes
                # A second request reuses the same connection.
                again = sink.issue(make_ticket(**{**ticket.to_dict(), "request_id": "req-2"}))
                await transfer_all(sender, again, src, first_token=3, sampler_state=SAMPLER_STATE)
            return ticket

    ticket = run(main())
    assert_arrived(src, sink, ticket)
    assert sink.finished == {"req-e2e": (17, -0.25), "req-2": (3, -0.25)}
    # a seeded request's sampler state rides on END to the sink; an unseeded one has none
    assert sink.sampler_states == {"req-e2e": None, "req-2": SAMPLER_STATE}
    assert sink.stats.total_bytes == ticket.total_payload_nbytes and not sink.aborted
    assert not segments_left()


def test_head_split_across_two_receivers(transport_name):
    src = random_caches(LAYERS, 8, SRC_BLOCK_SIZE, HEADS, HEAD_DIM, torch.float32, seed=5)
    halves = [(0, HEADS // 2), (HEADS // 2, HEADS)]

    async def main():
        sinks = []
        for i, heads in enumerate(halves):
            _, sink, ticket = setup(
                transport_name, torch.float32, heads=heads, worker_id=f"decode-{i}"
            )
            async with receiver_for(transport_name, sink, worker_id=f"decode-{i}") as receiver:
                sink.issue(ticket)
                async with sender_for(
                    transport_name, receiver.endpoint, worker_id=f"decode-{i}"
                ) as sender:
                    await transfer_all(sender, ticket, src)
            sinks.append(sink)
        return sinks

    sinks = run(main())
    for layer in range(LAYERS):
        k, v = src[layer]
        whole = gather_layer(k, v, SRC_BLOCKS, SRC_BLOCK_SIZE, NUM_TOKENS, 0, HEADS)
        parts = [
            gather_layer(*s.caches[layer], DST_BLOCKS, DST_BLOCK_SIZE, NUM_TOKENS, 0, HEADS // 2)
            for s in sinks
        ]
        assert torch.equal(torch.cat(parts, dim=2), whole)


def test_corrupted_layer_is_resent(transport_name):
    src, sink, ticket = setup(transport_name)
    hits = []

    def corrupt_layer_2_once(header, view):
        if header.layer == 2 and not hits:
            hits.append(header.layer)
            bad = bytearray(view)
            bad[7] ^= 0xFF
            return bad
        return view

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            sink.issue(ticket)
            async with sender_for(
                transport_name, receiver.endpoint, on_wire=corrupt_layer_2_once
            ) as sender:
                transfer, ack = await transfer_all(sender, ticket, src)
                return transfer.resent_layers

    assert run(main()) == [2]
    assert_arrived(src, sink, ticket)
    assert sink.writes.count(("req-e2e", 2)) == 1 and "req-e2e" in sink.finished
    assert not segments_left()


def test_persistent_corruption_gives_up(transport_name):
    src, sink, ticket = setup(transport_name)

    def always_corrupt_layer_1(header, view):
        if header.layer != 1:
            return view
        bad = bytearray(view)
        bad[0] ^= 1
        return bad

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            sink.issue(ticket)
            async with sender_for(
                transport_name, receiver.endpoint, on_wire=always_corrupt_layer_1, max_resends=2
            ) as sender:
                with pytest.raises(TransferRefused) as err:
                    await transfer_all(sender, ticket, src)
                assert err.value.info.code == ErrorCode.CHECKSUM and "gave up after 2" in str(
                    err.value
                )
            await asyncio.sleep(0.1)

    run(main())
    assert ("req-e2e", 1) not in sink.writes and "req-e2e" not in sink.finished
    assert "req-e2e" in sink.aborted  # the sender hung up mid-transfer
    assert not segments_left()


def test_wrong_token_is_refused_and_nothing_written(transport_name):
    src, sink, ticket = setup(transport_name)

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            sink.issue(ticket)
            sender = sender_for(transport_name, receiver.endpoint, token="not-the-token")
            with pytest.raises(TransferRefused) as err:
                await sender.open(ticket)
            assert err.value.info.code == ErrorCode.AUTH
            await sender.close()

    run(main())
    assert sink.untouched() and not sink.finished


def test_connection_for_another_worker_is_refused(transport_name):
    src, sink, ticket = setup(transport_name, worker_id="decode-9")

    async def main():
        async with receiver_for(transport_name, sink, worker_id="decode-0") as receiver:
            sink.issue(ticket)
            async with sender_for(
                transport_name, receiver.endpoint, worker_id="decode-9"
            ) as sender:
                with pytest.raises(TransferRefused) as err:
                    await sender.open(ticket)
                assert err.value.info.code == ErrorCode.WRONG_WORKER

    run(main())
    assert sink.untouched()


@pytest.mark.parametrize(
    "case, code",
    [
        ("expired", ErrorCode.EXPIRED),
        ("unknown", ErrorCode.UNKNOWN_REQUEST),
        ("other_worker", ErrorCode.WRONG_WORKER),
    ],
)
def test_unusable_tickets_are_refused(transport_name, case, code):
    src, sink, ticket = setup(transport_name)

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            if case == "expired":
                sink.issue(make_ticket(**{**ticket.to_dict(), "expires_at": time.time() - 1}))
            elif case == "other_worker":
                # The sink holds a ticket another worker issued (a stale or forged entry).
                sink.issue(make_ticket(**{**ticket.to_dict(), "worker_id": "decode-7"}))
            async with sender_for(transport_name, receiver.endpoint) as sender:
                with pytest.raises(TransferRefused) as err:
                    await transfer_all(sender, ticket, src)
                assert err.value.info.code == code

    run(main())
    assert sink.untouched() and not sink.finished
    assert not segments_left()


@pytest.mark.parametrize("case", ["duplicate", "out_of_range", "shape"])
def test_bad_layers_are_refused(transport_name, case):
    src, sink, ticket = setup(transport_name)

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            sink.issue(ticket)
            async with sender_for(transport_name, receiver.endpoint) as sender:
                transfer = await sender.open(ticket)
                await transfer.send_layer(0, payload_of(src, 0, ticket))
                # _ship skips the sender's own checks: this is a misbehaving peer.
                if case == "duplicate":
                    await transfer._ship(0, payload_of(src, 1, ticket))
                elif case == "out_of_range":
                    await transfer._ship(LAYERS, payload_of(src, 1, ticket))
                else:
                    await transfer._ship(1, payload_of(src, 1, ticket)[:, :-1].contiguous())
                with pytest.raises(TransferRefused) as err:
                    await asyncio.wait_for(asyncio.shield(transfer._done), 5)
                return err.value.info

    info = run(main())
    expected = {
        "duplicate": ErrorCode.DUPLICATE_LAYER,
        "out_of_range": ErrorCode.LAYER_OUT_OF_RANGE,
        "shape": ErrorCode.SHAPE_MISMATCH,
    }
    assert info.code == expected[case], info
    assert sink.writes == [("req-e2e", 0)]  # only the good layer was stored
    k, v = sink.caches[0]
    got = gather_layer(k, v, DST_BLOCKS, DST_BLOCK_SIZE, NUM_TOKENS, 0, HEADS)
    assert torch.equal(got, payload_of(src, 0, ticket))  # the duplicate did not overwrite
    assert all(c[0].abs().sum() == 0 for c in sink.caches[1:])
    assert not segments_left()


def test_sender_gone_mid_transfer_aborts(transport_name):
    src, sink, ticket = setup(transport_name)

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            sink.issue(ticket)
            sender = sender_for(transport_name, receiver.endpoint)
            transfer = await sender.open(ticket)
            await transfer.send_layer(0, payload_of(src, 0, ticket))
            await sender.close()
            for _ in range(100):
                if sink.aborted:
                    break
                await asyncio.sleep(0.02)

    run(main())
    assert "sender connection closed" in sink.aborted["req-e2e"]
    assert not sink.finished and not segments_left()


def test_ticket_expiring_mid_transfer_aborts(transport_name):
    src, sink, ticket = setup(transport_name, expires_at=time.time() + 0.6)

    async def main():
        async with receiver_for(transport_name, sink, sweep_interval=0.05) as receiver:
            sink.issue(ticket)
            async with sender_for(transport_name, receiver.endpoint) as sender:
                transfer = await sender.open(ticket)
                await transfer.send_layer(0, payload_of(src, 0, ticket))
                with pytest.raises(TransferRefused) as err:
                    await asyncio.wait_for(asyncio.shield(transfer._done), 5)
                return err.value.info.code

    assert run(main()) == ErrorCode.EXPIRED
    assert "expired" in sink.aborted["req-e2e"] and not sink.finished


def test_finish_without_ack_times_out(transport_name):
    """A receiver that never answers END: finish() gives up at its deadline."""
    src, sink, ticket = setup(transport_name)

    async def main():
        async with receiver_for(transport_name, sink) as receiver:
            sink.issue(ticket)
            sink.finish = lambda *a, **kw: asyncio.sleep(3600)  # engine stuck starting the sequence
            async with sender_for(transport_name, receiver.endpoint) as sender:
                started = time.monotonic()
                with pytest.raises(TransferError, match="no ACK"):
                    await finish_fast(sender, ticket, src)
                assert time.monotonic() - started < 3

    async def finish_fast(sender, ticket, src):
        transfer = await sender.open(ticket)
        for layer in range(LAYERS):
            await transfer.send_layer(layer, payload_of(src, layer, ticket))
        await transfer.finish(1, timeout=0.5)

    run(main())
