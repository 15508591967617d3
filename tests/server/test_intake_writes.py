"""Direct (zero-copy) writes into reserved blocks racing a cancel: the blocks are freed only
after the write ends, and the engine thread never waits for the write."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from baton.engine.sequence import SequenceStatus
from baton.kv.stream import BackgroundLoop
from baton.kv.ticket import Ticket
from baton.server.intake import CANCELLED, OPEN, KVIntake, Reservation

BLOCK, HEADS, DIM, LAYERS = 16, 2, 4, 2


def ticket(rid="r1", blocks=(3, 4, 1), tokens=40) -> Ticket:
    return Ticket(request_id=rid, worker_id="d", kv_endpoint="tcp://127.0.0.1:1", block_ids=blocks,
                  block_size=BLOCK, dtype="float32", num_layers=LAYERS, num_kv_heads=HEADS,
                  head_dim=DIM, head_start=0, head_end=HEADS, num_tokens=tokens,
                  expires_at=time.time() + 60)


# -- the state machine -----------------------------------------------------------------------
def test_cancel_without_a_write_frees_at_once():
    res = Reservation(ticket(), "prefill")
    assert res.cancel() == "free" and res.state == CANCELLED
    assert res.cancel() == "refused"


def test_cancel_during_a_write_defers_the_free_to_the_last_writer():
    res = Reservation(ticket(), "prefill")
    res.start_write()
    res.start_write()
    assert res.cancel() == "deferred"
    with pytest.raises(RuntimeError, match="cancelled"):
        res.start_write()  # no new write once cancelled
    assert res.end_write(0, ok=True) is False  # another write is still going
    assert res.end_write(1, ok=True) is True  # the last one frees the blocks
    assert res.layers_written == set()  # nothing counts after a cancel
    assert not res.free_deferred


def test_a_write_ending_without_a_cancel_only_records_good_layers():
    res = Reservation(ticket(), "prefill")
    res.start_write()
    assert res.end_write(0, ok=False) is False
    res.start_write()
    assert res.end_write(1, ok=True) is False
    assert res.layers_written == {1} and res.state == OPEN


# -- the intake, with a real engine thread and a real receiver loop --------------------------
class EngineThread:
    """The engine's side as KVIntake sees it: calls run one at a time on their own thread;
    `release` records when the blocks were freed and what they held then."""

    def __init__(self, caches, rid):
        self.runner = SimpleNamespace(kv_caches=caches, kv_cache_bytes=lambda layer: None)
        self.sequences = {rid: SimpleNamespace(status=SequenceStatus.REMOTE)}
        self.freed: dict[str, list[torch.Tensor]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.engine = self

    async def call(self, fn, *args, **kwargs):
        return await asyncio.wrap_future(self._pool.submit(fn, self, *args, **kwargs))

    def release(self, rid):
        self.sequences.pop(rid)
        self.freed[rid] = [c.clone() for pair in self.runner.kv_caches for c in pair]


class Book:
    def __init__(self):
        self.pushed = []

    def push(self, rid, item):
        self.pushed.append((rid, item))


def test_a_cancel_racing_a_direct_write_frees_the_blocks_only_after_it():
    rid = "race"
    caches = [(torch.zeros(6, BLOCK, HEADS, DIM), torch.zeros(6, BLOCK, HEADS, DIM)) for _ in range(LAYERS)]
    engine = EngineThread(caches, rid)
    intake = KVIntake(engine, Book(), metrics=None, worker_id="d", kv_endpoint="tcp://127.0.0.1:1")
    t = ticket(rid)
    intake.reservations[rid] = Reservation(t, "prefill")
    half_written, go_on = threading.Event(), threading.Event()

    async def receiver_writes_layer_0():
        write = intake.begin_layer_write(t, 0)
        for i, view in enumerate(write.views):
            view[:] = b"\x07" * view.nbytes
            if i == 0:
                half_written.set()
                await asyncio.to_thread(go_on.wait, 10)  # the frame's bytes are slow to arrive
        write.end(ok=True)

    with BackgroundLoop("receiver") as receiver:
        writing = asyncio.run_coroutine_threadsafe(receiver_writes_layer_0(), receiver.loop)
        assert half_written.wait(10)
        assert asyncio.run(intake.cancel(rid, "ticket expired")) is True
        assert not writing.done()  # the cancel did not wait for the frame still being written
        assert rid not in engine.freed and rid not in intake.reservations  # blocks still held
        assert intake.lookup(rid) is None
        with pytest.raises(RuntimeError, match="no reservation"):
            intake.begin_layer_write(t, 1)  # no further write can start
        go_on.set()
        writing.result(10)
        deadline = time.monotonic() + 10
        while rid not in engine.freed and time.monotonic() < deadline:
            time.sleep(0.01)
    assert rid in engine.freed, "the last writer must free the cancelled reservation's blocks"
    # nothing was written after the free: the caches are as they were when it happened
    now = [c for pair in caches for c in pair]
    assert all(torch.equal(a, b) for a, b in zip(now, engine.freed[rid]))
    # and the write went only into the reserved blocks used by the prompt
    k, v = caches[0]
    assert (k[[3, 4]] == 0).sum() == 0 and (k[1, :8] == 0).sum() == 0
    assert k[[0, 2, 5]].abs().sum() == 0 and k[1, 8:].abs().sum() == 0
    assert intake.book.pushed and intake.book.pushed[0][0] == rid


def test_a_sampler_state_this_worker_cannot_continue_is_refused_before_the_ack():
    """The receiver answers END with an error instead of an ACK; the reservation stays open
    (for a retry, or expiry), and no commit is queued."""
    rid = "seeded"
    caches = [(torch.zeros(6, BLOCK, HEADS, DIM), torch.zeros(6, BLOCK, HEADS, DIM)) for _ in range(LAYERS)]
    intake = KVIntake(EngineThread(caches, rid), Book(), metrics=None, worker_id="d",
                      kv_endpoint="tcp://127.0.0.1:1")
    intake.reservations[rid] = Reservation(ticket(rid), "prefill")
    with pytest.raises(ValueError, match="sampler_state: format"):
        asyncio.run(intake.finish(ticket(rid), 5, None, stats=None, sampler_state="torch-cuda-philox/9:AAAA"))
    assert intake.reservations[rid].state == OPEN and not intake._commits and not intake.book.pushed
