"""What an unauthenticated peer can cost a KV receiver: raw sockets against a real one."""

import asyncio
import socket
import time
import tracemalloc

import torch
from kv_helpers import TOKEN, CacheSink, receiver_for, run

from baton.kv.conn import FrameConn
from baton.kv.messages import Ack, ErrorCode, Hello, decode_control, encode_control
from baton.kv.wire import MAGIC, MAX_BODY_BYTES, PREAMBLE, VERSION, FrameKind


async def raw_socket(endpoint) -> socket.socket:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return sock


async def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the receiver closes this connection (reads and drops what it sent)."""
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    async with asyncio.timeout(seconds):
        while await loop.sock_recv(sock, 65536):
            pass
    return time.monotonic() - start


async def hello_answer(endpoint, token=TOKEN):
    conn = FrameConn(await raw_socket(endpoint))
    try:
        header, payload = encode_control(FrameKind.HELLO, "", Hello(token=token, worker_id="decode-0"))
        await conn.send(header, payload)
        h = await asyncio.wait_for(conn.recv_header(), 5)
        return decode_control(h, (await conn.recv_payload(h.payload_nbytes)).numpy())
    finally:
        conn.close()


def test_a_preamble_claiming_a_huge_header_allocates_nothing_big():
    """Twenty 12-byte preambles, each announcing the largest header, before any token."""
    sink = CacheSink(1, 1, 16, 1, 1, torch.float32)
    big = MAX_BODY_BYTES

    async def main():
        async with receiver_for("tcp", sink) as receiver:
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                socks = []
                for kind in (FrameKind.HELLO, FrameKind.LAYER):
                    for _ in range(10):
                        sock = await raw_socket(receiver.endpoint)
                        sock.send(PREAMBLE.pack(MAGIC, VERSION, int(kind), 0, 0, big))
                        socks.append(sock)
                await asyncio.sleep(0.5)
                grown = tracemalloc.get_traced_memory()[0] - base
            finally:
                tracemalloc.stop()
            waits = [await closed_within(s, 3) for s in socks]  # refused, not held
            for s in socks:
                s.close()
            return grown, waits

    grown, waits = run(main())
    assert big > 4 << 20
    assert grown < 2 << 20, f"{grown} bytes allocated for unauthenticated peers"
    assert max(waits) < 3


def test_a_silent_connection_is_closed_after_the_handshake_timeout():
    sink = CacheSink(1, 1, 16, 1, 1, torch.float32)

    async def main():
        async with receiver_for("tcp", sink, handshake_timeout=0.5) as receiver:
            sock = await raw_socket(receiver.endpoint)
            sock.send(PREAMBLE.pack(MAGIC, VERSION, int(FrameKind.HELLO), 0, 0, 42)[:7])  # and stalls
            try:
                return await closed_within(sock, 5)
            finally:
                sock.close()

    assert 0.4 < run(main()) < 2.0


def test_unauthenticated_connections_are_capped_and_the_token_still_gets_in():
    sink = CacheSink(1, 1, 16, 1, 1, torch.float32)

    async def main():
        async with receiver_for("tcp", sink, max_unauthenticated=4, handshake_timeout=30) as receiver:
            silent = [await raw_socket(receiver.endpoint) for _ in range(4)]
            await asyncio.sleep(0.2)
            extra = await raw_socket(receiver.endpoint)
            refused_after = await closed_within(extra, 2)  # at once, not after 30 s
            extra.close()
            for s in silent:
                s.close()
            await asyncio.sleep(0.2)  # their handshakes end with the connections
            answer = await hello_answer(receiver.endpoint)
            wrong = await hello_answer(receiver.endpoint, token="guess")
            return refused_after, receiver.refused_connections, answer, wrong

    refused_after, refused, answer, wrong = run(main())
    assert refused_after < 1.0 and refused == 1
    assert isinstance(answer, Ack)
    assert wrong.code == ErrorCode.AUTH
