"""Transport selection, the GPU slot, token rules, and raw misbehaving peers."""

import asyncio
import socket

import pytest
import torch
from kv_helpers import CacheSink, make_ticket, random_caches, receiver_for, run

from baton.kv.conn import FrameConn
from baton.kv.layout import gather_layer
from baton.kv.messages import ErrorCode, ErrorInfo, decode_control
from baton.kv.shm import ShmTransport
from baton.kv.tcp import TcpTransport
from baton.kv.transport import TOKEN_ENV, internal_token, select_transport
from baton.kv.wire import FrameKind, layer_header


def test_select_by_name_and_endpoint():
    assert isinstance(select_transport("tcp"), TcpTransport)
    assert isinstance(select_transport("shm"), ShmTransport)
    assert isinstance(select_transport("auto"), TcpTransport)
    assert isinstance(select_transport("auto", "shm://decode-0"), ShmTransport)
    assert isinstance(select_transport("auto", "tcp://10.0.0.1:8101"), TcpTransport)
    with pytest.raises(ValueError, match="unknown name"):
        select_transport("carrier-pigeon")


def test_gpu_slot_says_why_it_cannot_run():
    with pytest.raises(NotImplementedError, match="kv transport 'gpu'"):
        select_transport("gpu")


def test_token_is_required(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=TOKEN_ENV):
        internal_token()
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert internal_token() == "s3cret"
    sink = CacheSink(1, 1, 16, 1, 1, torch.float32)
    assert (
        select_transport("tcp").receiver(sink, worker_id="w", address="127.0.0.1:0")._token
        == b"s3cret"
    )


async def raw_tcp(endpoint):
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return FrameConn(sock)


async def read_error(conn) -> ErrorInfo:
    h = await asyncio.wait_for(conn.recv_header(), 5)
    assert h.kind == FrameKind.ERROR
    return decode_control(h, (await conn.recv_payload(h.payload_nbytes)).numpy())


def test_layer_without_hello_is_refused_and_connection_closed():
    sink = CacheSink(4, 8, 16, 4, 8, torch.float32)
    ticket = sink.issue(make_ticket())
    ((k, v),) = random_caches(1, 8, 16, 4, 8, torch.float32)

    async def main():
        async with receiver_for("tcp", sink) as receiver:
            conn = await raw_tcp(receiver.endpoint)
            payload = gather_layer(k, v, [0, 1, 2], 16, 40, 0, 4)
            await conn.send(layer_header(ticket.request_id, 0, ticket.block_ids, payload), payload)
            info = await read_error(conn)
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(conn.recv_header(), 5)
            conn.close()
            return info

    info = run(main())
    assert info.code == ErrorCode.AUTH and "HELLO" in info.message
    assert sink.untouched()


def test_garbage_gets_a_protocol_error():
    sink = CacheSink(1, 1, 16, 1, 1, torch.float32)

    async def main():
        async with receiver_for("tcp", sink) as receiver:
            conn = await raw_tcp(receiver.endpoint)
            await conn.send_buffers([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"])
            info = await read_error(conn)
            conn.close()
            return info

    info = run(main())
    assert info.code == ErrorCode.PROTOCOL and "magic" in info.message
