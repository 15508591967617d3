"""Frame headers and control documents: round trips and every refusal."""

import struct
from dataclasses import replace

import pytest
import torch

from baton.kv.messages import (
    MAX_SAMPLER_STATE_CHARS,
    Ack,
    EndSummary,
    ErrorCode,
    ErrorInfo,
    Hello,
    decode_control,
    encode_control,
)
from baton.kv.wire import (
    PREAMBLE_SIZE,
    BadMagic,
    ChecksumMismatch,
    FrameHeader,
    FrameKind,
    HeaderCorrupt,
    LayerHeaders,
    SizeMismatch,
    UnknownKind,
    UnsupportedVersion,
    WireError,
    body_length,
    control_header,
    decode_header,
    encode_frame,
    encode_header,
    header_nbytes,
    layer_header,
    payload_tensor,
    tensor_bytes,
    verify_payload,
)


def a_layer(dtype=torch.bfloat16):
    payload = torch.randn(2, 40, 2, 8).to(dtype)
    return layer_header("req-7", 3, [4, 9, 1], payload, head_start=2), payload


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_layer_frame_round_trip(dtype):
    header, payload = a_layer(dtype)
    buffers = encode_frame(header, payload)
    assert len(buffers) == 2 and buffers[1].obj is not None  # payload goes out as a view
    raw_header = bytes(buffers[0])
    assert body_length(raw_header[:PREAMBLE_SIZE]) == len(raw_header) - PREAMBLE_SIZE
    decoded = decode_header(raw_header)
    assert decoded == header
    assert (decoded.token_start, decoded.token_end, decoded.head_start, decoded.head_end) == (
        0,
        40,
        2,
        4,
    )
    received = bytearray(buffers[1])
    verify_payload(decoded, received)
    assert torch.equal(payload_tensor(decoded, received), payload)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_transfers_layer_headers_encode_as_each_layer_alone_would(dtype):
    payload = torch.randn(2, 40, 2, 8).to(dtype)
    headers = LayerHeaders("req-7", [4, 9, 1], payload.shape, dtype, head_start=2)
    for layer in (0, 3, 29):
        alone = layer_header("req-7", layer, [4, 9, 1], payload, head_start=2)
        assert headers.header(layer, alone.payload_crc) == alone
        raw = headers.encode(layer, alone.payload_crc)
        assert raw == encode_header(alone)
        assert decode_header(raw) == alone


def test_layer_headers_refuse_what_a_header_may_not_say():
    with pytest.raises(WireError, match="request_id"):
        LayerHeaders("r" * 300, [1], (2, 16, 2, 8), torch.float32)
    with pytest.raises(SizeMismatch, match="shape"):
        LayerHeaders("req", [1], (3, 16, 2, 8), torch.float32)
    headers = LayerHeaders("req", [1], (2, 16, 2, 8), torch.float32)
    with pytest.raises(WireError, match="layer"):
        headers.encode(-1, 0)
    with pytest.raises(WireError, match="wire width"):
        headers.encode(0, 1 << 32)


def test_by_reference_payload_has_no_inline_bytes():
    header, payload = a_layer()

    by_ref = replace(header, ref="baton-kv-0123456789abcdef-1")
    assert by_ref.inline_nbytes == 0 and len(encode_frame(by_ref)) == 1
    assert decode_header(encode_header(by_ref)) == by_ref


def test_control_documents_round_trip():
    docs = [
        (FrameKind.HELLO, Hello(token="t", worker_id="decode-0", sender_id="prefill-1")),
        (
            FrameKind.END,
            EndSummary(first_token=42, total_bytes=1024, layer_checksums=[1, 2], logprob=-0.5),
        ),
        (FrameKind.ACK, Ack(layers=2, total_bytes=1024)),
        (FrameKind.ERROR, ErrorInfo(ErrorCode.CHECKSUM, "bad", layer=3)),
    ]
    for kind, doc in docs:
        header, body = encode_control(kind, "req-1", doc)
        raw = encode_frame(header, body)
        decoded = decode_header(bytes(raw[0]))
        verify_payload(decoded, body)
        assert decode_control(decoded, body) == doc
    assert (
        decode_header(encode_header(encode_control(FrameKind.ERROR, "", docs[3][1])[0])).layer == 3
    )


def test_bad_magic_version_kind():
    raw = bytearray(encode_header(a_layer()[0]))
    with pytest.raises(BadMagic, match="magic"):
        decode_header(b"HTTP" + raw[4:])
    bumped = raw[:4] + bytes([9]) + raw[5:]
    with pytest.raises(UnsupportedVersion, match="version"):
        decode_header(bumped)
    with pytest.raises(UnknownKind, match="kind"):
        decode_header(raw[:5] + bytes([77]) + raw[6:])


def test_header_corruption_and_truncation():
    raw = bytearray(encode_header(a_layer()[0]))
    flipped = bytearray(raw)
    flipped[PREAMBLE_SIZE + 2] ^= 0x40  # inside the layer field
    with pytest.raises(HeaderCorrupt, match="checksum"):
        decode_header(flipped)
    with pytest.raises(SizeMismatch):
        decode_header(raw[:-1])
    huge = bytearray(raw)
    struct.pack_into("<I", huge, 8, 1 << 30)
    with pytest.raises(SizeMismatch, match="body length"):
        body_length(bytes(huge[:PREAMBLE_SIZE]))


def test_payload_size_and_checksum_mismatch():
    header, payload = a_layer()
    data = bytearray(tensor_bytes(payload))
    with pytest.raises(SizeMismatch, match="payload"):
        verify_payload(header, data[:-2])
    data[100] ^= 1
    with pytest.raises(ChecksumMismatch, match="layer 3 of 'req-7'"):
        verify_payload(header, data)
    with pytest.raises(SizeMismatch, match="inline bytes"):
        encode_frame(header, b"short")


def test_inconsistent_headers_are_refused_on_both_ends():
    header, _ = a_layer()

    with pytest.raises(SizeMismatch, match="payload_nbytes"):
        encode_header(replace(header, payload_nbytes=header.payload_nbytes + 2))
    with pytest.raises(SizeMismatch, match="shape"):
        encode_header(replace(header, shape=(2, 41, 2, 8)))
    with pytest.raises(WireError, match="layer"):
        encode_header(replace(header, layer=-1))
    with pytest.raises(WireError, match="non-empty"):
        encode_header(replace(header, head_end=header.head_start))
    with pytest.raises(WireError, match="no tensor fields"):
        encode_header(FrameHeader(FrameKind.ACK, dtype="float32"))
    with pytest.raises(WireError, match="fit"):
        encode_header(replace(header, head_start=70000, head_end=70002))


def test_control_payload_validation():
    header, body = encode_control(
        FrameKind.END, "r", EndSummary(first_token=1, total_bytes=2, layer_checksums=[3])
    )
    for bad, field in [
        (b'{"first_token": -1, "total_bytes": 2, "layer_checksums": []}', "first_token"),
        (b'{"first_token": 1, "total_bytes": 2, "layer_checksums": ["x"]}', "layer_checksums"),
        (b'{"first_token": 1, "total_bytes": 2, "layer_checksums": [], "extra": 1}', "extra"),
        (b"not json", "END"),
    ]:
        with pytest.raises(WireError, match=field):
            decode_control(header, bad)
    err_header, _ = encode_control(FrameKind.ERROR, "r", ErrorInfo(ErrorCode.AUTH, "x"))
    with pytest.raises(WireError, match="code"):
        decode_control(err_header, b'{"code": "nope", "message": "x", "layer": -1}')


def test_end_carries_a_sampler_state_and_stays_as_before_without_one():
    state = "torch-cpu-mt19937/1:" + "A" * 6744
    end = EndSummary(first_token=42, total_bytes=1024, layer_checksums=[1, 2], logprob=-0.5,
                     sampler_state=state)
    header, body = encode_control(FrameKind.END, "req-1", end)
    decoded = decode_header(bytes(encode_frame(header, body)[0]))
    assert decode_control(decoded, body) == end
    # no seed: END is byte for byte what it was before sampler_state existed, so a receiver
    # that predates it still reads it
    plain = replace(end, sampler_state=None)
    _, plain_body = encode_control(FrameKind.END, "req-1", plain)
    assert plain_body == b'{"first_token":42,"total_bytes":1024,"layer_checksums":[1,2],"logprob":-0.5}'
    assert decode_control(decoded, plain_body) == plain
    assert decode_control(decoded, plain_body.replace(b"}", b',"sampler_state":null}')) == plain


def test_end_refuses_a_malformed_sampler_state():
    header, _ = encode_control(
        FrameKind.END, "r", EndSummary(first_token=1, total_bytes=2, layer_checksums=[3])
    )
    for bad in (b'""', b"7", b'["x"]', b'"' + b"x" * (MAX_SAMPLER_STATE_CHARS + 1) + b'"'):
        doc = b'{"first_token": 1, "total_bytes": 2, "layer_checksums": [], "sampler_state": ' + bad + b"}"
        with pytest.raises(WireError, match="sampler_state"):
            decode_control(header, doc)


@pytest.mark.parametrize("header", [
    layer_header("req-7", 3, [4, 1, 9], torch.zeros(2, 40, 4, 8, dtype=torch.bfloat16)),
    layer_header("ünïcode-id", 0, list(range(300)), torch.zeros(2, 16, 2, 4), ref="baton-kv-0123456789abcdef-1"),
    control_header(FrameKind.END, "req-7", b'{"first_token": 3}'),
    control_header(FrameKind.HELLO, "", b"{}"),
])
def test_header_nbytes_is_the_length_of_the_encoded_header(header):
    assert header_nbytes(header) == len(encode_header(header))
