"""The leader's command connections to its ranks: only a rank holding the key gets one, and
messages sent back to back do not wait for the peer's delayed ACK."""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time

import pytest

from baton.engine.parallel.control import ControlListener, connect_to_leader


@pytest.fixture
def leader():
    listener = ControlListener()
    yield listener
    listener.close()


def _connect(listener: ControlListener, rank: int, key: bytes, out: dict) -> None:
    try:
        out[rank] = connect_to_leader(listener.address, rank, 5, authkey=key)
    except OSError as exc:
        out[rank] = exc


def test_only_a_rank_with_the_groups_key_is_accepted(leader):
    strangers: dict = {}
    ranks: dict = {}
    stranger = threading.Thread(target=_connect, args=(leader, 1, os.urandom(32), strangers))
    stranger.start()
    time.sleep(0.2)  # first in the queue: its wrong answer is dropped, the rank after it taken
    rank = threading.Thread(target=_connect, args=(leader, 1, leader.authkey, ranks))
    rank.start()
    accepted = leader.accept_ranks({1}, time.monotonic() + 5, lambda: None)
    stranger.join(5)
    rank.join(5)
    accepted[1].send(("ping",))
    assert ranks[1].poll(5) and ranks[1].recv() == ("ping",)
    assert strangers[1].poll(5)  # the stranger's connection was closed unanswered
    with pytest.raises(EOFError):
        strangers[1].recv()


def test_messages_sent_back_to_back_are_not_held_back_by_nagles_algorithm(leader):
    """A rank answers a call and, a moment later, reports the work the call started (a KV
    stream's acknowledgement); without TCP_NODELAY the second small write waits for the
    leader's delayed ACK of the first, ~40 ms on Linux, on the path of every handoff."""
    conns: dict = {}
    rank = threading.Thread(target=_connect, args=(leader, 1, leader.authkey, conns))
    rank.start()
    to_rank = leader.accept_ranks({1}, time.monotonic() + 5, lambda: None)[1]
    rank.join(5)
    at_rank = conns[1]
    for conn in (to_rank, at_rank):
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        sock.close()

    def serve():
        for _ in range(10):
            call = at_rank.recv()
            at_rank.send(("reply", call[1], True, None))
            at_rank.send(("event", ("export_done", call[1], None, 0)))

    threading.Thread(target=serve, daemon=True).start()
    rounds = []
    for i in range(10):
        started = time.perf_counter()
        to_rank.send(("call", i, "kv_finish", ()))
        assert to_rank.recv()[0] == "reply" and to_rank.recv()[0] == "event"
        rounds.append(time.perf_counter() - started)
    assert statistics.median(rounds) < 0.02, f"a call and its event took {statistics.median(rounds) * 1e3:.1f} ms"
