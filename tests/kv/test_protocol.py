"""The receiver's per-request rules, without sockets."""

import time

import pytest
import torch
from kv_helpers import make_ticket

from baton.kv.messages import EndSummary, ErrorCode
from baton.kv.protocol import Refusal, TransferProgress, check_ticket_usable
from baton.kv.wire import layer_header


def header_for(ticket, layer, tokens=None, heads=None, blocks=None, dtype=torch.float32):
    payload = torch.zeros(
        2, tokens or ticket.num_tokens, heads or ticket.num_heads, ticket.head_dim, dtype=dtype
    )
    used = -(-ticket.num_tokens // ticket.block_size)
    return layer_header(
        ticket.request_id,
        layer,
        blocks or ticket.block_ids[:used],
        payload,
        head_start=ticket.head_start,
    )


def refusal_code(fn, *args):
    with pytest.raises(Refusal) as err:
        fn(*args)
    return err.value.info.code


def test_ticket_usability():
    now = time.time()
    ticket = make_ticket()
    assert check_ticket_usable(ticket, "req-1", "decode-0", now) is ticket
    assert (
        refusal_code(check_ticket_usable, None, "req-1", "decode-0", now)
        == ErrorCode.UNKNOWN_REQUEST
    )
    assert (
        refusal_code(check_ticket_usable, ticket, "req-1", "decode-1", now)
        == ErrorCode.WRONG_WORKER
    )
    assert (
        refusal_code(check_ticket_usable, ticket, "req-1", "decode-0", now + 3600)
        == ErrorCode.EXPIRED
    )


def test_layers_must_match_the_ticket():
    ticket = make_ticket(head_start=1, head_end=3)
    progress = TransferProgress(ticket)
    progress.check_new_layer(header_for(ticket, 0))
    assert (
        refusal_code(progress.check_new_layer, header_for(ticket, 4))
        == ErrorCode.LAYER_OUT_OF_RANGE
    )
    for bad in (
        header_for(ticket, 1, tokens=39),
        header_for(ticket, 1, heads=3),
        header_for(ticket, 1, blocks=[5, 2, 8]),
        header_for(ticket, 1, dtype=torch.float16),
    ):
        assert refusal_code(progress.check_new_layer, bad) == ErrorCode.SHAPE_MISMATCH
    progress.record_layer(header_for(ticket, 0), time.time())
    assert (
        refusal_code(progress.check_new_layer, header_for(ticket, 0)) == ErrorCode.DUPLICATE_LAYER
    )


def test_end_waits_for_missing_layers_and_checks_the_summary():
    ticket = make_ticket(num_layers=2)
    progress = TransferProgress(ticket)
    headers = [header_for(ticket, i) for i in range(2)]
    crcs = [h.payload_crc for h in headers]
    bad_count = EndSummary(
        first_token=1, total_bytes=ticket.total_payload_nbytes, layer_checksums=crcs[:1]
    )
    assert refusal_code(progress.record_end, bad_count) == ErrorCode.SUMMARY_MISMATCH
    bad_bytes = EndSummary(first_token=1, total_bytes=5, layer_checksums=crcs)
    assert refusal_code(progress.record_end, bad_bytes) == ErrorCode.SUMMARY_MISMATCH
    progress.record_layer(headers[0], 1.0)
    progress.record_end(
        EndSummary(first_token=1, total_bytes=ticket.total_payload_nbytes, layer_checksums=crcs)
    )
    assert not progress.ready_to_finish() and progress.missing_layers == [1]
    progress.record_layer(headers[1], 2.0)
    assert progress.ready_to_finish()
    assert progress.bytes_received == ticket.total_payload_nbytes


def test_summary_disagreeing_with_received_layers_is_refused():
    ticket = make_ticket(num_layers=1)
    progress = TransferProgress(ticket)
    progress.record_layer(header_for(ticket, 0), 1.0)
    progress.record_end(
        EndSummary(first_token=1, total_bytes=ticket.total_payload_nbytes, layer_checksums=[123])
    )
    assert refusal_code(progress.ready_to_finish) == ErrorCode.SUMMARY_MISMATCH
