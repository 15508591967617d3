"""The KV frame format (pure: bytes in, bytes out, no I/O).

A frame is a fixed 12-byte preamble, a header body, then `payload_nbytes` payload bytes
(unless the payload travels by reference, e.g. in a shared-memory segment named by `ref`).

    preamble  magic "BTKV" | version u8 | kind u8 | flags u8 | dtype u8 | body_len u32
    body      layer i32 | token_start u32 | token_end u32 | head_start u16 | head_end u16
              | ndim u8 | pad u8 | request_id_len u16 | num_block_ids u32 | ref_len u16
              | payload_nbytes u64 | payload_crc32c u32
              | shape u64[ndim] | request_id utf-8 | block_ids u32[n] | ref utf-8
              | header_crc32c u32   (over preamble and body before it)

All integers little-endian. LAYER payloads are [2, tokens, heads, head_dim] tensors; control
frames (HELLO, END, ACK, ERROR) carry small JSON documents (see messages.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from enum import IntEnum

import crc32c
import numpy as np
import torch

from baton.kv.blockviews import ViewPayload, checksum_views
from baton.kv.dtypes import dtype_code, dtype_from_code, dtype_name, itemsize, torch_dtype
from baton.kv.layout import gather_layer, scatter_layer  # noqa: F401  (the wire's tensor side)

MAGIC = b"BTKV"
VERSION = 1
FLAG_PAYLOAD_BY_REF = 0x01

PREAMBLE = struct.Struct("<4sBBBBI")
BODY = struct.Struct("<iIIHHBBHIHQI")
CRC = struct.Struct("<I")
PREAMBLE_SIZE = PREAMBLE.size

MAX_REQUEST_ID_BYTES = 256
MAX_REF_BYTES = 256
MAX_NDIM = 8
MAX_BLOCK_IDS = 1 << 20
MAX_BODY_BYTES = (
    BODY.size + 8 * MAX_NDIM + MAX_REQUEST_ID_BYTES + 4 * MAX_BLOCK_IDS + MAX_REF_BYTES + 4
)
MAX_CONTROL_PAYLOAD = 1 << 20  # JSON control documents are tiny; anything bigger is hostile


class FrameKind(IntEnum):
    HELLO = 1  # first frame on a connection: shared token (auth)
    LAYER = 2  # one layer's K/V for one request
    END = 3  # first sampled token + transfer summary
    ACK = 4  # receiver accepted (HELLO) or completed (END) the request
    ERROR = 5  # refusal with a code and a message


class WireError(ValueError):
    """A frame that cannot be trusted; the message says which check failed."""


class BadMagic(WireError):
    pass


class UnsupportedVersion(WireError):
    pass


class UnknownKind(WireError):
    pass


class HeaderCorrupt(WireError):
    pass


class SizeMismatch(WireError):
    pass


class ChecksumMismatch(WireError):
    pass


def checksum(data) -> int:
    """CRC32C of a bytes-like object (memoryview, bytearray, numpy buffer)."""
    return crc32c.crc32c(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (bf16 included, via a uint8 view)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("payload: must be a contiguous CPU tensor to go on the wire")
    return (
        memoryview(tensor.view(torch.uint8).numpy()).cast("B")
        if tensor.numel()
        else memoryview(b"")
    )


def payload_views(payload) -> list[memoryview]:
    """A payload as byte views in wire order: a tensor, a ViewPayload (block runs of a
    cache) or any bytes-like object. Empty views are dropped."""
    if isinstance(payload, ViewPayload):
        return [v for v in payload.views if v.nbytes]
    view = tensor_bytes(payload) if isinstance(payload, torch.Tensor) else memoryview(payload).cast("B")
    return [view] if view.nbytes else []


@dataclass(frozen=True)
class FrameHeader:
    kind: FrameKind
    request_id: str = ""
    layer: int = -1
    block_ids: tuple[int, ...] = ()  # destination blocks, token order
    token_start: int = 0
    token_end: int = 0
    head_start: int = 0
    head_end: int = 0
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    payload_nbytes: int = 0
    payload_crc: int = 0
    ref: str = ""  # where the payload lies when it is not inline (shared-memory segment name)

    @property
    def inline_nbytes(self) -> int:
        """Payload bytes that follow the header on the stream itself."""
        return 0 if self.ref else self.payload_nbytes

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


# -- building frames ---------------------------------------------------------------------


def layer_header(
    request_id: str,
    layer: int,
    block_ids,
    payload,
    *,
    token_start: int = 0,
    head_start: int = 0,
    ref: str = "",
) -> FrameHeader:
    """Header for one layer's payload [2, tokens, heads, head_dim] (a tensor or a
    ViewPayload); computes the checksum."""
    if payload.dim() != 4 or payload.shape[0] != 2:
        raise ValueError(
            f"payload: expected [2, tokens, heads, head_dim], got {tuple(payload.shape)}"
        )
    _, tokens, heads, _ = payload.shape
    views = payload_views(payload)
    return FrameHeader(
        kind=FrameKind.LAYER,
        request_id=request_id,
        layer=layer,
        block_ids=tuple(int(b) for b in block_ids),
        token_start=token_start,
        token_end=token_start + tokens,
        head_start=head_start,
        head_end=head_start + heads,
        dtype=dtype_name(payload.dtype),
        shape=tuple(payload.shape),
        payload_nbytes=sum(v.nbytes for v in views),
        payload_crc=checksum_views(views),
        ref=ref,
    )


class LayerHeaders:
    """The LAYER headers of one transfer. Its layers share the request id, blocks, ranges,
    dtype and shape, so those are checked and encoded once; a layer adds only its index
    and payload checksum. `encode` gives the bytes encode_header gives, without per-block
    Python work each layer (a 4,096-token layer names 256 blocks)."""

    def __init__(self, request_id: str, block_ids, shape, dtype: torch.dtype | str, *,
                 token_start: int = 0, head_start: int = 0):
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        self.template = FrameHeader(
            kind=FrameKind.LAYER, request_id=request_id, layer=0,
            block_ids=tuple(int(b) for b in block_ids),
            token_start=token_start, token_end=token_start + shape[1],
            head_start=head_start, head_end=head_start + shape[2],
            dtype=name, shape=tuple(shape), payload_nbytes=math.prod(shape) * itemsize(name),
        )
        raw = encode_header(self.template)  # validates every shared field once
        self._preamble = raw[:PREAMBLE_SIZE]
        self._fields = BODY.unpack_from(raw, PREAMBLE_SIZE)[1:-1]  # between layer and crc
        self._rest = raw[PREAMBLE_SIZE + BODY.size : -CRC.size]

    def header(self, layer: int, payload_crc: int) -> FrameHeader:
        return replace(self.template, layer=layer, payload_crc=payload_crc)

    def encode(self, layer: int, payload_crc: int) -> bytes:
        try:
            body = BODY.pack(layer, *self._fields, payload_crc)
        except struct.error as exc:
            raise WireError(f"header: a field does not fit its wire width ({exc})") from None
        if layer < 0:
            raise WireError(f"layer: must be >= 0 in a LAYER frame, got {layer}")
        head = b"".join((self._preamble, body, self._rest))
        return head + CRC.pack(checksum(head))


def control_header(
    kind: FrameKind, request_id: str, payload: bytes, layer: int = -1
) -> FrameHeader:
    return FrameHeader(
        kind=kind,
        request_id=request_id,
        layer=layer,
        payload_nbytes=len(payload),
        payload_crc=checksum(payload),
    )


def encode_header(h: FrameHeader) -> bytes:
    _check_consistent(h)
    rid = h.request_id.encode()
    ref = h.ref.encode()
    flags = FLAG_PAYLOAD_BY_REF if h.ref else 0
    code = dtype_code(h.dtype) if h.dtype else 0
    try:
        fixed = BODY.pack(
            h.layer,
            h.token_start,
            h.token_end,
            h.head_start,
            h.head_end,
            len(h.shape),
            0,
            len(rid),
            len(h.block_ids),
            len(ref),
            h.payload_nbytes,
            h.payload_crc,
        )
        shape = struct.pack(f"<{len(h.shape)}Q", *h.shape)
    except struct.error as exc:
        raise WireError(f"header: a field does not fit its wire width ({exc})") from None
    blocks = np.asarray(h.block_ids, dtype="<u4").tobytes()
    body_len = len(fixed) + len(shape) + len(rid) + len(blocks) + len(ref) + CRC.size
    pre = PREAMBLE.pack(MAGIC, VERSION, int(h.kind), flags, code, body_len)
    head = b"".join((pre, fixed, shape, rid, blocks, ref))
    return head + CRC.pack(checksum(head))


def header_nbytes(h: FrameHeader) -> int:
    """Bytes encode_header(h) gives: its preamble and body, without encoding it."""
    return (PREAMBLE_SIZE + BODY.size + 8 * len(h.shape) + len(h.request_id.encode()) + 4 * len(h.block_ids)
            + len(h.ref.encode()) + CRC.size)


def encode_frame(h: FrameHeader, payload=b"", header_bytes: bytes | None = None) -> list:
    """Buffers to write in order: the header bytes, then the payload itself (not copied;
    a ViewPayload or a list of byte views goes out as its pieces). `header_bytes`: h
    already encoded (by a LayerHeaders template), to skip encoding it again."""
    views = (
        [memoryview(v).cast("B") for v in payload if len(v)]
        if isinstance(payload, list | tuple)
        else payload_views(payload)
    )
    nbytes = sum(v.nbytes for v in views)
    if nbytes != h.inline_nbytes:
        raise SizeMismatch(f"payload: header says {h.inline_nbytes} inline bytes, got {nbytes}")
    return [encode_header(h) if header_bytes is None else header_bytes, *views]


# -- reading frames ----------------------------------------------------------------------


def body_length(preamble: bytes) -> int:
    """Validate the 12-byte preamble and return how many header bytes follow it."""
    if len(preamble) != PREAMBLE_SIZE:
        raise SizeMismatch(f"preamble: expected {PREAMBLE_SIZE} bytes, got {len(preamble)}")
    magic, version, kind, _flags, _dtype, body_len = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise BadMagic(f"magic: expected {MAGIC!r}, got {magic!r} (not a Baton KV stream)")
    if version != VERSION:
        raise UnsupportedVersion(f"version: this receiver speaks {VERSION}, frame has {version}")
    if kind not in FrameKind._value2member_map_:
        raise UnknownKind(f"kind: unknown frame kind {kind}")
    if not BODY.size + CRC.size <= body_len <= MAX_BODY_BYTES:
        raise SizeMismatch(
            f"header: body length {body_len} outside [{BODY.size + CRC.size}, {MAX_BODY_BYTES}]"
        )
    return body_len


def decode_header(data: bytes) -> FrameHeader:
    """Parse and validate a full header (preamble + body); raises WireError subclasses."""
    data = bytes(data)
    body_len = body_length(data[:PREAMBLE_SIZE])
    if len(data) != PREAMBLE_SIZE + body_len:
        raise SizeMismatch(f"header: expected {PREAMBLE_SIZE + body_len} bytes, got {len(data)}")
    (stored_crc,) = CRC.unpack_from(data, len(data) - CRC.size)
    if checksum(data[: -CRC.size]) != stored_crc:
        raise HeaderCorrupt("header: checksum mismatch (header bytes corrupted)")
    _, _, kind, flags, code, _ = PREAMBLE.unpack_from(data)
    (layer, t0, t1, h0, h1, ndim, _pad, rid_len, n_blocks, ref_len, nbytes, pcrc) = (
        BODY.unpack_from(data, PREAMBLE_SIZE)
    )
    if ndim > MAX_NDIM or rid_len > MAX_REQUEST_ID_BYTES or ref_len > MAX_REF_BYTES:
        raise HeaderCorrupt(
            f"header: ndim={ndim}, request_id_len={rid_len}, ref_len={ref_len} exceed limits"
        )
    pos = PREAMBLE_SIZE + BODY.size
    expected_len = pos + 8 * ndim + rid_len + 4 * n_blocks + ref_len + CRC.size
    if expected_len != len(data):
        raise SizeMismatch(f"header: fields need {expected_len} bytes, header has {len(data)}")
    shape = struct.unpack_from(f"<{ndim}Q", data, pos)
    pos += 8 * ndim
    try:
        request_id = data[pos : pos + rid_len].decode()
        ref = data[pos + rid_len + 4 * n_blocks : pos + rid_len + 4 * n_blocks + ref_len].decode()
    except UnicodeDecodeError as exc:
        raise HeaderCorrupt(f"header: request_id or ref is not UTF-8 ({exc})") from None
    blocks = np.frombuffer(data, dtype="<u4", count=n_blocks, offset=pos + rid_len)
    if bool(flags & FLAG_PAYLOAD_BY_REF) != bool(ref):
        raise HeaderCorrupt("header: by-reference flag and ref field disagree")
    try:
        dtype = dtype_from_code(code) if code else None
    except ValueError as exc:
        raise HeaderCorrupt(str(exc)) from None
    header = FrameHeader(
        kind=FrameKind(kind),
        request_id=request_id,
        layer=layer,
        block_ids=tuple(blocks.tolist()),
        token_start=t0,
        token_end=t1,
        head_start=h0,
        head_end=h1,
        dtype=dtype,
        shape=tuple(shape),
        payload_nbytes=nbytes,
        payload_crc=pcrc,
        ref=ref,
    )
    _check_consistent(header, decoded=True)
    return header


def _check_consistent(h: FrameHeader, decoded: bool = False) -> None:
    """Cross-field rules, shared by encoder and decoder so neither side accepts nonsense.
    `decoded`: the header was read off the wire, where block ids are u32 by construction."""
    if len(h.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise WireError(f"request_id: longer than {MAX_REQUEST_ID_BYTES} bytes")
    if h.kind == FrameKind.LAYER:
        if not h.request_id:
            raise WireError("request_id: a LAYER frame needs one")
        if h.layer < 0:
            raise WireError(f"layer: must be >= 0 in a LAYER frame, got {h.layer}")
        if h.dtype is None:
            raise WireError("dtype: a LAYER frame needs one")
        if h.token_end <= h.token_start or h.head_end <= h.head_start:
            raise WireError(
                f"range: tokens [{h.token_start}, {h.token_end}) and heads "
                f"[{h.head_start}, {h.head_end}) must be non-empty"
            )
        if len(h.shape) != 4 or h.shape[:3] != (2, h.num_tokens, h.head_end - h.head_start):
            raise SizeMismatch(
                f"shape: {h.shape} does not match [2, {h.num_tokens} tokens, "
                f"{h.head_end - h.head_start} heads, head_dim]"
            )
        expected = math.prod(h.shape) * itemsize(h.dtype)
        if expected != h.payload_nbytes:
            raise SizeMismatch(
                f"payload_nbytes: shape {h.shape} of {h.dtype} is {expected} bytes, header says {h.payload_nbytes}"
            )
    else:
        if h.dtype is not None or h.shape or h.block_ids or h.ref:
            raise WireError(f"kind: a {h.kind.name} frame carries no tensor fields")
        if h.payload_nbytes > MAX_CONTROL_PAYLOAD:
            raise SizeMismatch(
                f"payload_nbytes: {h.payload_nbytes} is too large for a {h.kind.name} frame"
            )
    if len(h.block_ids) > MAX_BLOCK_IDS or (
        not decoded and any(not 0 <= b < 2**32 for b in h.block_ids)
    ):
        raise WireError("block_ids: must be at most 2^20 ids in [0, 2^32)")


def verify_payload(h: FrameHeader, payload) -> None:
    """Raise SizeMismatch or ChecksumMismatch unless `payload` is what the header promises."""
    view = memoryview(payload).cast("B")
    if view.nbytes != h.payload_nbytes:
        raise SizeMismatch(f"payload: header says {h.payload_nbytes} bytes, got {view.nbytes}")
    got = checksum(view)
    if got != h.payload_crc:
        raise ChecksumMismatch(
            f"checksum: layer {h.layer} of {h.request_id!r} has CRC32C {got:#010x}, header says {h.payload_crc:#010x}"
        )


def payload_tensor(h: FrameHeader, payload) -> torch.Tensor:
    """View a verified LAYER payload buffer as its tensor, without copying."""
    if h.kind != FrameKind.LAYER:
        raise WireError(f"kind: {h.kind.name} frames carry no tensor")
    return torch.frombuffer(payload, dtype=torch_dtype(h.dtype), count=math.prod(h.shape)).view(
        h.shape
    )
